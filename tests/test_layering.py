"""Imports flow one way: kernels <- models <- parallel <- training <- entry points, with config at the
bottom and data_tools / launch beside the chain. Every module under megassm/, kernels/, data_tools/ and
launch/ is parsed (every import statement, function-level ones included); an import of a group the
module's group may not use fails, naming the module, the line and the import."""
import ast
import functools
import os
import runpy

import pytest
import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# group -> the groups its modules may import besides their own
ALLOWED = {
    "config": set(),
    "kernels": set(),
    "models": {"config", "kernels"},
    "parallel": {"config", "kernels", "models"},
    "training": {"config", "kernels", "models", "parallel", "data_tools"},
    "entry": {"config", "kernels", "models", "parallel", "training", "data_tools", "launch"},
    "data_tools": set(),
    "launch": {"config", "data_tools"},
}
GROUP_OF = {  # longest prefix wins
    "megassm": "entry", "megassm.train": "entry", "megassm.checkpoint_cli": "entry", "megassm.evaluation": "entry",
    "megassm.synthetic": "entry", "megassm.config": "config", "megassm.kernels": "kernels",
    "megassm.models": "models", "megassm.parallel": "parallel", "megassm.training": "training",
    "megassm.data_tools": "data_tools", "megassm.launch": "launch",
    "megassm.interop": "training", "megassm.export_cli": "entry", "megassm.generate_cli": "entry",
    "megassm.planner": "entry",
}
# The one import allowed against the flow, each with its reason (docs/architecture.md, "Layers"):
EXCEPTIONS = {
    ("megassm.config", "megassm.models.registry"):
        "config.validate() runs each block kind's own checks, which live with the kind in the registry; "
        "the import is inside the functions, so importing config alone pulls in no model code",
}


def group_of(module: str) -> str | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        g = GROUP_OF.get(".".join(parts[:n]))
        if g is not None and (n > 1 or len(parts) == 1):
            return g
    return None


@functools.lru_cache(maxsize=None)
def setup_kwargs() -> dict:
    """What setup.py passes to setuptools.setup (read-only): setup.py run with setup() replaced by a recorder."""
    seen: dict = {}
    real = setuptools.setup
    setuptools.setup = lambda **kw: seen.update(kw)
    try:
        runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="setup")
    finally:
        setuptools.setup = real
    return seen


def package_dirs() -> dict[str, str]:
    """{package: folder} as setup.py gives them to setuptools (kernels/core/ is megassm.kernels, kernels/triton/
    megassm.kernels.triton, ...)."""
    seen = setup_kwargs()
    assert set(seen["package_dir"]) == set(seen["packages"]), "every package has its folder in package_dir"
    return seen["package_dir"]


def modules() -> dict[str, tuple[str, bool]]:
    """{module name: (file, is package)} of every module the build installs."""
    found = {}
    for pkg, folder in package_dirs().items():
        for f in sorted(os.listdir(os.path.join(ROOT, folder))):
            if f.endswith(".py"):
                path = os.path.join(ROOT, folder, f)
                found[pkg if f == "__init__.py" else f"{pkg}.{f[:-3]}"] = (path, f == "__init__.py")
    return found


def imports(source: str, module: str, is_pkg: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported megassm module) of every import statement in `source`, relative ones resolved;
    `from a import b` counts as a.b where a.b is a module."""
    package = module if is_pkg else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            out += [(node.lineno, t) for t in subs] or [(node.lineno, target)]
    return [(line, t) for line, t in out if t == "megassm" or t.startswith("megassm.")]


def violations(found: dict[str, tuple[str, bool]]) -> list[str]:
    known = set(found)
    bad = []
    for module, (path, is_pkg) in sorted(found.items()):
        g = group_of(module)
        if g is None:
            bad.append(f"{module}: in no layer (add it to GROUP_OF in tests/test_layering.py)")
            continue
        with open(path) as f:
            src = f.read()
        for line, target in imports(src, module, is_pkg, known):
            tg = group_of(target)
            if tg != g and tg not in ALLOWED[g] and (module, target) not in EXCEPTIONS:
                bad.append(f"{module} ({g}) line {line}: imports {target} ({tg})")
    return bad


def test_imports_flow_one_way():
    found = modules()
    assert {"megassm.kernels.ops", "megassm.models.mamba2", "megassm.parallel.tp", "megassm.training.trainer",
            "megassm.data_tools.loader", "megassm.launch.cli", "megassm.train"} <= set(found)
    bad = violations(found)
    assert not bad, "imports that run up a layer:\n" + "\n".join(bad)


@pytest.mark.parametrize("module,is_pkg,source,want", [
    ("megassm.parallel.runtime", False, "def f():\n    from megassm.training.optim import clip_grad_norm\n",
     "megassm.training.optim"),
    ("megassm.parallel.runtime", False, "from ..training import checkpoint\n", "megassm.training.checkpoint"),
    ("megassm.models.lm", False, "import megassm.parallel.tp as tp\n", "megassm.parallel.tp"),
    ("megassm.kernels.ops", False, "from megassm import models\n", "megassm.models"),
    ("megassm.data_tools.loader", False, "from megassm.models import build_model\n", "megassm.models"),
])
def test_an_upward_import_is_caught(tmp_path, module, is_pkg, source, want):
    """The checker itself: a planted upward import (function-level, relative, aliased) is reported."""
    found = modules()
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    found[module] = (str(planted), is_pkg)
    bad = violations(found)
    assert any(b.startswith(f"{module} (") and f"imports {want} " in b for b in bad), bad

"""Imports flow one way: kernels <- models <- parallel <- training <- entry points, with config at the
bottom and data_tools / launch beside the chain. Every module under megassm/, kernels/, data_tools/ and
launch/ is parsed (every import statement, function-level ones included); an import of a group the
module's group may not use fails, naming the module, the line and the import. Within a group the imports
form no cycle (a cycle fails, naming its modules), and no module imports another's underscore names
(`from megassm.x import _y`, `x._y`) but the allow-listed ones, each with its reason."""
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
    ("megassm.config.checks", "megassm.models.registry"):
        "config.validate() runs each block kind's own checks, which live with the kind in the registry; "
        "the import is inside the functions, so importing config alone pulls in no model code",
    ("megassm.config.sections", "megassm.models.registry"):
        "block_letters(): the pattern letters are the registered block kinds (the same import, inside the function)",
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
    """{package: folder} as setup.py gives them to setuptools (kernels/core/ is megassm.kernels, kernels/norm/
    megassm.kernels.norm, ...)."""
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


def _target(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    """The module a `from ... import` names, relative ones resolved against `module`'s package."""
    if not node.level:
        return node.module
    base = module if is_pkg else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def import_statements(source: str, module: str, is_pkg: bool) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import statement in `source`, function-level ones included: `import a.b`
    is (line, "a.b", []), `from a import b, c` (line, "a", ["a.b", "a.c"]), relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _target(node, module, is_pkg)
            out.append((node.lineno, target, [f"{target}.{a.name}" for a in node.names]))
    return out


def imports(source: str, module: str, is_pkg: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported megassm module) of every import statement in `source`, relative ones resolved;
    `from a import b` counts as a.b where a.b is a module."""
    out = []
    for line, target, names in import_statements(source, module, is_pkg):
        out += [(line, t) for t in names if t in known] or [(line, target)]
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
    assert {"megassm.kernels.mamba2_ssd.op", "megassm.models.mamba2", "megassm.parallel.tp", "megassm.training.trainer",
            "megassm.data_tools.loader", "megassm.launch.cli", "megassm.train"} <= set(found)
    bad = violations(found)
    assert not bad, "imports that run up a layer:\n" + "\n".join(bad)


def planted_in(tmp_path, module: str, source: str, is_pkg: bool = False) -> dict:
    """The project's modules with `module` replaced by a file of `source` (the checkers' self-tests)."""
    found = modules()
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    found[module] = (str(planted), is_pkg)
    return found


@pytest.mark.parametrize("module,is_pkg,source,want", [
    ("megassm.parallel.runtime", False, "def f():\n    from megassm.training.optim import clip_grad_norm\n",
     "megassm.training.optim"),
    ("megassm.parallel.runtime", False, "from ..training import checkpoint\n", "megassm.training.checkpoint"),
    ("megassm.models.lm", False, "import megassm.parallel.tp as tp\n", "megassm.parallel.tp"),
    ("megassm.kernels.mamba2_ssd.op", False, "from megassm import models\n", "megassm.models"),
    ("megassm.data_tools.loader", False, "from megassm.models import build_model\n", "megassm.models"),
])
def test_an_upward_import_is_caught(tmp_path, module, is_pkg, source, want):
    """The checker itself: a planted upward import (function-level, relative, aliased) is reported."""
    found = planted_in(tmp_path, module, source, is_pkg)
    bad = violations(found)
    assert any(b.startswith(f"{module} (") and f"imports {want} " in b for b in bad), bad


# ----------------------------------------------------------------------------------------------------
# No import cycles
# ----------------------------------------------------------------------------------------------------


def import_graph(found: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """{module: {installed module it imports: first line}}, every import statement (function-level ones too: a
    deferred import still needs the other module loaded first). `from megassm.parallel import X` (X not a
    module) is an edge to the package's __init__; the implicit import of a module's parent packages is not
    an edge (every __init__ that imports its own modules would be a cycle)."""
    known = set(found)
    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_pkg) in found.items():
        with open(path) as f:
            src = f.read()
        edges = graph.setdefault(module, {})
        for line, target in imports(src, module, is_pkg, known):
            if target in known and target != module:
                edges.setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each strongly connected component of more than one module (Tarjan's, iteratively), as one cycle through
    its first module in words ("a -(line 3)-> b -(line 9)-> a": a's line 3 imports b) and the component's
    modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    out = []
    for comp in sorted(comps):
        start, members = comp[0], set(comp)
        order, prev = [start], {start: None}  # breadth first from start: the shortest way back to it
        for v in order:
            if start in graph[v]:
                end = v
                break
            for w in sorted(graph[v]):
                if w in members and w not in prev:
                    prev[w] = v
                    order.append(w)
        path = [end]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        path = path[::-1] + [start]
        steps = "".join(f"{a} -(line {graph[a][b]})-> " for a, b in zip(path, path[1:]))
        out.append(f"{steps}{start}; the cycle's modules: {comp}")
    return out


def test_no_import_cycles():
    """Within a layer too, imports run one way: what two modules share lives in a module below both
    (docs/architecture.md, "Layers")."""
    found = cycles(import_graph(modules()))
    assert not found, "import cycles (move what the modules share into a module both import):\n" + "\n".join(found)


def test_an_import_cycle_is_caught(tmp_path):
    """The checker itself: a planted function-level import that closes a loop is reported, naming the modules."""
    # engines -> engine_base -> dp -> engines
    found = planted_in(tmp_path, "megassm.parallel.dp", "def f():\n    from megassm.parallel.engines import build_engine\n")
    bad = cycles(import_graph(found))
    assert len(bad) == 1 and all(m in bad[0] for m in ("megassm.parallel.dp", "megassm.parallel.engines",
                                                       "megassm.parallel.engine_base")), bad


# ----------------------------------------------------------------------------------------------------
# No reaching into another module's private names
# ----------------------------------------------------------------------------------------------------

# (importer, module whose underscore names it uses): the reason. "pkg.*" stands for the package and every module
# under it. A new entry needs a reason why the name is not made public or moved instead.
PRIVATE_ALLOWED = {
    ("megassm.kernels.mamba2_ssd.*", "megassm.kernels.mamba2_ssd.*"):
        "the SSD's shared @triton.jit helpers (triton_ssd_common: tiles, precisions, matmul forms; triton_ssd / "
        "triton_ssd_states: the pieces the backward reruns; the read-out's products) are one set of building "
        "blocks split over files, not API",
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _matches(pattern: str, module: str) -> bool:
    if pattern.endswith(".*"):
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    return module == pattern


def private_uses(source: str, module: str, is_pkg: bool, known: set[str]) -> list[tuple[int, str, str]]:
    """(line, other module, its underscore name) for every `from megassm.x import _y` and every `x._y` where x is
    a name this source binds to another installed module by an import."""
    tree = ast.parse(source)
    out, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _target(node, module, is_pkg)
            if not (target == "megassm" or target.startswith("megassm.")):
                continue
            for a in node.names:
                if f"{target}.{a.name}" in known:
                    aliases[a.asname or a.name] = f"{target}.{a.name}"
                elif _is_private(a.name) and target != module:
                    out.append((node.lineno, target, a.name))
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _is_private(node.attr)
                and aliases.get(node.value.id, module) != module):
            out.append((node.lineno, aliases[node.value.id], node.attr))
    return out


def private_violations(found: dict[str, tuple[str, bool]]) -> list[str]:
    known = set(found)
    bad = []
    for module, (path, is_pkg) in sorted(found.items()):
        with open(path) as f:
            src = f.read()
        for line, target, name in private_uses(src, module, is_pkg, known):
            if not any(_matches(a, module) and _matches(b, target) for a, b in PRIVATE_ALLOWED):
                bad.append(f"{module} line {line}: uses {target}.{name}")
    return bad


def test_no_private_names_across_modules():
    """A name with a leading underscore is its module's own: another module that needs it gets it public (or
    the function moves to where it is used)."""
    bad = private_violations(modules())
    assert not bad, ("underscore names used from another module (make them public, or move them):\n"
                     + "\n".join(bad))


def test_allow_list_entries_are_used_and_give_reasons():
    """An entry whose reach-ins are gone (made public, moved) goes too, so the list only shrinks."""
    found = modules()
    used = set()
    for module, (path, is_pkg) in found.items():
        with open(path) as f:
            used |= {(module, target) for _, target, _ in private_uses(f.read(), module, is_pkg, set(found))}
    for (importer, target), reason in PRIVATE_ALLOWED.items():
        assert len(reason) > 10, f"{importer} -> {target}: no reason given"
        assert any(_matches(importer, a) and _matches(target, b) for a, b in used), \
            f"{importer} -> {target}: allowed, but no such use is left; remove the entry"


@pytest.mark.parametrize("module,is_pkg,source,want", [
    ("megassm.training.trainer", False, "from megassm.training.checkpoint import _torch_load\n",
     "megassm.training.checkpoint._torch_load"),
    ("megassm.training.trainer", False, "def f():\n    from ..parallel.engines import _x\n",
     "megassm.parallel.engines._x"),
    ("megassm.training.trainer", False, "from megassm.training import checkpoint as c\nc._torch_load(p, 'cpu')\n",
     "megassm.training.checkpoint._torch_load"),
    ("megassm.training.trainer", False, "import megassm.parallel.engines as e\ne._y\n", "megassm.parallel.engines._y"),
])
def test_a_private_import_is_caught(tmp_path, module, is_pkg, source, want):
    """The checker itself: a planted reach-in (absolute, relative and function-level, through a module alias)."""
    found = planted_in(tmp_path, module, source, is_pkg)
    bad = private_violations(found)
    assert any(b.startswith(f"{module} line ") and b.endswith(f"uses {want}") for b in bad), bad


# ----------------------------------------------------------------------------------------------------
# The models know nothing of parallelism
# ----------------------------------------------------------------------------------------------------
# Context and tensor parallelism are applied from outside (parallel/cp.py, parallel/tp.py): no model module
# imports a parallel plan or torch.distributed, and no model function takes a `cp` / `tp` argument.
PARALLEL_MODULES = ("megassm.parallel", "torch.distributed")
PARALLEL_ARGS = {"cp", "tp"}


def every_import(source: str, module: str, is_pkg: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in `source`, function-level ones included, relative ones resolved:
    `import a.b` gives a.b, `from a import b` gives a and a.b, `importlib.import_module("a")` and
    `__import__("a")` with a constant name give a."""
    out = [(line, t) for line, target, names in import_statements(source, module, is_pkg) for t in [target, *names]]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def model_sources(found: dict[str, tuple[str, bool]]):
    """(module, is package, source) of every module of the models layer."""
    for module, (path, is_pkg) in sorted(found.items()):
        if group_of(module) == "models":
            with open(path) as f:
                yield module, is_pkg, f.read()


def parallel_imports(found: dict[str, tuple[str, bool]]) -> list[str]:
    bad = []
    for module, is_pkg, src in model_sources(found):
        for line, name in every_import(src, module, is_pkg):
            if any(name == p or name.startswith(p + ".") for p in PARALLEL_MODULES):
                bad.append(f"{module} line {line}: imports {name}")
    return bad


def parallel_args(found: dict[str, tuple[str, bool]]) -> list[str]:
    bad = []
    for module, _, src in model_sources(found):
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x]
                for n in PARALLEL_ARGS.intersection(names):
                    bad.append(f"{module} line {node.lineno}: {getattr(node, 'name', 'lambda')} takes `{n}`")
    return bad


def test_models_import_no_parallelism():
    bad = parallel_imports(modules())
    assert not bad, ("megassm/models imports parallel code (apply the plan from megassm/parallel instead):\n"
                     + "\n".join(bad))


def test_models_take_no_parallel_arguments():
    bad = parallel_args(modules())
    assert not bad, ("a model function takes a parallelism argument (the plans in megassm/parallel apply it from "
                     "outside):\n" + "\n".join(bad))


@pytest.mark.parametrize("source,want", [
    ("from megassm.parallel.cp import CPContext\n", "megassm.parallel.cp"),
    ("def f():\n    from ..parallel import tp\n", "megassm.parallel"),
    ("import torch.distributed as dist\n", "torch.distributed"),
    ("from torch import distributed\n", "torch.distributed"),
    ("from torch.distributed.tensor import DTensor\n", "torch.distributed.tensor"),
    ("import importlib\nimportlib.import_module('megassm.parallel.tp')\n", "megassm.parallel.tp"),
])
def test_a_parallel_import_in_models_is_caught(tmp_path, source, want):
    """The checker itself: a planted import of parallel code into a model module (absolute, relative,
    function-level, aliased, through importlib) is reported."""
    found = planted_in(tmp_path, "megassm.models.lm", source)
    bad = parallel_imports(found)
    assert any(b.startswith("megassm.models.lm line ") and b.endswith(f"imports {want}") for b in bad), bad


@pytest.mark.parametrize("source", [
    "def forward(x, seq_idx=None, cp=None):\n    return x\n",
    "class M:\n    def scan(self, x, *, tp):\n        return x\n",
    "f = lambda x, cp: x\n",
])
def test_a_parallel_argument_in_models_is_caught(tmp_path, source):
    found = planted_in(tmp_path, "megassm.models.mamba2", source)
    bad = parallel_args(found)
    assert any(b.startswith("megassm.models.mamba2 line ") for b in bad), bad

"""kernels/ is one folder per op (docs/architecture.md, "Kernels"): each holds its pure-PyTorch reference
(reference.py), its Triton forward and backward (triton_*.py), its custom-op registration (op.py) and an __init__.py
whose docstring names the op's tests; kernels/core/ keeps the public signatures and the dispatch only, and
kernels/common/ the Triton helpers the ops share. Read from the source (ast), nothing is imported or run."""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "kernels")
CORE_MODULES = {"__init__.py", "dispatch.py", "env.py", "grad_blocks.py"}  # nothing of one op's
SHARED = {"core", "common"}
# each op's Triton entry points (forward, backward, decode step) that its triton_*.py files must define
TRITON_ENTRIES = {
    "act": {"swiglu_fwd", "swiglu_bwd"},
    "coffee": {"coffee_scan_fwd", "coffee_scan_bwd"},
    "conv1d": {"causal_conv1d_fwd", "causal_conv1d_bwd", "causal_conv1d_step_fwd"},
    "fp8": {"cast_transpose"},  # casts only: fp8_linear's matmuls are torch._scaled_mm
    "loss": {"cross_entropy_fwd", "cross_entropy_bwd"},
    "mamba2_ssd": {"ssd_fwd", "ssd_bwd", "ssd_step_fwd", "readout_fwd", "readout_bwd"},
    "norm": {"gated_rmsnorm_fwd", "gated_rmsnorm_bwd", "add_rmsnorm_fwd", "add_rmsnorm_bwd"},
    "scan": {"selective_scan_fwd", "selective_scan_bwd", "selective_scan_step_fwd"},
}


def op_folders() -> list[str]:
    return sorted(n for n in os.listdir(KERNELS) if n not in SHARED and os.path.isfile(os.path.join(KERNELS, n,
                                                                                                   "__init__.py")))


def parse(path: str) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read())


def defined(path: str) -> set[str]:
    return {n.name for n in parse(path).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_every_op_has_a_table_entry():
    assert op_folders() == sorted(TRITON_ENTRIES)
    assert not os.path.exists(os.path.join(KERNELS, "__init__.py"))  # setup.py: kernels/ is no package


def test_core_holds_the_dispatch_only():
    """kernels/core/: the public signatures, dispatch.py, env.py, grad_blocks.py; an op's code is in its folder."""
    assert {f for f in os.listdir(os.path.join(KERNELS, "core")) if f.endswith(".py")} == CORE_MODULES


@pytest.mark.parametrize("op", sorted(TRITON_ENTRIES))
def test_op_folder_has_reference_triton_and_registration(op):
    folder = os.path.join(KERNELS, op)
    files = set(os.listdir(folder))
    assert {"__init__.py", "reference.py", "op.py"} <= files, files
    triton_files = sorted(f for f in files if f.startswith("triton_") and f.endswith(".py"))
    assert triton_files, f"kernels/{op}/ has no triton_*.py"
    entries = set().union(*(defined(os.path.join(folder, f)) for f in triton_files))
    assert TRITON_ENTRIES[op] <= entries, f"kernels/{op}/triton_*.py lack {sorted(TRITON_ENTRIES[op] - entries)}"
    # the Triton modules op.py registers (dispatch.triton_module) are files of this folder
    registered = re.findall(r'triton_module\("megassm\.kernels\.(\w+)\.(\w+)"\)',
                            open(os.path.join(folder, "op.py")).read())
    assert registered and all(o == op and f"{m}.py" in triton_files for o, m in registered), registered


@pytest.mark.parametrize("op", sorted(TRITON_ENTRIES))
def test_op_folder_imports_no_triton_at_import(op):
    """__init__.py, op.py and reference.py import without Triton (the CPU path; Triton reads TRITON_INTERPRET when
    the kernels are decorated, so they are imported lazily, through dispatch.triton_module)."""
    for name in ("__init__.py", "op.py", "reference.py"):
        for node in parse(os.path.join(KERNELS, op, name)).body:
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # `from .triton_x import f`, `from . import triton_x`
                mods = [node.module or ""] + ([a.name for a in node.names] if not node.module else [])
            else:
                continue
            assert not any(m.split(".")[0] == "triton" or m.split(".")[-1].startswith("triton_") for m in mods), \
                f"kernels/{op}/{name} line {node.lineno} imports Triton"


@pytest.mark.parametrize("op", sorted(TRITON_ENTRIES))
def test_op_docstring_names_tests_that_exist(op):
    doc = ast.get_docstring(parse(os.path.join(KERNELS, op, "__init__.py"))) or ""
    tests = re.findall(r"tests/test_\w+\.py", doc)
    assert tests, f"kernels/{op}/__init__.py's docstring names no tests/test_*.py"
    missing = [t for t in tests if not os.path.isfile(os.path.join(ROOT, t))]
    assert not missing, f"kernels/{op}/__init__.py names missing tests: {missing}"


def _target(node: ast.ImportFrom, own: str) -> str:
    """The module a `from ... import` in kernels/<own>/ names, relative ones resolved."""
    if not node.level:
        return node.module or ""
    base = ["megassm", "kernels", own][: 4 - node.level]
    return ".".join(base + ([node.module] if node.module else []))


def _op_of(module: str):
    """The op folder module `megassm.kernels.<op>...` belongs to, else None (core, common, anything else)."""
    m = re.match(r"megassm\.kernels\.(\w+)", module)
    return m.group(1) if m and m.group(1) in TRITON_ENTRIES else None


def _reach_ins(path: str, own: str) -> list[str]:
    """Underscore names of another op folder that kernels/<own>/<path> uses: `from <its module> import _x`, and
    `m._x` where m is bound to its module by an import."""
    bad, aliases = [], {}
    tree = parse(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _target(node, own)
            for a in node.names:
                other = _op_of(target) or _op_of(f"{target}.{a.name}")
                if other in (None, own):
                    continue
                if a.name.startswith("_"):
                    bad.append(f"line {node.lineno}: {target}.{a.name}")
                aliases[a.asname or a.name] = other
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: _op_of(a.name) for a in node.names if a.asname and _op_of(a.name) not in
                            (None, own)})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            bad.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return bad


def test_no_op_folder_uses_another_ops_private_names():
    bad = []
    for folder in sorted(os.listdir(KERNELS)):
        if folder == "core" or not os.path.isdir(os.path.join(KERNELS, folder)):
            continue
        for f in sorted(os.listdir(os.path.join(KERNELS, folder))):
            if f.endswith(".py"):
                bad += [f"kernels/{folder}/{f} {b}" for b in
                        _reach_ins(os.path.join(KERNELS, folder, f), folder)]
    assert not bad, "underscore names of another op's folder (move the helper to kernels/common/):\n" + "\n".join(bad)


def test_the_private_check_catches_a_reach_in(tmp_path):
    """The checker itself: relative and absolute reach-ins, and one through a module alias."""
    p = tmp_path / "planted.py"
    p.write_text("from ..mamba2_ssd.triton_ssd_common import _bf16\n"
                 "from megassm.kernels.norm.reference import _helper\n"
                 "from ..mamba2_ssd import triton_ssd as t\nt._prep\n"
                 "from ..common.lang import tsum\nfrom .triton_scan import _own\n")
    bad = _reach_ins(str(p), "scan")
    assert len(bad) == 3 and all(b.split(": ")[0] in ("line 1", "line 2", "line 4") for b in bad), bad

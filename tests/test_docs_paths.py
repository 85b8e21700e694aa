"""The docs name only what exists: every repository path written in README.md and docs/*.md (backticked, in a
link or plain text: `megassm/training/trainer.py`, benchmarks/engines_7b.py, configs/recipes/x.yaml, docs/x.md),
every `python3 benchmarks/NAME.py` / `bash benchmarks/NAME.sh` command and `python3 -m megassm.MODULE`, every
relative link target, and every `megassm-*` console command (against setup.py's entry_points).

What counts as a path: a relative path starting with one of the repository's top folders below; paths under runs/,
data/, exports/, /tmp or $OUT and placeholders (a name with X, NAME, FILE, <, {, * or ...) are skipped. docs/history/
is not checked: the history names files that have since moved or gone, as they were named then."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP = ("megassm", "kernels", "data_tools", "launch", "configs", "benchmarks", "tests", "docs", ".ci", "scripts")
PLACEHOLDERS = ("X", "NAME", "FILE", "<", "{", "*", "...")

PATH_RE = re.compile(r"(?<![\w.$/-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*\w)")
COMMAND_RE = re.compile(r"\b(?:python3?|bash|sh)\s+((?:benchmarks|scripts|\.ci)/[\w./-]+)")
MODULE_RE = re.compile(r"\bpython3?\s+-m\s+(megassm(?:\.\w+)*)")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
CONSOLE_RE = re.compile(r"(?<![\w/.\"'-])(megassm-[a-z]+)(?![\w/.-]*/)")  # not a quoted string ("megassm-shards")

# Named on purpose though they are not in the checkout, each with its reason (keep this list short).
NOT_IN_CHECKOUT = {
    "docs/architecture.md": {"kernels/pkg/ssd", "kernels/pkg/triton", "kernels/ssd",  # layouts weighed and not taken
                             "megassm/kernels"},  # the installed package name that maps kernels/
    "docs/config.md": {"configs/my.yaml"},  # the user's own config in an example error message
    "docs/data.md": {"docs/s"},  # a rate: documents per second
    "docs/interop.md": {"docs/models/supported_models.md"},  # a page of vLLM's repository
}


def doc_files() -> list[str]:
    """README.md and docs/*.md; not docs/history/ (see the module docstring)."""
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def _placeholder(text: str) -> bool:
    return any(p in text for p in PLACEHOLDERS)


def named_paths(text: str) -> set[str]:
    """The repository paths a document names (see the module docstring for what counts)."""
    out = set()
    for m in PATH_RE.finditer(text):
        path = m.group(1).rstrip(".")
        after = text[m.end():m.end() + 1]
        if _placeholder(path) or after in ("*", "{", "<", "$"):  # a glob or a name built around a placeholder
            continue
        out.add(path)
    return out


def missing_paths(text: str) -> list[str]:
    return sorted(p for p in named_paths(text) if not os.path.exists(os.path.join(ROOT, p)))


def entry_points() -> set[str]:
    """The console commands setup.py declares (its text, not an import: setup.py runs setup() on import)."""
    src = open(os.path.join(ROOT, "setup.py")).read()
    return set(re.findall(r"[\"'](megassm-[\w-]+)\s*=", src))


@pytest.mark.parametrize("doc", doc_files(), ids=_rel)
def test_named_paths_exist(doc):
    missing = [p for p in missing_paths(open(doc).read()) if p not in NOT_IN_CHECKOUT.get(_rel(doc), ())]
    assert not missing, f"{_rel(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", doc_files(), ids=_rel)
def test_commands_name_existing_files_and_modules(doc):
    text = open(doc).read()
    bad = [c for c in COMMAND_RE.findall(text) if not _placeholder(c) and not os.path.isfile(os.path.join(ROOT, c))]
    for mod in MODULE_RE.findall(text):
        base = os.path.join(ROOT, *mod.split("."))
        if not (os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))):
            bad.append(f"-m {mod}")
    assert not bad, f"{_rel(doc)} runs files or modules that do not exist: {bad}"


@pytest.mark.parametrize("doc", doc_files(), ids=_rel)
def test_relative_links_resolve(doc):
    bad = []
    for target in LINK_RE.findall(open(doc).read()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if path and not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(doc), path))):
            bad.append(target)
    assert not bad, f"{_rel(doc)} links to missing files: {bad}"


def test_console_commands_are_entry_points():
    declared = entry_points()
    assert "megassm-train" in declared, "setup.py's console_scripts were not found"
    bad = {}
    for doc in doc_files():
        for cmd in set(CONSOLE_RE.findall(open(doc).read())) - declared:
            bad.setdefault(cmd, []).append(_rel(doc))
    assert not bad, f"megassm-* commands the docs name that setup.py does not declare: {bad}"


def test_the_check_catches_a_missing_path():
    """The checker itself: a moved module, a missing benchmark and a placeholder."""
    text = ("see `megassm/training/no_such_module.py` and run\n    python3 benchmarks/no_such_bench.py --x 1\n"
            "or configs/recipes/NAME.yaml and tests/test_X.py, kernels/mamba2_ssd/op.py, docs/benchmarks.md.")
    assert missing_paths(text) == ["benchmarks/no_such_bench.py", "megassm/training/no_such_module.py"]
    assert "kernels/mamba2_ssd/op.py" in named_paths(text)
    assert not any(_placeholder(p) for p in named_paths(text))

"""kernels/, data_tools/ and launch/ are installed as megassm.kernels, megassm.data_tools and megassm.launch and
shadow nothing: Python started in the project root (the current directory first on sys.path) imports the
PyPI packages of those names (transformers imports `kernels`), and transformers loads a megassm-export
directory there. docs/architecture.md "Layout" says how."""
import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMESAKES = ("kernels", "data_tools", "launch")  # each a package on PyPI too


def test_no_top_level_folder_is_a_regular_package():
    """A folder of the project root with an __init__.py is imported, from the root, in place of any installed
    package of its name; only `megassm` may be one."""
    packages = sorted(n for n in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, n, "__init__.py")))
    assert packages == ["megassm"], packages


def test_the_install_maps_every_package_to_its_folder():
    """Where megassm is installed from this checkout (`pip install -e .`), every package setup.py names resolves
    to its folder: setuptools' editable finder holds a fixed map of the packages whose folder is not inside
    their parent's (megassm.kernels -> kernels/core, megassm.kernels.norm -> kernels/norm), so a new
    subfolder of kernels/, data_tools/ or launch/ needs `pip install -e .` again."""
    import importlib.util

    import megassm
    from test_layering import package_dirs

    if not megassm.__file__.startswith(ROOT + os.sep):
        pytest.skip(f"megassm is imported from {megassm.__file__}, not from this checkout")
    stale = []
    for package, folder in sorted(package_dirs().items()):
        spec = importlib.util.find_spec(package)  # imports the parents only, never the package itself
        where = list(spec.submodule_search_locations) if spec is not None else []
        if where != [os.path.join(ROOT, folder)]:
            stale.append(f"{package}: {where or 'not found'}, expected {folder}/")
    assert not stale, "run `pip install -e .` again in " + ROOT + ":\n" + "\n".join(stale)


def test_dependencies_doc_gives_every_floor_and_apex_is_nowhere():
    """docs/dependencies.md has a row for every package setup.py declares, with the same floor; pyarrow is an
    extra, not required; no requirement is apex (the package of that name on the index is another project)."""
    import re

    from test_layering import setup_kwargs

    kw = setup_kwargs()
    required = kw["install_requires"]
    reqs = set(required) | {r for extra in kw["extras_require"].values() for r in extra}
    names = {re.split(r"[<>=!~ ]", r)[0].lower() for r in reqs}
    assert "apex" not in names and not any(n.startswith("pyarrow") for n in map(str.lower, required)), required
    extras = kw["extras_require"]
    assert extras["parquet"] == ["pyarrow>=6"] and set(extras["parquet"]) <= set(extras["dev"])
    # the export's and the harness's packages are extras of their own, in dev too
    assert {"transformers>=5", "safetensors>=0.4"} <= set(extras["hf"]) <= set(extras["eval"]) <= set(extras["dev"])
    doc = open(os.path.join(ROOT, "docs", "dependencies.md")).read()
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in doc.splitlines() if line.startswith("| ")]
    rows = {c[0]: c[3] for c in cells if len(c) == 6}  # package | what for | required / extra | floor | why | tested
    listed = {n.lower() for key in rows for n in key.split(", ")}
    assert names <= listed, sorted(names - listed)
    for r in sorted(reqs):
        m = re.fullmatch(r"([\w-]+)>=([\w.]+)", r)
        if m:
            assert rows.get(m.group(1)) == m.group(2), (r, rows.get(m.group(1)))


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def _export(tmp_path) -> str:
    from megassm.config import dump_config, load_config
    from megassm.export_cli import main
    from megassm.models import build_model
    from megassm.training import checkpoint as ckpt

    cfg = load_config(None, ["data.builtin=stdlib", "model.pattern=MM", "model.d_model=32", "model.mamba.d_state=8",
                             "model.mamba.headdim=8", "model.mamba.chunk_size=8", "model.tie_embeddings=false"])
    model = build_model(cfg.model, vocab_size=257)
    model.init_weights(0)
    path = ckpt.save_checkpoint(tmp_path / "run", 1, model=model, optimizer=None, extra={"config": dump_config(cfg)})
    out = tmp_path / "hf"
    assert main(["--checkpoint", str(path), "--output", str(out), "--format", "hf", "--no-tokenizer"]) == 0
    return str(out)


_CHILD = r"""
import importlib, json, sys
out, planted, root = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
assert sys.path[0] == "", sys.path[:3]  # the project root (the working directory) is searched first
found = {}
for name in ("kernels", "data_tools", "launch"):
    m = importlib.import_module(name)
    found[name] = getattr(m, "__file__", None)
    assert found[name] and not found[name].startswith(root), (name, found[name])
    assert getattr(m, "PLANTED", False) == (name in planted), (name, found[name])
if "kernels" not in planted:
    from kernels import CUDAProperties  # what transformers imports from the Hugging Face package
from megassm.kernels import ssd  # our packages beside them, under their megassm names
import megassm.data_tools.preprocess, megassm.launch.cli
import torch, transformers
hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
with torch.no_grad():
    logits = hf(torch.tensor([[1, 2, 3, 4, 5]])).logits
print(json.dumps({"found": found, "class": type(hf).__name__, "shape": list(logits.shape),
                  "finite": bool(torch.isfinite(logits).all()),
                  "info": {k: list(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys")}}))
"""


def test_namesakes_and_transformers_load_from_the_project_root(tmp_path):
    """Run in the project root: `kernels` is the Hugging Face package when it is installed (transformers
    needs it), `data_tools` and `launch` are the third-party packages of those names (planted in a folder on
    PYTHONPATH, which comes after the working directory on sys.path, as an installed package does), and
    transformers loads an export. A process of its own (tests/hf_logits.py says why transformers is not
    loaded inside a pytest worker)."""
    pytest.importorskip("transformers")
    out = _export(tmp_path)
    site = tmp_path / "site"
    planted = [n for n in NAMESAKES if not (n == "kernels" and _installed("kernels"))]
    for name in planted:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("PLANTED = True\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run([sys.executable, "-c", _CHILD, out, ",".join(planted), ROOT + os.sep], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["class"] == "Mamba2ForCausalLM" and got["finite"], got
    assert got["shape"][:2] == [1, 5] and not any(got["info"].values()), got

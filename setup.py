"""Build file for megassm.

`kernels/`, `data_tools/` and `launch/` live at the top of the repository but are installed inside the
`megassm` namespace (megassm.kernels, megassm.data_tools, megassm.launch) through `package_dir`, so no
generic top-level import name leaks into a user's environment.

None of the three folders is a package itself (no __init__.py at its top): Python started in the project root
(the working directory first on sys.path) would import such a folder in place of the PyPI package of its name
(`kernels`, which transformers imports; `launch`; `data_tools`). A folder without __init__.py is at most a
namespace portion, which any regular package later on sys.path beats. So the package's own modules live in
FOLDER/core/, and every other FOLDER/NAME/ with an __init__.py is its subpackage (kernels/norm/ ->
megassm.kernels.norm): a new one needs no edit here (docs/architecture.md "Layout").
"""
import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
_MAPPED = {"megassm.kernels": "kernels", "megassm.data_tools": "data_tools", "megassm.launch": "launch"}
_CORE = "core"  # FOLDER/core/ is the package megassm.<FOLDER> itself


def _is_package(folder: str) -> bool:
    return os.path.isfile(os.path.join(HERE, folder, "__init__.py"))


def _add(package: str, folder: str, found: dict) -> None:
    """package (in folder) and the packages below it, as {package: folder relative to this file}."""
    if package in found:
        raise SystemExit(f"setup.py: {package} would be both {found[package]}/ and {folder}/")
    found[package] = folder
    for name in sorted(os.listdir(os.path.join(HERE, folder))):
        if not name.startswith((".", "__")) and _is_package(f"{folder}/{name}"):
            _add(f"{package}.{name}", f"{folder}/{name}", found)


def _package_dirs() -> dict:
    found: dict = {}
    _add("megassm", "megassm", found)
    for package, top in _MAPPED.items():
        if _is_package(top):
            raise SystemExit(f"setup.py: {top}/__init__.py makes {top}/ shadow the PyPI package '{top}' when Python "
                             f"runs in the project root; the package's own modules go in {top}/{_CORE}/")
        core = f"{top}/{_CORE}"
        _add(package, core, found)
        for name in sorted(os.listdir(os.path.join(HERE, top))):
            if name != _CORE and not name.startswith((".", "__")) and _is_package(f"{top}/{name}"):
                if os.path.exists(os.path.join(HERE, core, name + ".py")):
                    raise SystemExit(f"setup.py: {top}/{name}/ and {core}/{name}.py would both be {package}.{name}")
                _add(f"{package}.{name}", f"{top}/{name}", found)
    return found


_DIRS = _package_dirs()
_PARQUET = ["pyarrow>=6"]  # 6: the first with Python 3.10 wheels; the calls in data_tools/core/sources.py are older
_DATASETS = ["datasets>=2.10"]  # select_columns on Dataset and IterableDataset (data_tools/core/sources.py)
_WANDB = ["wandb>=0.10"]  # wandb.init(mode=), run.step, finish(exit_code=) (megassm/training/wandb_sink.py)
_TOKENIZERS = ["sentencepiece>=0.1.97", "tokenizers>=0.11"]  # encode(num_threads=); first Python 3.10 wheels
# transformers 5: the export writes its config names (Mamba2 / NemotronH / GraniteMoeHybrid); safetensors 0.4:
# save_file / load_file on torch tensors of every dtype we write. Only 5.25 / 0.8 are tested (docs/dependencies.md).
_HF = ["transformers>=5", "safetensors>=0.4"]
_EVAL = ["lm_eval>=0.4", *_HF]  # megassm-eval harness: lm-evaluation-harness 0.4's LM API; tested with 0.4.13


setup(
    name="megassm",
    version="0.1.0",
    description="Pretraining Mamba-2 state space language models and their hybrids with attention",
    python_requires=">=3.10",
    packages=sorted(_DIRS),
    package_dir=_DIRS,
    # Floors: the oldest release with every API we call (docs/dependencies.md says which call sets each one).
    # CI installs the newest releases (torch 2.13), so no floor itself is tested.
    install_requires=[
        "torch>=2.7",  # fully_shard(ignored_params=) (parallel/fsdp2.py); 2.6: torch.distributed.fsdp, PipelineStage shape inference
        "numpy>=1.21",  # 1.21: the first with Python 3.10 wheels
        "pyyaml>=5.1",  # safe_dump(sort_keys=)
        "tensorboard>=1.15",  # torch.utils.tensorboard's own floor
        "tqdm>=4.27",  # tqdm.auto
        "zstandard>=0.11",  # stream_reader(read_across_frames=): .zst corpora
    ],
    extras_require={
        "parquet": _PARQUET,  # Parquet / Arrow IPC inputs of megassm-preprocess
        "datasets": _DATASETS,  # Hugging Face datasets as a megassm-preprocess input
        "wandb": _WANDB,  # run.wandb=online|offline
        "deepspeed": ["deepspeed>=0.12"],  # safe_set_full_fp32_param / safe_set_full_optimizer_state
        "megatron": ["megatron-core>=0.12"],  # initialize_model_parallel(create_gloo_process_groups=)
        "triton": ["triton>=3.6"],
        "tokenizers": _TOKENIZERS,
        "hf": _HF,  # megassm-export, model.init_from a transformers directory
        "eval": _EVAL,
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "triton==3.6.0", "matplotlib", *_TOKENIZERS,
                "megatron-core>=0.12", "mistral-common", "deepspeed>=0.12", *_EVAL,
                *_PARQUET, *_DATASETS, *_WANDB],
    },
    entry_points={
        "console_scripts": [
            "megassm-train=megassm.train:cli",
            "megassm-preprocess=megassm.data_tools.preprocess:main",
            "megassm-launch=megassm.launch.cli:main",
            "megassm-eval=megassm.evaluation.cli:main",
            "megassm-synthetic=megassm.synthetic.run:main",
            "megassm-checkpoint=megassm.checkpoint_cli:cli",
            "megassm-export=megassm.export_cli:cli",
            "megassm-generate=megassm.generate_cli:cli",
            "megassm-plan=megassm.planner.cli:cli",
        ]
    },
)

"""Build file for megassm.

`kernels/`, `data_tools/` and `launch/` live at the top of the repository but are installed inside the
`megassm` namespace (megassm.kernels, megassm.data_tools, megassm.launch) through `package_dir`, so no
generic top-level import name leaks into a user's environment.
"""
from setuptools import setup

_MAPPED = {"megassm.kernels": "kernels", "megassm.data_tools": "data_tools", "megassm.launch": "launch"}


def _packages():
    import os

    found = []
    for top, mapped in [("megassm", "megassm")] + [(k, v) for k, v in _MAPPED.items()]:
        for root, dirs, files in os.walk(mapped):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            if "__init__.py" in files:
                rel = os.path.relpath(root, mapped)
                found.append(top if rel == "." else top + "." + rel.replace(os.sep, "."))
    return sorted(found)


setup(
    name="megassm",
    version="0.1.0",
    description="Pretraining Mamba-2 state space language models and their hybrids with attention",
    python_requires=">=3.10",
    packages=_packages(),
    package_dir={"megassm": "megassm", **_MAPPED},
    install_requires=[
        "torch>=2.5",  # SDPA enable_gqa (models/attention.py)
        "numpy",
        "pyyaml",
        "tensorboard",
        "pyarrow",
        "tqdm",
        "zstandard",
    ],
    extras_require={
        "deepspeed": ["deepspeed"],
        "megatron": ["megatron-core"],
        "triton": ["triton>=3.6"],
        "tokenizers": ["sentencepiece", "tokenizers"],
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "triton==3.6.0", "matplotlib", "sentencepiece", "tokenizers", "megatron-core", "mistral-common",
                "deepspeed", "transformers", "safetensors", "lm_eval"],
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
        ]
    },
)

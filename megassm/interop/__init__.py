"""megassm.interop: export to Hugging Face transformers, and weights from other layouts to start a run from.

    mapping.py    names and configs, megassm <-> Mamba2ForCausalLM / NemotronHForCausalLM /
                  GraniteMoeHybridForCausalLM; which class computes the same function, and what has no exact
                  counterpart (models layer: torch and megassm.config only)
    mamba_ssm.py  the same for mamba_ssm's Mamba-2 checkpoints (state-spaces/mamba2-*)
    sources.py    model.init_from: detect a directory's layout, check its config and shapes against the run's
    hf.py         write a transformers directory (config.json, safetensors, tokenizer, README), atomically
    tokenizer.py  the run's tokenizer as one AutoTokenizer loads, verified to give the same ids
    megatron.py   megatron-core MambaModel checkpoints (torch_dist, legacy mp_rank_XX) <-> canonical weights
                  (megassm-checkpoint convert; megatron-core imported lazily)

transformers / safetensors are needed only by the export (and by reading a .safetensors source); the core
install does not require them. docs/interop.md.
"""
from .mapping import MappingError, NotExportable, export_target

__all__ = ["MappingError", "NotExportable", "export_target"]

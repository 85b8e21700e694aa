"""Write a megassm model as a transformers directory: config.json + model.safetensors (sharded with an index
above `max_shard_bytes`) + the tokenizer + README.md. Atomic: everything goes into a temporary directory beside
the output, renamed at the end; on any error the temporary directory is removed and nothing is left at OUT. Missing
parent directories of OUT are created first, and removed again (when still empty) if the export fails.

    export_hf(model_cfg, state, out, tokenizer_spec="byte")
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil

import torch

from megassm.config import ModelConfig, blocks_of
from megassm.models.lm import padded_vocab_size

from . import mapping

__all__ = ["ExportError", "export_hf", "require"]


class ExportError(ValueError):
    pass


def require(*packages: str) -> None:
    """ExportError naming the first missing package (the export needs what the core install does not)."""
    import importlib.util

    for p in packages:
        if importlib.util.find_spec(p) is None:
            raise ExportError(f"the export needs the '{p}' package: pip install 'megassm[hf]'")


def _config_object(target: str, kwargs: dict, eos_id: int | None):
    import transformers

    cls = getattr(transformers, {"mamba2": "Mamba2Config", "nemotron_h": "NemotronHConfig",
                                 "granitemoehybrid": "GraniteMoeHybridConfig"}[target])
    cfg = cls(**kwargs, eos_token_id=eos_id, bos_token_id=None, pad_token_id=None)
    cfg.architectures = [mapping.HF_ARCH[target]]
    return cfg


def _legacy_layer_types(out: str, target: str, m: ModelConfig) -> None:
    """config.json's GraniteMoeHybrid layer_types in the names vLLM's implementation keys its layers by (mamba /
    attention); transformers >= 5 saves its own names (linear_attention / full_attention) but reads these too."""
    if target != "granitemoehybrid":
        return
    path = os.path.join(out, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    kinds = blocks_of(m.pattern)
    cfg["layer_types"] = [mapping.GRANITE_TYPES[kinds[b]] for b, _ in mapping.granite_layers(m.pattern)]
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def _write_weights(state: dict, out: str, max_shard_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    shards, cur, size = [], {}, 0
    for name in sorted(state):
        t = state[name].detach().contiguous()
        if cur and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += t.numel() * t.element_size()
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, fn), metadata={"format": "pt"})
        names.append(fn)
        weight_map.update({k: fn for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names + ["model.safetensors.index.json"]


def _layout_note(target: str, m: ModelConfig) -> str:
    """GraniteMoeHybrid: which layers carry an all-zero (or zero-width) MLP for a mixer without a `-` block."""
    if target != "granitemoehybrid":
        return ""
    empty = [j for j, (_, f) in enumerate(mapping.granite_layers(m.pattern)) if f is None]
    if not empty:
        return ""
    return (f" Each layer is a mixer and an MLP; layers {', '.join(map(str, empty))} stand for mixers with no MLP "
            "block after them, so their MLP weights are zeros (zero-width where the pattern has no MLP block at "
            "all) and add exactly nothing (`megassm_pattern` in config.json).")


def _readme(target: str, m: ModelConfig, source: str, tok_line: str, load_tok: str) -> str:
    arch, note = mapping.HF_ARCH[target], _layout_note(target, m)
    return f"""# megassm export

Exported by `megassm-export` from `{source}`: pattern `{m.pattern}` ({len(blocks_of(m.pattern))} blocks), d_model
{m.d_model}, as transformers `{arch}`. The logits (over the padded vocabulary) are those of the megassm model.{note}

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(".")
{load_tok}
```

Tokenizer: {tok_line}

Training encoded documents with no BOS or other special tokens and appended the end-of-document token after each
document; encode with `add_special_tokens=False` for exactly the ids it saw (the exported tokenizer adds none
anyway). Ids at and above the tokenizer's vocabulary are padding of the embedding, never trained targets.
"""


def _make_parents(path: str) -> list[str]:
    """Create directory `path` and its missing ancestors; returns the ones this call made, innermost first (a
    directory made meanwhile by another process is theirs). On an error nothing it made is left."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    made = []
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d)
                made.insert(0, d)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise
    except OSError:
        _remove_empty(made)
        raise
    return made


def _remove_empty(dirs: list[str]) -> None:
    for d in dirs:
        with contextlib.suppress(OSError):  # only if empty: a file someone else put there stays
            os.rmdir(d)


def export_hf(m: ModelConfig, state: dict, out: str, tokenizer_spec: str | None = None, source: str = "",
              dtype: torch.dtype = torch.float32, max_shard_bytes: int = 5 << 30, no_tokenizer: bool = False,
              max_positions: int | None = None) -> dict:
    """Export canonical `state` of a model with config `m` to the transformers directory `out` (must not exist).
    Returns {"target", "architecture", "files", "tokenizer"}. Raises mapping.NotExportable (naming the block)
    before anything is written, ExportError for a missing package or an existing output. `max_positions`: the
    trained sequence length, written where the class has a max_position_embeddings that computes nothing
    (GraniteMoeHybrid's; vLLM's default longest sequence)."""
    target = mapping.export_target(m)  # refuses first: nothing is created for a model with no counterpart
    require("transformers", "safetensors")
    out = os.path.abspath(out)
    if os.path.lexists(out):
        raise ExportError(f"{out}: output exists; choose a new path")
    parent = os.path.dirname(out)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise ExportError(f"{parent}: the output's parent is not a directory")
    vocab_padded = state["embedding.weight"].shape[0]
    if m.vocab_size is not None and padded_vocab_size(m.vocab_size, m.pad_vocab_multiple) != vocab_padded:
        raise ExportError(f"the checkpoint's embedding has {vocab_padded} rows, its config's padded vocabulary is "
                          f"{padded_vocab_size(m.vocab_size, m.pad_vocab_multiple)}")
    kwargs, hf_state = mapping.to_hf(state, m, target, vocab_padded, max_positions)
    hf_state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in hf_state.items()}
    created = _make_parents(parent)  # `--output exports/x` where exports/ is new: made here, removed on failure
    tmp = os.path.join(parent, f".tmp-{os.path.basename(out)}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        eos_id, tok_line, load_tok = None, "", ""
        if tokenizer_spec is not None:
            from megassm.data_tools.tokenizers import load_tokenizer

            from .tokenizer import write_tokenizer

            eos_id = load_tokenizer(tokenizer_spec).eos_id
            tok_line = write_tokenizer(tokenizer_spec, tmp) + ", loads with `AutoTokenizer.from_pretrained`."
            load_tok = "tok = AutoTokenizer.from_pretrained(\".\")"
        else:
            why = "--no-tokenizer" if no_tokenizer else ("the run's tokenizer is not known (its shards have no "
                                                          "manifest): pass --tokenizer PATH to megassm-export")
            tok_line = f"not exported ({why}). Encode text with the tokenizer the training shards were made with."
        hf_cfg = _config_object(target, kwargs, eos_id)
        hf_cfg.dtype = dtype
        hf_cfg.save_pretrained(tmp)
        _legacy_layer_types(tmp, target, m)
        files = _write_weights(hf_state, tmp, max_shard_bytes)
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(_readme(target, m, source, tok_line, load_tok))
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise
    return {"target": target, "architecture": mapping.HF_ARCH[target], "files": files, "tokenizer": tok_line}

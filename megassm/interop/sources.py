"""Directories whose weights a run can start from (model.init_from), and megassm checkpoints to export.

    src = open_source(path)                   # layout detected, config read, a megassm checkpoint verified; no GPU
    check_config(src, cfg.model)              # every key that changes what the weights compute, both values named
    state = load_state(src, model)            # canonical megassm names, checked against the (meta) model's shapes

Layouts: a megassm checkpoint directory (meta.json; canonical or sharded; it must verify) or run directory (its
newest checkpoint that verifies: training/checkpoint/choose.py checkpoint_to_read); a transformers Mamba2 / Nemotron-H /
GraniteMoeHybrid directory (config.json with model_type, model.safetensors or pytorch_model.bin, optionally sharded
with an index);
a mamba_ssm directory (config.json with d_model / n_layer, pytorch_model.bin in the state-spaces/mamba2-* naming).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from megassm.config import Config, ConfigError, ModelConfig, config_from_dict

from . import mamba_ssm, mapping

__all__ = ["InitFromError", "Source", "open_source", "check_config", "load_state", "checkpoint_of",
           "checkpoint_config"]

KEY = "model.init_from"


class InitFromError(ConfigError):
    """model.init_from names something that cannot initialize this run (the message names the path)."""


@dataclass
class Source:
    path: str  # what was named
    kind: str  # megassm | hf | mamba_ssm
    where: str  # the directory read (a run directory resolves to its checkpoint)
    model_cfg: ModelConfig
    compared: set | None  # keys the source's format defines (None: all of megassm's)
    raw_config: dict | None = None  # config.json of a foreign layout


def checkpoint_of(path: str, who: str) -> str:
    """The megassm checkpoint directory to read the weights from: `path` itself, which must verify, or a run
    directory's newest checkpoint that verifies (the damaged and incomplete ones skipped are named in warnings):
    checkpoint.checkpoint_to_read, as every reader of checkpoints. CheckpointDamagedError (exit 6) when none
    verifies, InitFromError (exit 2) for the other refusals; both name the path."""
    from megassm.training import checkpoint as ckpt

    try:
        return ckpt.checkpoint_to_read(path, who, model_only=True)[0]
    except ckpt.CheckpointDamagedError:
        raise
    except ckpt.CheckpointError as e:
        raise InitFromError(str(e)) from None


def checkpoint_config(ckpt_dir: str, who: str) -> Config:
    """The run config a checkpoint was saved with (meta.json's "config"; else the run's config.yaml)."""
    import yaml

    from megassm.training import checkpoint as ckpt

    meta = ckpt.read_meta(ckpt_dir) or {}
    text, where = meta.get("config"), os.path.join(ckpt_dir, ckpt.META)
    if not isinstance(text, str):
        where = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt_dir))), "config.yaml")
        if not os.path.isfile(where):
            raise InitFromError(f"{who}: checkpoint {ckpt_dir} records no config and {where} does not exist")
        with open(where) as f:
            text = f.read()
    return config_from_dict(yaml.safe_load(text) or {}, where)


def _read_json(path: str, who: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise InitFromError(f"{who}: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise InitFromError(f"{who}: {path} is not a JSON object")
    return data


def open_source(path: str, who: str = KEY) -> Source:
    """Detect the layout of `path` and read its config (no weights loaded; a megassm checkpoint's weight files are
    verified against their record, checkpoint_of). InitFromError names the path; CheckpointDamagedError (exit 6)
    when no megassm checkpoint there verifies."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise InitFromError(f"{who}: {full} does not exist")
    if not os.path.isdir(full):
        raise InitFromError(f"{who}: {full} is not a directory (expected a megassm checkpoint or run directory, a "
                            "transformers Mamba2 / Nemotron-H / GraniteMoeHybrid export or a mamba_ssm checkpoint "
                            "directory)")
    cfg_json = os.path.join(full, "config.json")
    if os.path.isfile(cfg_json):
        raw = _read_json(cfg_json, who)
        try:
            if raw.get("model_type") in ("mamba2", "nemotron_h", "granitemoehybrid"):
                _, m = mapping.hf_model_config(raw, cfg_json)
                return Source(path, "hf", full, m, mapping.FOREIGN_KEYS, raw)
            if "d_model" in raw and "n_layer" in raw:
                return Source(path, "mamba_ssm", full, mamba_ssm.mamba_ssm_model_config(raw, cfg_json),
                              mapping.FOREIGN_KEYS, raw)
        except mapping.MappingError as e:
            raise InitFromError(f"{who}: {e}") from None
        raise InitFromError(f"{who}: {cfg_json}: unrecognised layout: model_type {raw.get('model_type')!r} is not "
                            "mamba2, nemotron_h or granitemoehybrid, and it has no d_model / n_layer (mamba_ssm)")
    ckpt_dir = checkpoint_of(full, who)
    return Source(path, "megassm", ckpt_dir, checkpoint_config(ckpt_dir, who).model, None)


def check_config(src: Source, run: ModelConfig, who: str = KEY) -> None:
    """InitFromError naming each model key whose value in the source differs from this run's."""
    diffs = mapping.config_differences(src.model_cfg, run, src.compared)
    if diffs:
        shown = "; ".join(f"model.{k}: {a!r} in the source, {b!r} in this run" for k, a, b in diffs[:4])
        more = f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else ""
        raise InitFromError(f"{who}: {src.where} does not fit this run's model: {shown}{more}")


# ----------------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------------
def _load_file(path: str, who: str) -> dict:
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise InitFromError(f"{who}: {path} needs the safetensors package (pip install 'megassm[hf]')") from None
        return load_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or foreign pickles fail in many ways
        raise InitFromError(f"{who}: cannot read {path}: {type(e).__name__}: {e}") from None


def _foreign_weights(d: str, who: str) -> dict:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.isfile(os.path.join(d, name)):
            return _load_file(os.path.join(d, name), who)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        ip = os.path.join(d, index)
        if os.path.isfile(ip):
            state = {}
            for f in sorted(set(_read_json(ip, who).get("weight_map", {}).values())):
                state.update(_load_file(os.path.join(d, f), who))
            return state
    raise InitFromError(f"{who}: {d} has no model.safetensors or pytorch_model.bin (nor a sharded index of them)")


def read_state(src: Source, who: str = KEY) -> dict:
    """The source's weights under megassm's canonical names (no shape check)."""
    if src.kind == "megassm":
        from megassm.training import checkpoint as ckpt

        try:
            return ckpt.read_model_state(src.where)
        except ckpt.CheckpointDamagedError as e:  # unreadable, NaN / inf: exit 6, as the other readers
            raise ckpt.CheckpointDamagedError(f"{who}: {e}") from None
        except ckpt.CheckpointError as e:
            raise InitFromError(f"{who}: {e}") from None
    raw = _foreign_weights(src.where, who)
    where = os.path.join(src.where, "config.json")
    try:
        _, state = (mapping.from_hf if src.kind == "hf" else mamba_ssm.from_mamba_ssm)(src.raw_config, raw, where)
    except mapping.MappingError as e:
        raise InitFromError(f"{who}: {e}") from None
    return state


def load_state(src: Source, model: torch.nn.Module, who: str = KEY) -> dict:
    """The source's weights for `model` (a whole, canonical LanguageModel; the meta device is fine): fp32, every
    parameter present with its shape, the embedding tied or untied as the model is."""
    state = read_state(src, who)
    tied = getattr(model, "lm_head", None) is None
    head = state.get("lm_head.weight")
    if tied and head is not None:
        if not mapping.equal_tensors(head, state["embedding.weight"]):
            raise InitFromError(f"{who}: {src.where}: its lm_head differs from its embedding (untied), but this run "
                                "ties them (model.tie_embeddings=true); set model.tie_embeddings=false")
        del state["lm_head.weight"]
    elif not tied and head is None and "embedding.weight" in state:
        state["lm_head.weight"] = state["embedding.weight"].clone()  # tied source, untied run: start equal
    expected = {n: p.shape for n, p in model.named_parameters()}
    problems = []
    for n, shape in expected.items():
        if n not in state:
            problems.append(f"parameter '{n}' is missing from the source")
        elif tuple(state[n].shape) != tuple(shape):
            hint = (" (the padded vocabulary: match model.vocab_size / model.pad_vocab_multiple to the source's)"
                    if n in ("embedding.weight", "lm_head.weight") else "")
            problems.append(f"parameter '{n}' is {list(state[n].shape)} in the source, {list(shape)} in this "
                            f"run{hint}")
    problems += [f"the source's '{n}' is not a parameter of this run's model" for n in state if n not in expected]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise InitFromError(f"{who}: {src.where} does not fit this run's model: {'; '.join(problems[:3])}{more}")
    bad = next((n for n, t in state.items() if not torch.isfinite(t).all()), None)
    if bad is not None:
        raise InitFromError(f"{who}: {src.where}: parameter '{bad}' holds non-finite values")
    return {n: t.to(torch.float32) for n, t in state.items()}

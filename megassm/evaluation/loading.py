"""A trained checkpoint as one single-device model with its tokenizer, for generation and evaluation.

    lm = load_trained(checkpoint="runs/x/checkpoints/step_00001000")   # or run="runs/x": its newest one that verifies
    lm.model, lm.tokenizer, lm.cfg, lm.step, lm.autocast()

The config is the one the checkpoint recorded (meta.json "config"), else RUN/config.yaml two levels above it,
else --config; overrides (key=value) apply on top. Its kernels: section is applied as the trainer applies it. The weights are loaded by training/checkpoint/load.py
(canonical or sharded), verified first as every reader of checkpoints does (checkpoint_to_read). The tokenizer
is `tokenizer` when given, else the run's: data.tokenizer, checked against the tokenizer the data shards'
manifests record when the shards are at hand.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch

from megassm.config import Config, ConfigError, config_from_text, load_config

log = logging.getLogger("megassm.eval")

__all__ = ["TrainedModel", "load_trained", "resolve_checkpoint", "run_tokenizer"]


@dataclass
class TrainedModel:
    model: torch.nn.Module
    tokenizer: object  # megassm.data_tools.tokenizers.Tokenizer
    cfg: Config
    checkpoint: str | None
    step: int | None
    device: torch.device
    amp_dtype: torch.dtype | None  # autocast dtype (None: fp32)

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    @property
    def precision(self) -> str:
        return "fp32" if self.amp_dtype is None else str(self.amp_dtype).replace("torch.", "")


def resolve_checkpoint(checkpoint: str | None, run: str | None, load=None) -> tuple[str, object]:
    """(the checkpoint directory, what `load(path)` read from it): `checkpoint` itself, which must verify, or the
    newest checkpoint of the run `run` that verifies (training/checkpoint/choose.py checkpoint_to_read, as every reader of
    checkpoints: the damaged and incomplete ones skipped are named in warnings). Only the weights' files are
    verified. CheckpointDamagedError (exit 6) when none verifies."""
    from megassm.training import checkpoint as ckpt

    if (checkpoint is None) == (run is None):
        raise ConfigError("give --checkpoint DIR or --run DIR (its newest checkpoint that verifies), not both")
    if checkpoint is not None:
        if ckpt.is_run_dir(os.path.abspath(os.path.expanduser(checkpoint))):
            raise ConfigError(f"--checkpoint {checkpoint} is a run directory: pass --run {checkpoint}")
        return ckpt.checkpoint_to_read(checkpoint, "--checkpoint", expect="checkpoint", model_only=True, load=load)
    if not os.path.isdir(run):
        raise ConfigError(f"--run {run}: no such directory")
    return ckpt.checkpoint_to_read(run, "--run", expect="run", model_only=True, load=load)


def _config_of(path: str, config: str | None, overrides: list[str]) -> Config:
    from megassm.training import checkpoint as ckpt

    if config is not None:
        return load_config(config, overrides)
    meta = ckpt.read_meta(path) or {}
    if isinstance(meta.get("config"), str):
        return config_from_text(meta["config"], os.path.join(path, ckpt.META) + " (its config)", overrides)
    run_yaml = os.path.join(os.path.dirname(os.path.dirname(path)), "config.yaml")
    if os.path.isfile(run_yaml):
        return load_config(run_yaml, overrides)
    raise ConfigError(f"{path}: meta.json records no config and there is no {run_yaml}: pass --config FILE")


def run_tokenizer(cfg: Config, spec: str | None = None):
    """The tokenizer `spec`, or the run's: data.tokenizer, which must be the one the shards were made with
    (their manifests record its sha256) when data.paths points at shards present here."""
    from megassm.data_tools.tokenizers import load_tokenizer

    tok = load_tokenizer(spec or cfg.data.tokenizer)
    if spec is not None or not cfg.data.paths:
        return tok
    recorded = _manifest_tokenizer(cfg.data.paths)
    if recorded is not None and recorded.get("sha256") != tok.sha256:
        raise ConfigError(
            f"the run's shards were made with tokenizer {recorded.get('name')} (sha256 {str(recorded.get('sha256'))[:12]}…, "
            f"vocabulary {recorded.get('vocab_size')}), but data.tokenizer is {cfg.data.tokenizer!r}: pass "
            "--tokenizer PATH (the .model / tokenizer.json the shards were preprocessed with)")
    return tok


def _manifest_tokenizer(paths: list[str]) -> dict | None:
    import json

    for prefix in paths:
        mpath = prefix + ".manifest.json"
        if os.path.isfile(mpath):
            try:
                with open(mpath) as f:
                    return json.load(f).get("tokenizer")
            except (OSError, ValueError):
                return None
    log.info("data shards not found here: the tokenizer (data.tokenizer) is not checked against them")
    return None


def load_trained(checkpoint: str | None = None, run: str | None = None, config: str | None = None,
                 overrides: list[str] = (), tokenizer: str | None = None, device: str = "auto",
                 precision: str | None = None) -> TrainedModel:
    """Load a checkpoint (see the module docstring). `precision`: fp32 | bf16 | auto (default: the run's
    train.precision, i.e. bf16 autocast on GPU, fp32 on CPU)."""
    from megassm.models import build_model
    from megassm.training import checkpoint as ckpt
    from megassm.training.checks import autocast_dtype
    from megassm.training.run_config import apply_settings

    def load(path: str):
        cfg = _config_of(path, config, list(overrides))
        if precision is not None:
            cfg.train.precision = precision
        tok = run_tokenizer(cfg, tokenizer)
        model = build_model(cfg.model, vocab_size=tok.vocab_size, device="cpu")
        return cfg, tok, model, ckpt.load_model(path, model, verify=False)  # verified by resolve_checkpoint

    path, (cfg, tok, model, meta) = resolve_checkpoint(checkpoint, run, load)
    # the run's kernels: section (the SSD's precision, tiles, backend...) in this process's environment before
    # any kernel runs, as the trainer does: the model computes as it trained; a MEGASSM_* variable set still wins
    apply_settings(cfg)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    model = model.to(dev).eval()
    return TrainedModel(model=model, tokenizer=tok, cfg=cfg, checkpoint=path, step=int(meta["step"]), device=dev,
                        amp_dtype=autocast_dtype(cfg, dev))

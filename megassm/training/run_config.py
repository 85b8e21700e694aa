"""A run's identity in its config: the keys that define what it computes (all but RUN_ONLY_KEYS), their hash
and differences (checkpoints record the config; a resume names the keys that changed), and the resolved
config.yaml written into the run directory."""
from __future__ import annotations

import hashlib
import json
import os

from megassm.config import Config, config_to_dict, dump_config

__all__ = ["RUN_ONLY_KEYS", "run_defining_config", "config_hash", "config_differences", "legacy_hash_matches",
           "write_resolved_config"]


# keys that cannot change what a run computes (where it writes, what it shows, when it checkpoints): a resume
# that changes only these is the same run
RUN_ONLY_KEYS = frozenset({
    "run.dir", "run.resume", "run.overwrite", "run.progress", "run.tensorboard", "run.save_interval",
    "run.save_final", "run.keep_last", "run.lock_stale_s", "train.log_interval", "data.prefetch", "data.cache_dir",
    "parallel.timeout_s", "run.profile_step", "run.profile_trace", "parallel.fsdp_prefetch",
    "train.eval_tokens", "train.eval_batches",  # what is measured, not what is trained
    "train.straggler_interval", "train.straggler_fraction",
    "run.wandb", "run.wandb_project", "run.wandb_name", "run.wandb_entity",  # where metrics are shown
})


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_defining_config(cfg: Config) -> dict:
    """The config as dotted keys, without RUN_ONLY_KEYS."""
    return {k: v for k, v in _flatten(config_to_dict(cfg)).items() if k not in RUN_ONLY_KEYS}


def config_hash(cfg: Config) -> str:
    """Fingerprint of what the config makes a run compute (RUN_ONLY_KEYS left out)."""
    return hashlib.sha256(json.dumps(run_defining_config(cfg), sort_keys=True).encode()).hexdigest()[:16]


def config_differences(saved_yaml: str, cfg: Config) -> list[str]:
    """'key: A in the checkpoint, B now' for each run-defining key whose value differs from the config a
    checkpoint was saved with (meta.json's "config")."""
    import yaml

    saved = {k: v for k, v in _flatten(yaml.safe_load(saved_yaml) or {}).items() if k not in RUN_ONLY_KEYS}
    now = run_defining_config(cfg)
    return [f"{k}: {saved.get(k, '(absent)')!r} in the checkpoint, {now.get(k, '(absent)')!r} now"
            for k in sorted(set(saved) | set(now)) if saved.get(k, "(absent)") != now.get(k, "(absent)")]


def legacy_hash_matches(saved: str | None, cfg: Config) -> bool:
    """Checkpoints saved before meta.json held the config: their hash covered the whole dump, run.resume too."""
    import copy

    for resume in {cfg.run.resume, "none", "auto"}:
        c = copy.deepcopy(cfg)
        c.run.resume = resume
        if hashlib.sha256(dump_config(c).encode()).hexdigest()[:16] == saved:
            return True
    return False


def write_resolved_config(cfg: Config, run_dir: str) -> str:
    """Write run_dir/config.yaml atomically: temp name, then rename."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.yaml")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(dump_config(cfg))
    os.replace(tmp, path)
    return path

"""A run's identity in its config: the keys that define what it computes (all but RUN_ONLY_KEYS), their hash
and differences (checkpoints record the config; a resume names the keys that changed), the kernels' settings
(the `kernels:` section made the process's environment, the MEGASSM_* variables recorded) and the resolved
config.yaml written into the run directory."""
from __future__ import annotations

import hashlib
import json
import logging
import os

from megassm.config import Config, ConfigError, config_to_dict, dump_config

__all__ = ["RUN_ONLY_KEYS", "run_defining_config", "config_hash", "config_differences", "legacy_hash_matches",
           "write_resolved_config", "resolve_settings", "apply_settings", "environment_record"]

log = logging.getLogger("megassm.train")  # the trainer's


# keys that cannot change what a run computes (where it writes, what it shows, when it checkpoints): a resume
# that changes only these is the same run
RUN_ONLY_KEYS = frozenset({
    "run.dir", "run.resume", "run.overwrite", "run.progress", "run.tensorboard", "run.save_interval",
    "run.save_final", "run.keep_last", "run.lock_stale_s", "train.log_interval", "data.prefetch", "data.cache_dir",
    "parallel.timeout_s", "run.profile_step", "run.profile_trace", "parallel.fsdp_prefetch",
    "train.eval_tokens", "train.eval_batches",  # what is measured, not what is trained
    "train.straggler_interval", "train.straggler_fraction",
    "run.wandb", "run.wandb_project", "run.wandb_name", "run.wandb_entity",  # where metrics are shown
    "kernels.tune_log",  # the tuner's decisions printed, not changed
    "environment",  # a record of the variables; those that change the computation are in kernels.* already
})
# sections added after checkpoints began recording their config: absent from an older checkpoint's, its values
# then are unknown, not different
_LATER_SECTIONS = ("kernels",)


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
    checkpoint was saved with (meta.json's "config"). A section that config predates is left out: its values
    were not recorded then."""
    import yaml

    saved_dict = yaml.safe_load(saved_yaml) or {}
    saved = {k: v for k, v in _flatten(saved_dict).items() if k not in RUN_ONLY_KEYS}
    unknown = tuple(f"{s}." for s in _LATER_SECTIONS if s not in saved_dict)
    now = {k: v for k, v in run_defining_config(cfg).items() if not k.startswith(unknown)}
    return [f"{k}: {saved.get(k, '(absent)')!r} in the checkpoint, {now.get(k, '(absent)')!r} now"
            for k in sorted(set(saved) | set(now)) if saved.get(k, "(absent)") != now.get(k, "(absent)")]


def legacy_hash_matches(saved: str | None, cfg: Config) -> bool:
    """Checkpoints saved before meta.json held the config: their hash covered the whole dump, run.resume too."""
    import copy

    import yaml

    for resume in {cfg.run.resume, "none", "auto"}:
        c = copy.deepcopy(cfg)
        c.run.resume = resume
        d = {k: v for k, v in config_to_dict(c).items() if k not in (*_LATER_SECTIONS, "environment")}  # then absent
        if hashlib.sha256(yaml.safe_dump(d, sort_keys=False).encode()).hexdigest()[:16] == saved:
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


# ----------------------------------------------------------------------------------------------------
# The kernels' settings: the config's kernels: section and the MEGASSM_* environment
# ----------------------------------------------------------------------------------------------------

# variables this process set from a config (apply_settings), with their values: not the user's, so a later
# Trainer in the same process (the tests) neither takes them for an override nor records them
_SET_FROM_CONFIG: dict[str, str] = {}


def _user_value(var: str) -> str | None:
    v = os.environ.get(var)
    return None if v is None or _SET_FROM_CONFIG.get(var) == v else v


def _show(value) -> str:
    """A value as the config is written (true / false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def environment_record() -> list[str]:
    """NAME=value of every MEGASSM_* variable the user set (not those apply_settings set from a config)."""
    return sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MEGASSM_") and _user_value(k) is not None)


def resolve_settings(cfg: Config) -> list[str]:
    """Put the values in effect into cfg.kernels (a variable that is set wins over the config) and the record of
    the MEGASSM_* variables into cfg.environment, without changing the environment. Returns the overrides, one
    'kernels.KEY=VALUE (VAR; the config says VALUE)' each. A bad value raises a one-line ConfigError naming the
    key (or the variable) and the value. The values are parsed by kernels/core/env.py alone."""
    from megassm.kernels import env as kernel_env

    effective, overrides = {}, []
    for key, switch in kernel_env.SWITCHES.items():
        name = f"kernels.{key}"
        try:
            want = switch.record(switch.value(kernel_env.to_text(key, getattr(cfg.kernels, key)), label=name))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        user = _user_value(switch.var)
        if user is None:
            effective[key] = want
            continue
        try:
            effective[key] = switch.record(switch.value(user))
        except ValueError as e:
            raise ConfigError(f"environment: {e}") from None
        if effective[key] != want:
            overrides.append(f"{name}={_show(effective[key])} ({switch.var}; the config says {_show(want)})")
    record = environment_record()
    if cfg.environment and cfg.environment != record:  # e.g. --config RUN/config.yaml: a record, not applied
        log.info("environment: the config's record (%s) is not applied; this run records its own (%s)",
                 ", ".join(cfg.environment), ", ".join(record) or "none")
    for key, value in effective.items():
        setattr(cfg.kernels, key, value)
    cfg.environment = record
    return overrides


def apply_settings(cfg: Config) -> None:
    """The kernels: section made this process's environment, before any kernel runs (each rank calls it): every
    variable the user did not set gets the config's value (a default one is left unset). cfg then holds the
    values in effect and the record of the MEGASSM_* variables (resolve_settings), which config.yaml and the
    checkpoints save; an override by the environment is logged in one line."""
    from megassm.kernels import env as kernel_env

    overrides = resolve_settings(cfg)  # raises before the environment changes
    for key, switch in kernel_env.SWITCHES.items():
        if _user_value(switch.var) is not None:
            continue
        text = kernel_env.to_text(key, getattr(cfg.kernels, key))
        if text == kernel_env.to_text(key, switch.record(switch.value(None))):
            if switch.var in _SET_FROM_CONFIG:  # an earlier config's, in this process
                os.environ.pop(switch.var, None)
                del _SET_FROM_CONFIG[switch.var]
        else:
            os.environ[switch.var] = _SET_FROM_CONFIG[switch.var] = text
    if overrides:
        log.info("kernels: the environment overrides the config (config.yaml records the values in effect): %s",
                 "; ".join(overrides))

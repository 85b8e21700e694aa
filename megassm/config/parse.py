"""YAML and dotted overrides into the typed sections: unknown keys named with the closest valid one, values coerced
to the field's type, deprecated keys moved, `validate` run last (megassm/config/checks.py)."""
from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import types
import typing
from typing import Any

import yaml

from .sections import Config, ConfigError
from .derived import world_size
from .checks import validate

log = logging.getLogger("megassm.config")


# ----------------------------------------------------------------------------------------------------
# Building dataclasses from nested dicts, with typed values and helpful errors
# ----------------------------------------------------------------------------------------------------


def all_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of the section dataclass `cls` (e.g. all_keys(Config)), nested sections expanded."""
    keys = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else _resolve(cls, f)):
            keys.extend(all_keys(_resolve(cls, f), name + "."))
        else:
            keys.append(name)
    return keys


def _resolve(cls, f) -> Any:
    hints = typing.get_type_hints(cls)
    return hints[f.name]


def _closest(key: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.0)
    return match[0] if match else "?"


_NONE_WORDS = ("none", "null", "~")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Convert `value` to type `tp` (from the dataclass annotation) or raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in _NONE_WORDS)):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: {key}: cannot be {value!r}")
    if origin is list:
        if isinstance(value, str):  # command line: a,b,c or [a, b]
            try:
                value = yaml.safe_load(value if value.strip().startswith("[") else "[" + value + "]")
            except yaml.YAMLError as e:
                raise ConfigError(f"{where}: {key}: cannot read {value!r} as a list: {e}") from None
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: {key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]", where) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: {key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}: {key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {key}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: {key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: {key}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: {key}: unsupported type {tp}")


# Deprecated keys still read: key -> the key that replaces it. The value is kept aside while the config is read
# and converted by _resolve_deprecated once every file and override is applied.
DEPRECATED_KEYS = {"train.eval_batches": "train.eval_tokens"}


def _apply(obj: Any, data: dict, where: str, prefix: str = "") -> None:
    """Set fields of dataclass `obj` from nested dict `data`; unknown keys raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'top level'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for k, v in data.items():
        key = prefix + str(k)
        if key in DEPRECATED_KEYS:
            obj.__dict__.setdefault("_deprecated", {})[k] = (_coerce(v, int, key, where), where)
            continue
        if k not in names:
            while isinstance(v, dict) and len(v) == 1:  # name the full dotted key, not just its section
                (sub, v), = v.items()
                key += f".{sub}"
            valid = all_keys(Config)
            raise ConfigError(
                f"{where}: unknown key '{key}' (closest valid key: '{_closest(key, valid)}')"
            )
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            _apply(getattr(obj, k), v, where, key + ".")
        else:
            setattr(obj, k, _coerce(v, tp, key, where))
            obj.__dict__.setdefault("_given", set()).add(k)


def _resolve_deprecated(cfg: Config) -> None:
    """train.eval_batches (validation micro-batches per data-parallel rank) becomes train.eval_tokens: the same
    held-out samples in the layout this config describes (eval_batches x micro_batch x data-parallel ranks
    samples of seq_len tokens), from then on fixed whatever the layout."""
    t = cfg.train
    old = t.__dict__.pop("_deprecated", {})
    if "eval_batches" not in old:
        return
    n, where = old["eval_batches"]
    if "eval_tokens" in t.__dict__.get("_given", set()):
        raise ConfigError(f"{where}: train.eval_batches is deprecated and train.eval_tokens is set too: remove "
                          "train.eval_batches (docs/config.md)")
    p = cfg.parallel
    dp = max(1, world_size(cfg) // max(1, p.tp * p.cp * p.pp))
    t.eval_tokens = n * t.micro_batch * dp * t.seq_len
    log.warning("%s: train.eval_batches=%d is deprecated (it counted micro-batches per rank, so the held-out set "
                "changed with the layout): read as train.eval_tokens=%d (%d x micro_batch %d x %d data-parallel "
                "ranks x seq_len %d); set train.eval_tokens instead", where, n, t.eval_tokens, n, t.micro_batch, dp,
                t.seq_len)


def parse_override(text: str) -> tuple[str, str]:
    """`model.d_model=256` -> ('model.d_model', '256'). The text is converted by the key's type later,
    so a pattern such as `-` or `*` stays the string it is."""
    if "=" not in text:
        raise ConfigError(f"command line: override '{text}' must look like key=value (e.g. train.steps=50)")
    key, raw = text.split("=", 1)
    return key.strip(), raw.strip()


def _nest(key: str, value: Any) -> dict:
    out: dict = {}
    cur = out
    parts = key.split(".")
    for p in parts[:-1]:
        cur[p] = {}
        cur = cur[p]
    cur[parts[-1]] = value
    return out


def load_config(path: str | os.PathLike | None, overrides: list[str] = (), validate_config: bool = True) -> Config:
    """Read a YAML file (or start from defaults when path is None), apply dotted overrides, validate."""
    if path is None:
        return config_from_text(None, "defaults", overrides, validate_config)
    path = str(path)
    if not os.path.exists(path):
        raise ConfigError(f"{path}: config file not found")
    with open(path) as f:
        return config_from_text(f.read(), path, overrides, validate_config)


def config_from_text(text: str | None, where: str, overrides: list[str] = (), validate_config: bool = True) -> Config:
    """load_config for YAML text (e.g. the config a checkpoint's meta.json records); `where` names it in errors."""
    cfg = Config()
    if text is not None:
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: invalid YAML: {e}") from None
        _apply(cfg, data, where)
    cli_keys = set()
    for item in overrides:
        key, value = parse_override(item)
        _apply(cfg, _nest(key, value), "command line")
        cli_keys.add(key)
    # A later layer wins: data.paths given on the command line replaces the file's built-in corpus
    # (configs/tiny.yaml sets data.builtin=stdlib), unless the command line sets data.builtin too.
    if "data.paths" in cli_keys and "data.builtin" not in cli_keys and cfg.data.paths:
        cfg.data.builtin = None
    _resolve_deprecated(cfg)
    if validate_config:
        validate(cfg)
    return cfg


def config_from_dict(data: dict, where: str, validate_config: bool = False) -> Config:
    """A Config from a nested mapping (e.g. a checkpoint's recorded config); unknown keys name `where`."""
    cfg = Config()
    _apply(cfg, data or {}, where)
    if validate_config:
        validate(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)

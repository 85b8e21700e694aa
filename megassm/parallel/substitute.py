"""Replacing a module of the model by its parallel variant, visibly and without renaming anything.

    new = substitute(model, "layers.3.mixer.out_proj", RowParallelLinear, tp_group=g, sp=True)

The plans (tp.py, cp.py) change what a module computes, never what it holds: the variant is a subclass of
the module's own class, and the new instance takes over the original's parameters, buffers, submodules,
hooks and attributes (its init rules included) before it is registered in the parent under the same name.
So parameter names, canonical init, checkpoints and optimizer state are those of the single-device model,
and `print(model)` shows the parallel classes where they run.
"""
from __future__ import annotations

from torch import nn

__all__ = ["substitute", "adopt"]


def adopt(cls: type, old: nn.Module, **attrs) -> nn.Module:
    """An instance of `cls` (a subclass of type(old)) holding everything `old` holds, plus `attrs`."""
    if not issubclass(cls, type(old)):
        raise TypeError(f"{cls.__name__} is not a variant of {type(old).__name__}")
    new = cls.__new__(cls)
    new.__dict__.update(old.__dict__)  # _parameters, _buffers, _modules, hooks: the same objects
    for k, v in attrs.items():
        setattr(new, k, v)
    return new


def substitute(root: nn.Module, path: str, cls: type, **attrs) -> nn.Module:
    """Replace submodule `path` of `root` by `adopt(cls, it, **attrs)`, registered under the same name.
    Returns the new module. `path` must name a submodule (the root itself cannot be replaced in place)."""
    if not path:
        raise ValueError("substitute: name a submodule, not the root")
    parent_name, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    new = adopt(cls, parent.get_submodule(name), **attrs)
    setattr(parent, name, new)
    return new

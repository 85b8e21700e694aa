"""The kernels' dispatch and autograd plumbing, shared by the custom ops of every op folder (kernels/<op>/op.py): the
backend chosen per call from `MEGASSM_KERNELS`, the lazy import of the ops' Triton modules, the saving / restoring of
an op's inputs for its backward, the reference backward by recomputation, and the eager caller that skips the
custom-op dispatcher.

  auto    (default) Triton when the tensors are on CUDA, triton imports and the dtype is not fp64;
          the PyTorch reference otherwise.
  triton  always Triton; CPU tensors are an error unless TRITON_INTERPRET=1 (Triton's CPU interpreter,
          used by the tests). fp64 tensors still go to the reference (the kernels do not do fp64).
  torch   always the PyTorch reference (each op folder's reference.py).

Reference backward: the reference forward is recomputed on detached inputs under autograd and
differentiated with torch.autograd.grad, so gradients are the plain reference's autograd gradients exactly.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType
from typing import Callable, Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from . import env

logger = logging.getLogger("megassm.kernels")

_TRITON_MODULES: list = []  # every op's Triton modules (triton_module), imported together on the first Triton call
_triton_loaded = False
_triton_err: Optional[BaseException] = None


def mode() -> str:
    return env.kernels_mode()


def interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_module(name: str) -> Callable[[], ModuleType]:
    """Register `name` (an op folder's Triton module, e.g. "megassm.kernels.norm.triton_norm") and return the function
    that gives the module: the registered modules are imported together on the first Triton call (Triton reads
    TRITON_INTERPRET when its kernels are decorated, i.e. at import), and the backend is there only if all of
    them import."""
    _TRITON_MODULES.append(name)

    def get() -> ModuleType:
        if not triton_available():
            raise RuntimeError(f"{name}: the Triton kernels cannot be imported: {_triton_err!r}")
        module = sys.modules.get(name)  # None: registered after the others were imported (megassm.kernels.fp8)
        return module if module is not None else importlib.import_module(name)

    get.__name__ = name.rpartition(".")[2]
    return get


def triton_available() -> bool:
    """Whether triton and every registered Triton module import (tried once, on first use)."""
    global _triton_loaded, _triton_err
    if not _triton_loaded and _triton_err is None:
        try:
            importlib.import_module("triton")  # ImportError here means: no Triton backend
            for name in _TRITON_MODULES:
                importlib.import_module(name)
            _triton_loaded = True
        except Exception as e:  # ImportError, or a broken triton install
            _triton_err = e
    return _triton_loaded


def use_triton(x: Tensor) -> bool:
    """Backend decision for a call whose main tensor is `x`."""
    m = mode()
    if m == "torch" or x.dtype == torch.float64:
        return False
    if m == "triton":
        if not x.is_cuda and not interpret():  # checked before importing: Triton reads the flag at import
            raise RuntimeError(
                "MEGASSM_KERNELS=triton with CPU tensors: Triton kernels need CUDA tensors "
                "(or TRITON_INTERPRET=1 to run them in Triton's CPU interpreter). "
                "Use MEGASSM_KERNELS=auto or torch for the PyTorch reference."
            )
        if not triton_available():
            raise RuntimeError(f"MEGASSM_KERNELS=triton but triton cannot be imported: {_triton_err!r}")
        return True
    return x.is_cuda and triton_available()


def announce(use: bool, x: Tensor) -> None:
    # the "last announced" flag lives on the package (tests monkeypatch it)
    K = sys.modules[__package__]

    name = "triton" if use else "reference"
    if K._announced != name:
        K._announced = name
        if use:
            logger.info(
                "megassm.kernels: using Triton kernels (MEGASSM_KERNELS=%s, %s tensors%s; SSD precision for bf16 "
                "inputs: MEGASSM_SSD_PRECISION=%s)",
                mode(), x.device.type, ", interpreter" if not x.is_cuda else "", env.ssd_precision(),
            )
        else:
            logger.info("megassm.kernels: using PyTorch reference ops (MEGASSM_KERNELS=%s, %s tensors)",
                        mode(), x.device.type)


def first_on_triton(args) -> bool:
    """Whether an op's backward launches Triton (traceable_backward): its first input is on the Triton path."""
    return use_triton(args[0])


def pick(x: Tensor) -> bool:
    use = use_triton(x)
    announce(use, x)
    return use


# --------------------------------------------------------------------------------------------------------
# generic autograd plumbing


def save(ctx, inputs, output, keep_output=False):
    tensors, spec = [], []
    for a in inputs:
        if isinstance(a, Tensor):
            spec.append(len(tensors))
            tensors.append(a)
        else:
            spec.append(("const", a))
    n_in = len(tensors)
    if keep_output:
        outs = output if isinstance(output, tuple) else (output,)
        tensors.extend(outs)
    ctx.save_for_backward(*tensors)
    ctx._spec = spec
    ctx._n_in = n_in


def restore(ctx):
    saved = ctx.saved_tensors
    args = [saved[s] if isinstance(s, int) else s[1] for s in ctx._spec]
    return args, saved[ctx._n_in:]


def reference_backward(full_ref: Callable, ctx, args, grads):
    """Gradients of `full_ref(*args)` (which returns the op's output tuple) by recomputation under autograd."""
    need = ctx.needs_input_grad
    leaves = []
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and need[i] and (a.is_floating_point() or a.is_complex()):
            leaves.append(a.detach().requires_grad_(True))
        else:
            leaves.append(a)
    wrt = [i for i, a in enumerate(leaves) if isinstance(a, Tensor) and a.requires_grad]
    out = [None] * len(args)
    if not wrt:
        return tuple(out)
    with torch.enable_grad():
        outs = full_ref(*leaves)
        if not isinstance(outs, tuple):
            outs = (outs,)
        sel_o, sel_g = [], []
        for o, g in zip(outs, grads):
            if g is not None and o is not None and o.requires_grad and o.numel() > 0:
                sel_o.append(o)
                sel_g.append(g)
        if not sel_o:
            return tuple(out)
        gs = torch.autograd.grad(sel_o, [leaves[i] for i in wrt], sel_g, allow_unused=True)
    for i, g in zip(wrt, gs):
        out[i] = g
    return tuple(out)


def fresh(t: Tensor) -> Tensor:
    """Outputs are dense, contiguous, offset-0 tensors (what the fake implementations promise)."""
    if t.is_contiguous() and t.storage_offset() == 0:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def fresh_all(out):
    if isinstance(out, tuple):
        return tuple(fresh(o) for o in out)
    return fresh(out)


def empty_f32(x: Tensor) -> Tensor:
    return x.new_empty(0, dtype=torch.promote_types(x.dtype, torch.float32))


def compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def register_step(op, reference: Callable) -> None:
    """A decode-step op's fake and autograd registrations. Its first two inputs are the state and the token x, its
    outputs y like x and the new state like the state in fp32 at least; its backward (rarely needed: decoding runs
    under no_grad, and the Triton steps have none) is the reference one, `reference` recomputed."""

    def fake(state, x, *rest):
        return x.new_empty(x.shape), state.new_empty(state.shape, dtype=compute_dtype(x))

    def backward(ctx, *grads):
        args, _ = restore(ctx)
        return reference_backward(reference, ctx, args, grads)

    op.register_fake(fake)
    op.register_autograd(backward, setup_context=save)


def triton_error():
    """Why the Triton modules could not be imported (None when they were, or were not tried yet)."""
    return _triton_err


# --------------------------------------------------------------------------------------------------------
# eager fast path


# --------------------------------------------------------------------------------------------------------
# The backward under torch.compile. AOTAutograd traces an op's registered backward formula with fake tensors
# into the joint graph, and a Triton launch cannot take a fake tensor: so where the backward would launch Triton,
# the formula calls a second custom op, megassm::backward, whose real implementation runs the same backward
# function on the real tensors when the compiled graph runs. Its inputs: the tensors the forward saved, the
# output gradients, which inputs need a gradient, and a key to the backward function and the saved constants
# (ints, floats, dtypes: fixed for a compiled graph, so they live in a table rather than in the op's schema).
# Its outputs: the gradients of the inputs that need one, each a tensor of its own (a custom op's outputs may not
# share memory, so the backward writes no shared gradient buffers there: grad_blocks.SEPARATE).

_BACKWARDS: dict = {}  # key -> (backward function, saved spec, number of saved inputs, the op's name)
_BACKWARD_KEYS: dict = {}


def _backward_key(name: str, backward: Callable, spec: list, n_in: int) -> int:
    ident = (name, repr(spec), n_in)
    key = _BACKWARD_KEYS.get(ident)
    if key is None:
        key = _BACKWARD_KEYS[ident] = len(_BACKWARDS)
        _BACKWARDS[key] = (backward, spec, n_in, name)
    return key


def _needed(spec: list, saved, needs) -> list:
    """The saved input tensors whose gradients the backward op returns, in input order."""
    return [saved[s] for s, need in zip(spec, needs) if isinstance(s, int) and need]


class _SavedCtx:
    """What a backward function reads of its autograd ctx, rebuilt from the backward op's inputs."""

    def __init__(self, saved, spec, n_in, needs):
        self.saved_tensors, self._spec, self._n_in, self.needs_input_grad = tuple(saved), spec, n_in, tuple(needs)


@torch.library.custom_op("megassm::backward", mutates_args=())
def backward_op(key: int, saved: list[Tensor], grads: list[Optional[Tensor]], needs: list[bool]) -> list[Tensor]:
    from . import grad_blocks

    backward, spec, n_in, name = _BACKWARDS[key]
    grad_blocks.SEPARATE.on = True
    try:
        out = backward(_SavedCtx(saved, spec, n_in, needs), *grads)
    finally:
        grad_blocks.SEPARATE.on = False
    result, seen = [], {t.untyped_storage().data_ptr() for t in saved if t.numel()}
    for s, need, g in zip(spec, needs, out):
        if not (isinstance(s, int) and need):
            continue
        x = saved[s]
        if g is None:  # an input the backward found no gradient for
            g = torch.zeros_like(x)
        g = g.contiguous()
        ptr = g.untyped_storage().data_ptr()
        if g.numel() and ptr in seen:  # a gradient that is an input's or another gradient's memory
            g = g.clone()
            ptr = g.untyped_storage().data_ptr()
        seen.add(ptr)
        result.append(g)
    return result


@backward_op.register_fake
def _(key, saved, grads, needs):
    _, spec, _, _ = _BACKWARDS[key]
    return [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in _needed(spec, saved, needs)]


def traceable_backward(name: str, backward: Callable, triton_for: Callable) -> Callable:
    """The backward formula to register for op `name`: `backward` itself where it runs on real tensors (eager) or
    would not launch Triton (the reference backward, plain torch ops, traces as it is), else megassm::backward.
    `triton_for(args)`: whether the backward launches Triton for these inputs (args: the op's inputs as saved)."""

    def formula(ctx, *grads):
        saved = ctx.saved_tensors
        # fake (or functional over fake) tensors: AOTAutograd is tracing; real ones: eager, or the graph running
        if not any(is_fake(t) for t in saved) or not triton_for(restore(ctx)[0]):
            return backward(ctx, *grads)
        needs = [bool(n) for n in ctx.needs_input_grad]
        key = _backward_key(name, backward, ctx._spec, ctx._n_in)
        got = iter(backward_op(key, list(saved), list(grads), needs))
        return tuple(next(got) if isinstance(s, int) and need else None for s, need in zip(ctx._spec, needs))

    formula.__name__ = f"{name}_backward"
    return formula


def eager_caller(op, setup_context, backward):
    """A callable that runs `op` with the same implementation and the same backward, but in eager mode through
    a plain torch.autograd.Function instead of the custom-op dispatcher. The dispatcher's Python layers cost
    ~1 ms of host time per SSD call on an H100 (benchmarks/host_overhead.py), enough to leave the GPU idle in a
    training step; under torch.compile the custom op itself is called, so graphs still see one opaque op."""
    impl = op._init_fn

    class _EagerOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            out = impl(*args)
            setup_context(ctx, args, out)
            return out

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    _EagerOp.__name__ = _EagerOp.__qualname__ = f"{op._name}_eager"

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        return _EagerOp.apply(*args)

    call.__name__ = f"{op._name}_call"
    return call

"""torch.library custom ops (namespace "megassm") behind the public functions of megassm.kernels.

Every public op is one `torch.library.custom_op` with a fake (meta) implementation, so torch.compile and
activation checkpointing see a single opaque op, and an autograd registration. Inside the op the backend is
chosen per call from `MEGASSM_KERNELS` (kernels/dispatch.py: auto, triton, torch). Reference backward: the
reference forward recomputed and differentiated (dispatch._reference_backward). Triton backward: the Triton
backward kernels of the op (kernels/triton), which recompute what they need from the saved inputs (no
activations beyond the op's inputs are kept).

The decode-step ops have a Triton forward only; their backward (rarely needed) is the reference one.
The public functions in kernels/__init__.py call these ops for every Triton call and under torch.compile; in
eager mode a call that resolves to the reference skips the op and runs the reference directly (no recompute),
and a Triton call goes through the op's `*_call` (dispatch._eager_caller: a plain autograd.Function).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import env, reference
from .dispatch import (_cdt, _eager_caller, _empty_f32, _fresh, _fresh_all, _pick, _reference_backward, _restore,
                       _save, triton_kernels, use_triton)
from .dispatch import _announce, mode, triton_available, triton_error  # noqa: F401  (kernels/__init__.py, tests)


# --------------------------------------------------------------------------------------------------------
# SSD


def _ssd_ref_full(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx, chunk_size,
                  return_final_states):
    out = reference.ssd(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                        dt_limit=None if dt_limit is None else tuple(dt_limit), initial_states=initial_states,
                        seq_idx=seq_idx, chunk_size=chunk_size, return_final_states=return_final_states)
    if return_final_states:
        return out
    return out, _empty_f32(x)


def _ssd_triton_takes(x: Tensor, chunk_size: int) -> bool:
    return triton_kernels().ssd_supported(x, chunk_size)


@torch.library.custom_op("megassm::ssd", mutates_args=())
def ssd_op(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    dt_bias: Optional[Tensor], dt_softplus: bool, dt_limit: Optional[Sequence[float]],
    initial_states: Optional[Tensor], seq_idx: Optional[Tensor], chunk_size: int, return_final_states: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, final states or empty, kept buffer or empty): the last is for the backward only, never returned by
    kernels.ssd: the states (MEGASSM_SSD_SAVE_STATES), or the true segment ends of a segmented chunk walk (the
    backward's recompute starts from them). The backward needs the final states only when they are returned
    (their gradient is the only way they enter it), and then the second output is them."""
    if _pick(x) and _ssd_triton_takes(x, chunk_size):
        y, fin, kept = triton_kernels().ssd_fwd(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit,
                                                initial_states, seq_idx, chunk_size, return_final_states,
                                                env.ssd_save_states())
        return y, (fin if return_final_states else _empty_f32(x)), (kept if kept is not None else _empty_f32(x))
    y, fin = _fresh_all(_ssd_ref_full(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states,
                                      seq_idx, chunk_size, return_final_states))
    return y, fin, _empty_f32(x)


@ssd_op.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx, chunk_size,
      return_final_states):
    b, _, h, p = x.shape
    n = B.shape[-1]
    fin = x.new_empty((b, h, p, n), dtype=_cdt(x)) if return_final_states else _empty_f32(x)
    kept = _empty_f32(x)
    saved = (triton_kernels().ssd_kept_state_shape(x, B, chunk_size, env.ssd_save_states())
             if use_triton(x) and _ssd_triton_takes(x, chunk_size) else None)
    if saved is not None:
        kept = x.new_empty(saved[0], dtype=saved[1])
    return x.new_empty(x.shape), fin, kept


def _ssd_setup(ctx, inputs, output):
    _, fin, buf = output
    keep = buf.numel() > 0
    _save(ctx, inputs, ((buf, fin) if inputs[13] else (buf,)) if keep else (), keep_output=keep)
    ctx.mark_non_differentiable(buf)


class SplitLast(torch.autograd.Function):
    """torch.split along the last dim whose backward returns the gradients' common buffer itself when they
    arrive as its consecutive column blocks (the SSD backward writes dx, dB, dC so: _xbc_grad_buffer; the ops
    reading Mamba-2's in_proj pieces write into a GradBlocks), instead of concatenating them into a new tensor
    (autograd's split backward always copies: a cat per Mamba-2 layer)."""

    @staticmethod
    def forward(ctx, x, sizes, blocks=None):
        ctx.shape, ctx.sizes, ctx.blocks = x.shape, tuple(sizes), blocks
        return tuple(x.split(ctx.sizes, dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        out = _blocks_of_one(grads, ctx.shape, ctx.sizes)
        ref = getattr(out if out._base is None else out._base, _GRAD_BUFFER, None)
        owner = ref() if ref is not None else None
        for blocks in {id(b): b for b in (ctx.blocks, owner) if b is not None}.values():
            blocks.release()  # this split's, and the recomputation's whose buffer this is (checkpointing)
        return out, None, None


def _no_owner() -> None:
    """The _GRAD_BUFFER mark of a gradient buffer that no GradBlocks made (the SSD's dx | dB | dC)."""
    return None


PAD_ZEROED = "_megassm_pad_zeroed"  # attribute of a GradBlocks buffer whose rows' padding is zeros
_GRAD_BUFFER = "_megassm_grad_buffer"  # attribute of a GradBlocks buffer: a weakref of the GradBlocks that made it
_BY_STORAGE: "OrderedDict[int, GradBlocks]" = OrderedDict()  # a split tensor's storage address -> its GradBlocks
_REGISTRY_MAX = 4096


class GradBlocks:
    """One gradient buffer for the pieces of a tensor split along its last dim (split_last(share_grads=True)):
    the backward of an op reading a piece writes that piece's gradient into the piece's column block of one
    buffer shaped like the split tensor (`grad_block`), so split_last's backward returns the buffer with no
    concatenation (Mamba-2's in_proj output [z | xBC | dt]: the gated norm, the conv and the SSD each write
    theirs). A block is handed out once per backward pass (a piece read by two ops gets a fresh gradient the
    second time, and autograd sums the two as usual); the buffer is dropped once every block is handed out, and
    the hand-outs are reset by split_last's backward. A piece whose gradient is not its block (not written
    here, or summed from two readers) is copied into its block there; with no block written at all, the cat. The
    buffer's rows are as wide in memory as the split tensor's (an AlignedLinear output's padded rows), so the
    gradient reaches the matmul that produced it with the same aligned row stride; the padding columns are
    zeroed (PAD_ZEROED), so that matmul may read whole rows (parallel/layers.py _padded_grad)."""

    __slots__ = ("shape", "dtype", "device", "sizes", "row", "buf", "taken", "start", "strides", "key", "__weakref__",
                 "handed")

    def __init__(self, x: Tensor, sizes):
        self.shape, self.dtype, self.device, self.sizes = x.shape, x.dtype, x.device, tuple(sizes)
        # the buffer's rows as wide in memory as x's (x may be the first columns of padded rows:
        # parallel/layers.py AlignedLinear), so the gradient reaches the matmul that made x with x's row stride
        self.row = x.stride(-2) if _rows_of(x) else x.shape[-1]
        self.buf, self.taken, self.handed = None, set(), {}
        # found again by the pieces' memory too: activation checkpointing hands the backward the recomputed
        # pieces as new tensor objects (detached views of the recomputed x) without the tag, and nothing else
        # keeps the recomputation's GradBlocks: the registry does, until a split's backward releases it
        self.start, self.strides = x.storage_offset(), x.stride()
        self.key = x.untyped_storage().data_ptr()
        _BY_STORAGE[self.key] = self
        _BY_STORAGE.move_to_end(self.key)
        if len(_BY_STORAGE) > _REGISTRY_MAX:  # forwards never followed by a backward: drop the oldest
            _BY_STORAGE.popitem(last=False)

    def tag(self, pieces) -> None:
        off = 0
        for p, n in zip(pieces, self.sizes):
            p._megassm_grad_block = (self, off, n)
            off += n

    def take(self, off: int, n: int, piece: Tensor) -> Optional[Tensor]:
        if off in self.taken or piece.shape != (*self.shape[:-1], n) or piece.dtype != self.dtype \
                or piece.device != self.device:
            return None
        if self.buf is None:
            full = torch.empty((*self.shape[:-1], self.row), dtype=self.dtype, device=self.device)
            setattr(full, _GRAD_BUFFER, weakref.ref(self))  # weak: no cycle keeping the buffer alive
            if self.row > self.shape[-1]:  # padding zeroed: the matmul below reads whole rows (_padded_grad)
                full.narrow(-1, self.shape[-1], self.row - self.shape[-1]).zero_()
                setattr(full, PAD_ZEROED, True)
            self.buf = full if self.row == self.shape[-1] else full.narrow(-1, 0, self.shape[-1])
        block = self.buf.narrow(-1, off, n)
        self.taken.add(off)
        self.handed[off] = block
        if len(self.taken) == len(self.sizes):
            self.buf = None  # the blocks keep it alive for as long as autograd holds them
        return block

    def release(self) -> None:
        self.buf, self.taken, self.handed = None, set(), {}
        if _BY_STORAGE.get(self.key) is self:
            del _BY_STORAGE[self.key]


def _rows_of(x: Tensor) -> bool:
    """Whether x [..., W] is rows of unit column stride, W or more apart, whose leading dims collapse (x.view(-1,
    W) would work): e.g. the first W columns of a contiguous [..., W + pad]."""
    if x.dim() < 2 or x.stride(-1) != 1 or x.stride(-2) < x.shape[-1]:
        return False
    return all(x.stride(i) == x.stride(i + 1) * x.shape[i + 1] for i in range(x.dim() - 2))


def _tag_by_memory(piece: Tensor):
    """(blocks, offset, width) of a piece found by where it lies: in the memory of the latest split tensor at its
    storage, at one of that split's column blocks, with the split tensor's strides; else None."""
    # a tensor subclass (fake / functional ones in torch.compile's tracing) has no memory of its own to look up
    if not _BY_STORAGE or type(piece) is not torch.Tensor or torch.compiler.is_compiling():
        return None
    blocks = _BY_STORAGE.get(piece.untyped_storage().data_ptr())
    if blocks is None or piece.stride() != blocks.strides or piece.shape[:-1] != blocks.shape[:-1]:
        return None
    col, off = piece.storage_offset() - blocks.start, 0
    for n in blocks.sizes:
        if off == col:
            return (blocks, off, n) if n == piece.shape[-1] else None
        off += n
    return None


def handed_block(piece: Tensor) -> Optional[Tensor]:
    """The block already handed out for `piece` in this backward pass (the gradient an op wrote there), or None."""
    tag = getattr(piece, "_megassm_grad_block", None) or _tag_by_memory(piece)
    return None if tag is None else tag[0].handed.get(tag[1])


def grad_block(piece: Optional[Tensor]) -> Optional[Tensor]:
    """The block of a GradBlocks buffer to write `piece`'s gradient into, or None (allocate as usual)."""
    if piece is None:
        return None
    tag = getattr(piece, "_megassm_grad_block", None) or _tag_by_memory(piece)
    return None if tag is None else tag[0].take(tag[1], tag[2], piece)


def _blocks_of_one(grads, shape, sizes) -> Tensor:
    """The tensor of `shape` whose last-dim blocks of `sizes` the grads are: their common base (its first
    columns, when its rows are wider: GradBlocks of a padded tensor) when they are exactly its consecutive
    blocks from column 0 (no copy). When some are blocks of a GradBlocks buffer and others are not (a piece
    read by two ops, whose gradients autograd summed into a new tensor: CP's halo and decay reads), the others
    are copied into their blocks of that buffer (zeros for a missing one): a copy of those pieces only. Else a
    cat (zeros for a missing gradient)."""
    base = next((g._base for g in grads if g is not None and g._base is not None
                 and getattr(g._base, _GRAD_BUFFER, None) is not None), None)
    if base is None:
        base = grads[0]._base if grads[0] is not None else None
    if base is not None and base.shape[:-1] == shape[:-1] and base.shape[-1] >= shape[-1] and base.is_contiguous():
        full = base if base.shape[-1] == shape[-1] else base.narrow(-1, 0, shape[-1])
        ours = getattr(base, _GRAD_BUFFER, None) is not None
        off, rest = 0, []
        for g, n in zip(grads, sizes):
            want = full.narrow(-1, off, n)
            if g is None or g._base is not base or g.data_ptr() != want.data_ptr() or g.shape != want.shape \
                    or g.stride() != want.stride():
                if not ours:
                    break
                rest.append((want, g))
            off += n
        else:
            for want, g in rest:  # every block not written in place: filled now
                want.zero_() if g is None else want.copy_(g)
            return full
    like = next(g for g in grads if g is not None)
    return torch.cat([g if g is not None else like.new_zeros((*shape[:-1], n)) for g, n in zip(grads, sizes)], -1)


def _packed_rows(x: Tensor, B: Tensor, C: Tensor) -> bool:
    """Whether x [b, l, h, p], B and C [b, l, g, n] are the consecutive column blocks of one contiguous
    [b, l, h*p + 2*g*n] tensor (Mamba-2 splits its conv output so): their gradients can then be written as the
    same blocks of one buffer, which split_last's backward returns without a copy."""
    _, l, h, p = x.shape
    gn = B.shape[-2] * B.shape[-1]
    w = h * p + 2 * gn
    row = (l * w, w)
    return (B.shape == C.shape and x.dtype == B.dtype == C.dtype and
            x.untyped_storage().data_ptr() == B.untyped_storage().data_ptr() == C.untyped_storage().data_ptr()
            and x.stride() == (*row, p, 1) and B.stride() == C.stride() == (*row, B.shape[-1], 1)
            and B.storage_offset() == x.storage_offset() + h * p and C.storage_offset() == B.storage_offset() + gn)


def _xbc_grad_buffer(x: Tensor, B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dx, dB, dC as the column blocks of one fresh [b, l, h*p + 2*g*n] buffer (see _packed_rows)."""
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    buf = x.new_empty(b, l, h * p + 2 * g * n)
    setattr(buf, _GRAD_BUFFER, _no_owner)  # split_last's backward may fill a block the SSD's did not end up in (CP)
    dx, db, dc = buf.split([h * p, g * n, g * n], dim=-1)
    return dx.view(b, l, h, p), db.view(b, l, g, n), dc.view(b, l, g, n)


def _ssd_bwd(ctx, gy, gfinal, _gkept=None):
    args, kept = _restore(ctx)
    x = args[0]
    if use_triton(x) and triton_kernels().HAS_SSD_BWD and _ssd_triton_takes(x, args[12]):
        (x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, init, seq_idx, chunk, ret) = args
        grads = triton_kernels().ssd_bwd(
            gy, gfinal if ret else None, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, init, seq_idx,
            chunk, kept=(kept[0], kept[1] if ret else None) if kept else None,
            out_xbc=_xbc_grad_buffer(x, B) if _packed_rows(x, B, C) else None,
            out_ddt=grad_block(dt) if ctx.needs_input_grad[1] else None)
        dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = grads
        return dx, ddt, dA, dB, dC, dD, dz, ddt_bias, None, None, dinit, None, None, None
    return _reference_backward(_ssd_ref_full, ctx, args, (gy, gfinal))


ssd_op.register_autograd(_ssd_bwd, setup_context=_ssd_setup)


# --------------------------------------------------------------------------------------------------------
# SSD decode step


def _ssd_step_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit):
    y, new = reference.ssd_step(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                dt_limit=None if dt_limit is None else tuple(dt_limit))
    return y, new


@torch.library.custom_op("megassm::ssd_step", mutates_args=())
def ssd_step_op(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool, dt_limit: Optional[Sequence[float]],
) -> tuple[Tensor, Tensor]:
    if _pick(x) and triton_kernels().HAS_SSD_STEP:
        return triton_kernels().ssd_step_fwd(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit)
    return _fresh_all(_ssd_step_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit))


@ssd_step_op.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit):
    return x.new_empty(x.shape), state.new_empty(state.shape, dtype=_cdt(x))


def _step_setup(ctx, inputs, output):
    _save(ctx, inputs, output)


def _ssd_step_bwd(ctx, gy, gstate):
    args, _ = _restore(ctx)
    return _reference_backward(_ssd_step_ref, ctx, args, (gy, gstate))


ssd_step_op.register_autograd(_ssd_step_bwd, setup_context=_step_setup)


# --------------------------------------------------------------------------------------------------------
# causal conv1d


def _conv_ref_full(x, weight, bias, initial_state, seq_idx, activation, return_final_state):
    out = reference.causal_conv1d(x, weight, bias, initial_state=initial_state, seq_idx=seq_idx,
                                  activation=activation, return_final_state=return_final_state)
    if return_final_state:
        return out
    return out, _empty_f32(x)


def _check_activation(activation):
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: unknown activation {activation!r} (expected 'silu' or None)")


@torch.library.custom_op("megassm::causal_conv1d", mutates_args=())
def causal_conv1d_op(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
    seq_idx: Optional[Tensor], activation: Optional[str], return_final_state: bool,
) -> tuple[Tensor, Tensor]:
    _check_activation(activation)
    if _pick(x):
        y, fin = triton_kernels().causal_conv1d_fwd(x, weight, bias, initial_state, seq_idx,
                                                    activation is not None, return_final_state)
        return y, (fin if return_final_state else _empty_f32(x))
    return _fresh_all(_conv_ref_full(x, weight, bias, initial_state, seq_idx, activation, return_final_state))


@causal_conv1d_op.register_fake
def _(x, weight, bias, initial_state, seq_idx, activation, return_final_state):
    b, _, c = x.shape
    w = weight.shape[-1]
    fin = x.new_empty((b, c, w - 1), dtype=_cdt(x)) if return_final_state else _empty_f32(x)
    return x.new_empty(x.shape), fin


def _conv_setup(ctx, inputs, output):
    _save(ctx, inputs, output)


def _conv_bwd(ctx, gy, gfinal):
    args, _ = _restore(ctx)
    x, weight, bias, init, seq_idx, activation, ret = args
    if use_triton(x):
        need = ctx.needs_input_grad
        dx, dw, db, dinit = triton_kernels().causal_conv1d_bwd(
            x, weight, bias, init, seq_idx, activation is not None, gy, gfinal if ret else None,
            out_dx=grad_block(x) if need[0] else None)
        return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None,
                dinit if need[3] else None, None, None, None)
    return _reference_backward(_conv_ref_full, ctx, args, (gy, gfinal))


causal_conv1d_op.register_autograd(_conv_bwd, setup_context=_conv_setup)


def _conv_step_ref(state, x, weight, bias, activation):
    y, new = reference.causal_conv1d_step(state, x, weight, bias, activation=activation)
    return y, new.contiguous()


@torch.library.custom_op("megassm::causal_conv1d_step", mutates_args=())
def causal_conv1d_step_op(
    state: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str]
) -> tuple[Tensor, Tensor]:
    _check_activation(activation)
    if _pick(x) and triton_kernels().HAS_CONV_STEP:
        return triton_kernels().causal_conv1d_step_fwd(state, x, weight, bias, activation is not None)
    return _fresh_all(_conv_step_ref(state, x, weight, bias, activation))


@causal_conv1d_step_op.register_fake
def _(state, x, weight, bias, activation):
    return x.new_empty(x.shape), state.new_empty(state.shape, dtype=_cdt(x))


def _conv_step_bwd(ctx, gy, gstate):
    args, _ = _restore(ctx)
    return _reference_backward(_conv_step_ref, ctx, args, (gy, gstate))


causal_conv1d_step_op.register_autograd(_conv_step_bwd, setup_context=_step_setup)


# --------------------------------------------------------------------------------------------------------
# selective scan (seed mixers S Mamba-1 and L Longhorn)


def _scan_ref_full(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay, initial_state, seq_idx,
                   return_final_state):
    out = reference.selective_scan(x, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                   delta_softplus=delta_softplus, decay=decay, initial_state=initial_state,
                                   seq_idx=seq_idx, return_final_state=return_final_state)
    if return_final_state:
        return out
    return out, _empty_f32(x)


@torch.library.custom_op("megassm::selective_scan", mutates_args=())
def selective_scan_op(
    x: Tensor, delta: Tensor, A: Optional[Tensor], B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    delta_bias: Optional[Tensor], delta_softplus: bool, decay: str, initial_state: Optional[Tensor],
    seq_idx: Optional[Tensor], return_final_state: bool,
) -> tuple[Tensor, Tensor]:
    if _pick(x):
        y, fin = triton_kernels().selective_scan_fwd(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay,
                                                     initial_state, seq_idx, return_final_state)
        return y, (fin if return_final_state else _empty_f32(x))
    return _fresh_all(_scan_ref_full(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay, initial_state,
                                     seq_idx, return_final_state))


@selective_scan_op.register_fake
def _(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay, initial_state, seq_idx, return_final_state):
    b, _, d = x.shape
    fin = x.new_empty((b, d, B.shape[-1]), dtype=_cdt(x)) if return_final_state else _empty_f32(x)
    return x.new_empty(x.shape), fin


def _scan_setup(ctx, inputs, output):
    _save(ctx, inputs, output)


def _scan_bwd(ctx, gy, gfinal):
    args, _ = _restore(ctx)
    x = args[0]
    if use_triton(x):
        (x, delta, A, B, C, D, z, delta_bias, softplus, decay, init, seq_idx, ret) = args
        grads = triton_kernels().selective_scan_bwd(gy, gfinal if ret else None, x, delta, A, B, C, D, z, delta_bias,
                                                    softplus, decay, init, seq_idx)
        dx, ddelta, dA, dB, dC, dD, dz, dbias, dinit = grads
        need = ctx.needs_input_grad
        keep = [g if need[i] else None for i, g in zip((0, 1, 2, 3, 4, 5, 6, 7, 10),
                                                        (dx, ddelta, dA, dB, dC, dD, dz, dbias, dinit))]
        return (*keep[:8], None, None, keep[8], None, None)
    return _reference_backward(_scan_ref_full, ctx, args, (gy, gfinal))


selective_scan_op.register_autograd(_scan_bwd, setup_context=_scan_setup)


# --------------------------------------------------------------------------------------------------------
# COFFEE recurrence + read-out (seed mixer C, solver=sequential)


@torch.library.custom_op("megassm::coffee_scan", mutates_args=())
def coffee_scan_op(v: Tensor, lam: Tensor, w: Tensor, C: Tensor, w_out: Optional[Tensor], x0: Optional[Tensor],
                   seq_idx: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(y, final state, checkpoints): the Triton kernel's segment checkpoints are an output so that the
    backward (which recomputes from them) can save them; the reference returns an empty one."""
    if _pick(v):
        return triton_kernels().coffee_scan_fwd(v, lam, w, C, w_out, x0, seq_idx)
    y, fin = reference.coffee_scan(v, lam, w, C, w_out, x0, seq_idx)
    return _fresh(y), _fresh(fin), _empty_f32(v)


@coffee_scan_op.register_fake
def _(v, lam, w, C, w_out, x0, seq_idx):
    b, L, d = v.shape
    n = lam.shape[-1]
    cdt = _cdt(v)
    nseg = -(-L // triton_kernels().coffee.SEGMENT) if use_triton(v) else 0
    ck = v.new_empty((b, nseg, d, n), dtype=cdt) if nseg else _empty_f32(v)
    return v.new_empty((b, L, d), dtype=cdt), v.new_empty((b, d, n), dtype=cdt), ck


def _coffee_setup(ctx, inputs, output):
    _save(ctx, inputs, (output[2],), keep_output=True)  # the checkpoints only (y is not needed)


def _coffee_ref_full(v, lam, w, C, w_out, x0, seq_idx):
    y, fin = reference.coffee_scan(v, lam, w, C, w_out, x0, seq_idx)
    return y, fin, _empty_f32(v)


def _coffee_bwd(ctx, gy, gfin, gck):
    args, outs = _restore(ctx)
    v = args[0]
    if use_triton(v):
        (v, lam, w, C, w_out, x0, seq_idx) = args
        dv, dlam, dw, dC, dwo, dx0 = triton_kernels().coffee_scan_bwd(gy, gfin, v, lam, w, C, w_out, seq_idx, outs[0])
        need = ctx.needs_input_grad
        grads = (dv, dlam.to(lam.dtype), dw.to(w.dtype), dC.to(C.dtype),
                 dwo.to(w_out.dtype) if dwo is not None else None, dx0.to(x0.dtype) if x0 is not None else None)
        return (*[g if need[i] else None for i, g in enumerate(grads)], None)
    return _reference_backward(_coffee_ref_full, ctx, args, (gy, gfin, gck))


coffee_scan_op.register_autograd(_coffee_bwd, setup_context=_coffee_setup)


def _scan_step_ref(state, x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay):
    return reference.selective_scan_step(state, x, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                         delta_softplus=delta_softplus, decay=decay)


@torch.library.custom_op("megassm::selective_scan_step", mutates_args=())
def selective_scan_step_op(
    state: Tensor, x: Tensor, delta: Tensor, A: Optional[Tensor], B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], delta_bias: Optional[Tensor], delta_softplus: bool, decay: str,
) -> tuple[Tensor, Tensor]:
    if _pick(x):
        return triton_kernels().selective_scan_step_fwd(state, x, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                                        decay)
    return _fresh_all(_scan_step_ref(state, x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay))


@selective_scan_step_op.register_fake
def _(state, x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay):
    return x.new_empty(x.shape), state.new_empty(state.shape, dtype=_cdt(x))


def _scan_step_bwd(ctx, gy, gstate):
    args, _ = _restore(ctx)
    return _reference_backward(_scan_step_ref, ctx, args, (gy, gstate))


selective_scan_step_op.register_autograd(_scan_step_bwd, setup_context=_step_setup)


# --------------------------------------------------------------------------------------------------------
# norms


def _gated_ref(x, z, weight, ngroups, eps, norm_before_gate):
    return reference.gated_rmsnorm(x, z, weight, ngroups=ngroups, eps=eps, norm_before_gate=norm_before_gate)


@torch.library.custom_op("megassm::gated_rmsnorm", mutates_args=())
def gated_rmsnorm_op(
    x: Tensor, z: Optional[Tensor], weight: Optional[Tensor], ngroups: int, eps: float, norm_before_gate: bool
) -> Tensor:
    if x.shape[-1] % ngroups != 0:
        raise ValueError(f"gated_rmsnorm: dim {x.shape[-1]} not divisible by ngroups {ngroups}")
    if _pick(x):
        return triton_kernels().gated_rmsnorm_fwd(x, z, weight, ngroups, eps, norm_before_gate)
    out = _gated_ref(x, z, weight, ngroups, eps, norm_before_gate)
    return _fresh(out.clone() if out is x else out)


@gated_rmsnorm_op.register_fake
def _(x, z, weight, ngroups, eps, norm_before_gate):
    return x.new_empty(x.shape)


def _norm_setup(ctx, inputs, output):
    _save(ctx, inputs, output)


def _gated_bwd(ctx, gout):
    args, _ = _restore(ctx)
    x, z, weight, ngroups, eps, nbg = args
    if use_triton(x):
        dx, dz, dw = triton_kernels().gated_rmsnorm_bwd(gout, x, z, weight, ngroups, eps, nbg,
                                                        out_dz=grad_block(z) if ctx.needs_input_grad[1] else None)
        return dx, dz, dw, None, None, None
    return _reference_backward(_gated_ref, ctx, args, (gout,))


gated_rmsnorm_op.register_autograd(_gated_bwd, setup_context=_norm_setup)


def _rmsnorm_ref(x, weight, eps):
    return reference.rmsnorm(x, weight, eps)


@torch.library.custom_op("megassm::rmsnorm", mutates_args=())
def rmsnorm_op(x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    if _pick(x):
        return triton_kernels().gated_rmsnorm_fwd(x, None, weight, 1, eps, False)
    out = _rmsnorm_ref(x, weight, eps)
    return _fresh(out.clone() if out is x else out)


@rmsnorm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


def _rmsnorm_bwd(ctx, gout):
    args, _ = _restore(ctx)
    x, weight, eps = args
    if use_triton(x):
        dx, _, dw = triton_kernels().gated_rmsnorm_bwd(gout, x, None, weight, 1, eps, False)
        return dx, dw, None
    return _reference_backward(_rmsnorm_ref, ctx, args, (gout,))


rmsnorm_op.register_autograd(_rmsnorm_bwd, setup_context=_norm_setup)


def _add_ref(x, residual, weight, eps):
    return reference.add_rmsnorm(x, residual, weight, eps)


@torch.library.custom_op("megassm::add_rmsnorm", mutates_args=())
def add_rmsnorm_op(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: float
                   ) -> tuple[Tensor, Tensor]:
    if _pick(x):
        return triton_kernels().add_rmsnorm_fwd(x, residual, weight, eps)
    out, res = _add_ref(x, residual, weight, eps)
    if res is x or res is residual:  # a custom op's outputs must not alias its inputs
        res = res.clone()
    if out is x:
        out = out.clone()
    return _fresh(out), _fresh(res)


@add_rmsnorm_op.register_fake
def _(x, residual, weight, eps):
    cdt = _cdt(x) if residual is None else torch.promote_types(_cdt(x), residual.dtype)
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=cdt)


def _add_setup(ctx, inputs, output):
    _save(ctx, inputs, output, keep_output=True)


def _add_bwd(ctx, gout, gres):
    args, outs = _restore(ctx)
    x, residual, weight, eps = args
    if use_triton(x):
        new_res = outs[1]
        dx, dres, dw = triton_kernels().add_rmsnorm_bwd(gout, gres, new_res, weight, eps, x.dtype,
                                                        None if residual is None else residual.dtype)
        need = ctx.needs_input_grad
        return dx if need[0] else None, dres if need[1] else None, dw if need[2] else None, None
    return _reference_backward(_add_ref, ctx, args, (gout, gres))


add_rmsnorm_op.register_autograd(_add_bwd, setup_context=_add_setup)


# --------------------------------------------------------------------------------------------------------
# swiglu: silu(a) * b (the gated MLP's activation)


@torch.library.custom_op("megassm::swiglu", mutates_args=())
def swiglu_op(a: Tensor, b: Tensor) -> Tensor:
    if _pick(a):
        return triton_kernels().swiglu_fwd(a, b)
    return _fresh(reference.swiglu(a, b))


@swiglu_op.register_fake
def _(a, b):
    return a.new_empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype))


def _swiglu_setup(ctx, inputs, output):
    _save(ctx, inputs, output)


def _swiglu_bwd(ctx, gout):
    args, _ = _restore(ctx)
    a, b = args
    if use_triton(a):
        return triton_kernels().swiglu_bwd(gout, a, b)
    return _reference_backward(reference.swiglu, ctx, args, (gout,))


swiglu_op.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)


# --------------------------------------------------------------------------------------------------------
# cross-entropy of the LM head: per-row fp32 losses (and the log-sum-exp the Triton backward reads)


def _ce_ref(logits, labels, ignore_index):
    # the op's outputs: the losses and each row's log-sum-exp (what the Triton backward reads)
    lse = torch.logsumexp(logits.detach().to(_cdt(logits)), dim=-1)
    return reference.cross_entropy(logits, labels, ignore_index), lse


@torch.library.custom_op("megassm::cross_entropy", mutates_args=())
def cross_entropy_op(logits: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    if _pick(logits):
        return triton_kernels().cross_entropy_fwd(logits, labels, ignore_index)
    return _fresh_all(_ce_ref(logits, labels, ignore_index))


@cross_entropy_op.register_fake
def _(logits, labels, ignore_index):
    n = logits.shape[0]
    return logits.new_empty(n, dtype=_cdt(logits)), logits.new_empty(n, dtype=_cdt(logits))


def _ce_setup(ctx, inputs, output):
    _save(ctx, inputs, output, keep_output=True)
    ctx.mark_non_differentiable(output[1])


def _ce_bwd(ctx, gloss, _glse):
    args, outs = _restore(ctx)
    logits, labels, ignore_index = args
    if use_triton(logits):
        return triton_kernels().cross_entropy_bwd(gloss, logits, labels, outs[1], ignore_index), None, None
    return _reference_backward(_ce_ref, ctx, args, (gloss, None))


cross_entropy_op.register_autograd(_ce_bwd, setup_context=_ce_setup)


ssd_call = _eager_caller(ssd_op, _ssd_setup, _ssd_bwd)
causal_conv1d_call = _eager_caller(causal_conv1d_op, _conv_setup, _conv_bwd)
gated_rmsnorm_call = _eager_caller(gated_rmsnorm_op, _norm_setup, _gated_bwd)
rmsnorm_call = _eager_caller(rmsnorm_op, _norm_setup, _rmsnorm_bwd)
add_rmsnorm_call = _eager_caller(add_rmsnorm_op, _add_setup, _add_bwd)
swiglu_call = _eager_caller(swiglu_op, _swiglu_setup, _swiglu_bwd)
cross_entropy_call = _eager_caller(cross_entropy_op, _ce_setup, _ce_bwd)
selective_scan_call = _eager_caller(selective_scan_op, _scan_setup, _scan_bwd)
coffee_scan_call = _eager_caller(coffee_scan_op, _coffee_setup, _coffee_bwd)

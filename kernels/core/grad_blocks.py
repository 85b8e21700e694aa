"""Gradient buffers shared by the pieces of a split tensor (kernels.split_last), so a split's backward returns
one buffer instead of concatenating its pieces' gradients (autograd's split backward always copies: a cat per
Mamba-2 layer).

    SplitLast             torch.split along the last dim, whose backward returns the gradients' common buffer
    GradBlocks            split_last(share_grads=True): the pieces' column blocks of one buffer, handed to the
                          Triton backwards that read the pieces (grad_block); found by the pieces' tag or, under
                          activation checkpointing, by their memory
    packed_rows / xbc_grad_buffer   the SSD's x, B, C read from one tensor: dx | dB | dC as blocks of one buffer
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Optional

import torch
from torch import Tensor

__all__ = ["SplitLast", "GradBlocks", "PAD_ZEROED", "grad_block", "handed_block", "packed_rows", "xbc_grad_buffer"]


class SplitLast(torch.autograd.Function):
    """torch.split along the last dim whose backward returns the gradients' common buffer itself when they
    arrive as its consecutive column blocks (the SSD backward writes dx, dB, dC so: xbc_grad_buffer; the ops
    reading Mamba-2's in_proj pieces write into a GradBlocks), instead of concatenating them into a new tensor
    (autograd's split backward always copies: a cat per Mamba-2 layer)."""

    @staticmethod
    def forward(ctx, x, sizes, blocks=None):
        ctx.shape, ctx.sizes, ctx.blocks = x.shape, tuple(sizes), blocks
        return tuple(x.split(ctx.sizes, dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        out = _blocks_of_one(grads, ctx.shape, ctx.sizes)
        owner = getattr(out if out._base is None else out._base, _GRAD_BUFFER, _no_owner)()
        for blocks in (ctx.blocks, owner):  # this split's, and the recomputation's whose buffer this is
            if blocks is not None:
                blocks.release()
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

    __slots__ = ("shape", "dtype", "device", "sizes", "row", "buf", "handed", "start", "strides", "key", "__weakref__")

    def __init__(self, x: Tensor, sizes):
        self.shape, self.dtype, self.device, self.sizes = x.shape, x.dtype, x.device, tuple(sizes)
        # the buffer's rows as wide in memory as x's (x may be the first columns of padded rows:
        # parallel/layers.py AlignedLinear), so the gradient reaches the matmul that made x with x's row stride
        self.row = x.stride(-2) if _rows_of(x) else x.shape[-1]
        self.buf, self.handed = None, {}  # the blocks handed out in this backward pass, by offset
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
        if off in self.handed or piece.shape != (*self.shape[:-1], n) or piece.dtype != self.dtype \
                or piece.device != self.device:
            return None
        if self.buf is None:
            full = torch.empty((*self.shape[:-1], self.row), dtype=self.dtype, device=self.device)
            setattr(full, _GRAD_BUFFER, weakref.ref(self))  # weak: no cycle keeping the buffer alive
            if self.row > self.shape[-1]:  # padding zeroed: the matmul below reads whole rows (_padded_grad)
                full.narrow(-1, self.shape[-1], self.row - self.shape[-1]).zero_()
                setattr(full, PAD_ZEROED, True)
            self.buf = full if self.row == self.shape[-1] else full.narrow(-1, 0, self.shape[-1])
        block = self.handed[off] = self.buf.narrow(-1, off, n)
        if len(self.handed) == len(self.sizes):
            self.buf = None  # the blocks keep it alive for as long as autograd holds them
        return block

    def release(self) -> None:
        self.buf, self.handed = None, {}
        if _BY_STORAGE.get(self.key) is self:
            del _BY_STORAGE[self.key]


def _rows_of(x: Tensor) -> bool:
    """Whether x [..., W] is rows of unit column stride, W or more apart, whose leading dims collapse (x.view(-1,
    W) would work): e.g. the first W columns of a contiguous [..., W + pad]."""
    if x.dim() < 2 or x.stride(-1) != 1 or x.stride(-2) < x.shape[-1]:
        return False
    return all(x.stride(i) == x.stride(i + 1) * x.shape[i + 1] for i in range(x.dim() - 2))


# True inside a backward run as a custom op of its own (dispatch.traceable_backward: torch.compile), whose outputs
# may not share memory: every gradient then gets its own tensor
SEPARATE = threading.local()


def _separate() -> bool:
    return getattr(SEPARATE, "on", False)


def _tag_by_memory(piece: Tensor):
    """(blocks, offset, width) of a piece found by where it lies: in the memory of the latest split tensor at its
    storage, at one of that split's column blocks, with the split tensor's strides; else None."""
    # a tensor subclass (fake / functional ones in torch.compile's tracing) has no memory of its own to look up
    if not _BY_STORAGE or type(piece) is not torch.Tensor or torch.compiler.is_compiling() or _separate():
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


def _tag_of(piece: Tensor):
    return getattr(piece, "_megassm_grad_block", None) or _tag_by_memory(piece)


def handed_block(piece: Tensor) -> Optional[Tensor]:
    """The block already handed out for `piece` in this backward pass (the gradient an op wrote there), or None."""
    tag = _tag_of(piece)
    return None if tag is None else tag[0].handed.get(tag[1])


def grad_block(piece: Optional[Tensor]) -> Optional[Tensor]:
    """The block of a GradBlocks buffer to write `piece`'s gradient into, or None (allocate as usual)."""
    tag = None if piece is None else _tag_of(piece)
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


def packed_rows(x: Tensor, B: Tensor, C: Tensor) -> bool:
    """Whether x [b, l, h, p], B and C [b, l, g, n] are the consecutive column blocks of one contiguous
    [b, l, h*p + 2*g*n] tensor (Mamba-2 splits its conv output so): their gradients can then be written as the
    same blocks of one buffer, which split_last's backward returns without a copy."""
    if _separate():
        return False
    _, l, h, p = x.shape
    gn = B.shape[-2] * B.shape[-1]
    w = h * p + 2 * gn
    row = (l * w, w)
    return (B.shape == C.shape and x.dtype == B.dtype == C.dtype and
            x.untyped_storage().data_ptr() == B.untyped_storage().data_ptr() == C.untyped_storage().data_ptr()
            and x.stride() == (*row, p, 1) and B.stride() == C.stride() == (*row, B.shape[-1], 1)
            and B.storage_offset() == x.storage_offset() + h * p and C.storage_offset() == B.storage_offset() + gn)


def xbc_grad_buffer(x: Tensor, B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dx, dB, dC as the column blocks of one fresh [b, l, h*p + 2*g*n] buffer (see packed_rows)."""
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    buf = x.new_empty(b, l, h * p + 2 * g * n)
    setattr(buf, _GRAD_BUFFER, _no_owner)  # split_last's backward may fill a block the SSD's did not end up in (CP)
    dx, db, dc = buf.split([h * p, g * n, g * n], dim=-1)
    return dx.view(b, l, h, p), db.view(b, l, g, n), dc.view(b, l, g, n)

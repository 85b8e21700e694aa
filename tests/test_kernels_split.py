"""kernels.split_last and the gradient buffers shared by the ops reading its pieces: the x, B, C split of the
Mamba-2 conv output (the SSD backward writes their gradients as the blocks of one buffer), the [z | xBC | dt]
split of in_proj (grad_blocks.GradBlocks: the gated norm, conv and SSD backwards each write their block), padded rows
(an AlignedLinear output) and the cat fallback. The Triton tests run in the CPU interpreter on CI, natively on
a machine with CUDA.
"""
import pytest
import torch

# kernel_cases sets TRITON_INTERPRET before the Triton kernels are first imported
from kernel_cases import DEV, TRITON_WARNINGS, K, needs_triton
from kernel_cases import triton_mode  # noqa: F401  (fixture)
from megassm.kernels import grad_blocks as gb

pytestmark = TRITON_WARNINGS


class _Cats:
    """Counts the aten cat calls made inside it (a TorchDispatchMode)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                outer.n += func.overloadpacket.__name__ == "cat"
                return func(*args, **(kwargs or {}))

        self.n, self.mode = 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


# --------------------------------------------------------------------------------------------------------
# x, B, C split from one tensor (Mamba-2's conv output): the SSD backward writes their gradients as the blocks
# of one buffer and split_last's backward returns it without a copy

def _xbc_case(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    bsz, seqlen, nh, hd, ng, ds = 2, 37, 4, 16, 2, 16
    xbc = torch.randn(bsz, seqlen, nh * hd + 2 * ng * ds, generator=g).to(DEV, dtype)
    dt = (torch.rand(bsz, seqlen, nh, generator=g) * 0.5).to(DEV, dtype)
    A = -torch.rand(nh, generator=g).to(DEV) - 0.5
    dout = torch.randn(bsz, seqlen, nh, hd, generator=g).to(DEV, dtype)
    seq = torch.zeros(bsz, seqlen, dtype=torch.int32, device=DEV)
    seq[0, 20:] = 1
    return (bsz, seqlen, nh, hd, ng, ds), xbc, dt, A, dout, seq


def _xbc_grads(split, xbc, dt, A, dout, seq, dims, c_read_twice=False):
    bsz, seqlen, nh, hd, ng, ds = dims
    leaf = xbc.clone().requires_grad_(True)
    x, B, C = split(leaf, [nh * hd, ng * ds, ng * ds])
    y = K.ssd(x.reshape(bsz, seqlen, nh, hd), dt, A, B.reshape(bsz, seqlen, ng, ds), C.reshape(bsz, seqlen, ng, ds),
              seq_idx=seq, chunk_size=16)
    if c_read_twice:  # C read by a second op too (CP's state read-out): its gradient is a sum, not the SSD's block
        y = y + C.float().sum(-1)[..., None, None].to(y.dtype)
    y.backward(dout)
    return leaf.grad


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_xbc_split_backward_writes_one_buffer(triton_mode, dtype):
    dims, xbc, dt, A, dout, seq = _xbc_case(dtype=dtype)
    want = _xbc_grads(lambda t, s: torch.split(t, s, dim=-1), xbc, dt, A, dout, seq, dims)
    with _Cats() as cats:
        got = _xbc_grads(K.split_last, xbc, dt, A, dout, seq, dims)
    assert torch.equal(got, want)
    assert cats.n == 0  # the blocks' gradients were one buffer: no concatenation
    # the reference backend writes separate gradients: split_last concatenates them like torch.split
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGASSM_KERNELS", "torch")
        ref_split = _xbc_grads(K.split_last, xbc, dt, A, dout, seq, dims)
        ref_torch = _xbc_grads(lambda t, s: torch.split(t, s, dim=-1), xbc, dt, A, dout, seq, dims)
    assert torch.equal(ref_split, ref_torch)


@needs_triton
def test_ssd_xbc_split_fills_the_block_of_a_piece_read_twice(triton_mode):
    """C read by the SSD and by a second op (CP's read-out): autograd sums C's two gradients into a new tensor,
    which split_last's backward copies into C's block of the SSD's buffer instead of concatenating all three."""
    dims, xbc, dt, A, dout, seq = _xbc_case()
    want = _xbc_grads(lambda t, s: torch.split(t, s, dim=-1), xbc, dt, A, dout, seq, dims, c_read_twice=True)
    with _Cats() as cats:
        got = _xbc_grads(K.split_last, xbc, dt, A, dout, seq, dims, c_read_twice=True)
    assert cats.n == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_in_proj_split_backward_writes_one_buffer(triton_mode, monkeypatch, dtype):
    """Mamba-2's [z | xBC | dt] split from in_proj (split_last(share_grads=True)): the gated norm's dz, the conv's
    dxBC and the SSD's ddt are written as the column blocks of one buffer, so the split's backward is one cat
    fewer per layer, with the same gradients bit for bit as separate buffers and a cat (GradBlocks disabled).
    bf16: in_proj under autocast, as the trainer runs it."""
    from megassm.config import MambaConfig, ModelConfig
    from megassm.models import build_model

    cfg = ModelConfig(pattern="MM", d_model=32, mamba=MambaConfig(d_state=16, headdim=16, chunk_size=16, ngroups=2))
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0)).to(DEV)
    sid = torch.zeros(2, 24, dtype=torch.int32, device=DEV)
    sid[1, 9:] = 1

    def grads():
        m = build_model(cfg, vocab_size=97)
        m.init_weights(0)
        m = m.to(DEV).train()
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = m(ids, seq_idx=sid).logits.float().pow(2).mean()
        with _Cats() as cats:
            loss.backward()
        return {n: p.grad for n, p in m.named_parameters()}, cats.n

    shared, n_shared = grads()
    monkeypatch.setattr(gb.GradBlocks, "take", lambda self, off, n, piece: None)
    separate, n_separate = grads()
    assert n_separate - n_shared == 2  # one cat fewer per Mamba-2 layer
    assert shared.keys() == separate.keys()
    for k in shared:
        assert shared[k] is not None and torch.equal(shared[k], separate[k]), k


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_padded_in_proj_reads_its_gradient_buffer_whole(triton_mode, monkeypatch, dtype):
    """in_proj as an AlignedLinear (its width, 196 features, padded to 200 rows in memory as a TP rank's is): the
    model's loss and gradients equal the plain Linear's, and the in_proj backward multiplies the GradBlocks
    buffer's whole padded rows (its padding zeroed), not a copy. bf16: in_proj under autocast."""
    from megassm.config import MambaConfig, ModelConfig
    from megassm.models import build_model
    from megassm.parallel import layers
    from megassm.parallel.substitute import substitute

    cfg = ModelConfig(pattern="MM", d_model=32, mamba=MambaConfig(d_state=16, headdim=16, chunk_size=16, ngroups=2))
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0)).to(DEV)
    sid = torch.zeros(2, 24, dtype=torch.int32, device=DEV)
    sid[1, 9:] = 1
    in_place = []
    real = layers._padded_grad

    def watched(g2, pad):
        out = real(g2, pad)
        in_place.append(out.data_ptr() == g2.data_ptr())
        return out

    monkeypatch.setattr(layers, "_padded_grad", watched)

    def run(padded):
        m = build_model(cfg, vocab_size=97)
        m.init_weights(0)
        if padded:
            for layer in m.layers.values():
                assert layer.mixer.in_proj.out_features == 196
                substitute(layer.mixer, "in_proj", layers.AlignedLinear, out_pad=layers.out_pad(196))
        m = m.to(DEV).train()
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = m(ids, seq_idx=sid).logits.float().pow(2).mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    loss0, plain = run(False)
    loss1, padded = run(True)
    assert in_place == [True, True]  # both layers' in_proj backward: the buffer itself
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(loss0, loss1, rtol=tol, atol=0)
    assert plain.keys() == padded.keys()
    for k in plain:
        a, b = plain[k].float(), padded[k].float()
        assert (a - b).norm() <= tol * a.norm() + 1e-12, k


@needs_triton
def test_in_proj_split_writes_one_buffer_under_activation_checkpointing(triton_mode):
    """Under activation checkpointing the backward reads recomputed pieces (detached views, without the tag):
    the ops find their blocks by the pieces' memory, so the split needs no cat there either, and the gradients
    equal the run without checkpointing."""
    from megassm.config import MambaConfig, ModelConfig
    from megassm.models import build_model
    from megassm.parallel.checkpointing import apply_activation_checkpointing

    cfg = ModelConfig(pattern="MM", d_model=32, mamba=MambaConfig(d_state=16, headdim=16, chunk_size=16, ngroups=2))
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0)).to(DEV)

    def grads(ckpt):
        m = build_model(cfg, vocab_size=97)
        m.init_weights(0)
        m = m.to(DEV).train()
        if ckpt:
            apply_activation_checkpointing(m)
        loss = m(ids).logits.float().pow(2).mean()
        with _Cats() as cats:
            loss.backward()
        return {n: p.grad for n, p in m.named_parameters()}, cats.n

    gb._BY_STORAGE.clear()  # forwards of earlier tests that never ran a backward
    plain, n_plain = grads(False)
    ckpt, n_ckpt = grads(True)
    assert n_plain == n_ckpt == 0
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], rtol=1e-6, atol=1e-7, msg=k)
    assert not gb._BY_STORAGE  # every split's backward released its blocks (and the recomputation's)


def test_grad_blocks_found_by_memory():
    """A detached view of a piece (what checkpointing hands the backward) finds the piece's block by where it
    lies; a view elsewhere in that memory, or of another shape, finds none."""
    gb._BY_STORAGE.clear()
    x = torch.randn(3, 4, 10, requires_grad=True)
    a, b, c = K.split_last(x, [2, 5, 3], share_grads=True)
    got = gb.grad_block(b.detach())
    assert got is not None and got.shape == b.shape and got.stride() == (40, 10, 1)
    assert gb.grad_block(b.detach()) is None  # handed out once
    assert gb.grad_block(x.detach()[..., 1:3]) is None  # not at a block's first column
    assert gb.grad_block(x.detach()[..., 7:10].contiguous()) is None  # other memory
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # torch.compile's tracing: no memory to look up, no warning about fake data pointers
        assert gb.grad_block(torch.empty(3, 4, 5)) is None
    a.sum().backward()
    assert not gb._BY_STORAGE


def test_grad_blocks_hand_out_each_block_once():
    """GradBlocks: a block goes to the first op that asks in a backward pass (a second reader of the same piece
    gets None: a fresh gradient that autograd sums), a mismatched piece gets None, split_last's backward resets
    the hand-outs, and gradients through the pieces equal torch.split's whatever was written."""
    x = torch.randn(3, 4, 10, requires_grad=True)
    a, b, c = K.split_last(x, [2, 5, 3], share_grads=True)
    blocks = a._megassm_grad_block[0]
    got = gb.grad_block(a)
    assert got is not None and got.shape == a.shape and got._base is blocks.buf
    assert gb.grad_block(a) is None  # handed out once
    assert blocks.take(2, 5, b.float().double()) is None  # dtype differs from the split tensor's
    assert blocks.take(2, 5, b[..., :4]) is None  # not the block's shape
    ((a * 2).sum() + (c * 3).sum()).backward()  # plain autograd (no op writes a block): the cat fallback
    want = torch.cat([torch.full((3, 4, 2), 2.0), torch.zeros(3, 4, 5), torch.full((3, 4, 3), 3.0)], -1)
    assert torch.equal(x.grad, want)
    assert blocks.buf is None and not blocks.handed  # reset by split_last's backward
    with torch.no_grad():
        assert not hasattr(K.split_last(x, [2, 5, 3], share_grads=True)[0], "_megassm_grad_block")


class _WritesItsBlock(torch.autograd.Function):
    """y = 1 * piece, whose backward writes its gradient into the piece's GradBlocks block, as the Triton
    backwards of the gated norm, the conv and the SSD do."""

    @staticmethod
    def forward(ctx, piece):
        ctx.piece = piece
        return piece * 1

    @staticmethod
    def backward(ctx, g):
        block = gb.grad_block(ctx.piece)
        return g if block is None else block.copy_(g)


def test_grad_blocks_of_padded_rows_keep_the_row_stride():
    """A split tensor that is the first columns of wider rows (an AlignedLinear output) gets its gradient as the
    same columns of a buffer with those rows: written by the ops, returned by split_last without a cat, so the
    matmul's backward reads the aligned row stride."""
    full = torch.randn(3, 4, 16, requires_grad=True)
    x = full[..., :10]
    seen = []
    x.register_hook(lambda g: seen.append(g.stride()))
    pieces = K.split_last(x, [2, 5, 3], share_grads=True)
    outs = [_WritesItsBlock.apply(p) for p in pieces]
    with _Cats() as cats:
        sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
    assert cats.n == 0 and seen == [(64, 16, 1)]
    want = torch.cat([torch.full((3, 4, 2), 1.0), torch.full((3, 4, 5), 2.0), torch.full((3, 4, 3), 3.0),
                      torch.zeros(3, 4, 6)], -1)
    assert torch.equal(full.grad, want)


def test_a_piece_read_twice_is_copied_into_its_block_not_catted():
    """A piece whose block one op writes while a second op reads it too (CP's halo and decay reads): autograd sums
    the two into a new tensor, which split_last's backward copies into the piece's block (a missing piece's block
    is zeroed), returning the buffer with no cat; the gradients are torch.split's."""
    x = torch.randn(3, 4, 10, requires_grad=True)
    a, b, c = K.split_last(x, [2, 5, 3], share_grads=True)
    outs = [_WritesItsBlock.apply(a), _WritesItsBlock.apply(b)]
    with _Cats() as cats:
        ((outs[0] * 2).sum() + (outs[1] * 3).sum() + (b[..., :2] * 5).sum()).backward()  # c unused
    assert cats.n == 0
    want_b = torch.full((3, 4, 5), 3.0)
    want_b[..., :2] += 5
    assert torch.equal(x.grad, torch.cat([torch.full((3, 4, 2), 2.0), want_b, torch.zeros(3, 4, 3)], -1))


def test_split_last_backward_fills_a_missing_gradient():
    x = torch.randn(3, 10, requires_grad=True)
    a, b, c = K.split_last(x, [2, 5, 3])
    (a.sum() * 2 + c.sum()).backward()  # b unused: its gradient block is zero
    assert torch.equal(x.grad, torch.cat([torch.full((3, 2), 2.0), torch.zeros(3, 5), torch.ones(3, 3)], -1))


@needs_triton
def test_out_blocks_must_match_the_result():
    """A caller-given output block (conv out_dx, SSD out_ddt, norm out_dz) is refused, naming it, unless it has the
    result's shape, dtype and device and a unit last stride; its row strides are free."""
    from megassm.kernels.common.out import out_or_empty

    like = torch.empty(2, 3, 4)
    wide = torch.empty(2, 3, 8)
    assert out_or_empty(wide[..., :4], like, "x").stride() == (24, 8, 1)
    assert out_or_empty(None, like, "x").is_contiguous()
    for bad in (torch.empty(2, 3, 5), torch.empty(2, 3, 4, dtype=torch.float64), wide[..., ::2]):
        with pytest.raises(ValueError, match="conv out_dx"):
            out_or_empty(bad, like, "conv out_dx")

"""The Triton SSD (kernels/mamba2_ssd/triton_ssd*.py) against the PyTorch references, outputs and every gradient: the
sequential token-by-token oracle in fp32, the chunked reference's own bf16 error in bf16 (criteria in
kernel_cases.py). Default run (CI, CPU): tiny shapes in Triton's CPU interpreter, with resets, odd lengths,
tile variants, segmented chunk walks and saved states; on a machine with CUDA the same tiny tests run on the
GPU. `pytest -m gpu tests/test_kernels_ssd.py` runs the full precision grid on the device.
"""
import importlib

import pytest
import torch

# kernel_cases sets TRITON_INTERPRET before the Triton kernels are first imported
from kernel_cases import (
    DEV, F64, HAS_TRITON, INTERP, K, TRITON_WARNINGS, cast_inputs, check_fp32, check_lowp, gpu, needs_cuda,
    needs_triton, op_ssd, rel, reset_starts, run_ssd, seq_from_starts, ssd_inputs,
)
from kernel_cases import triton_mode  # noqa: F401  (fixtures)
from megassm.kernels.mamba2_ssd import op as ssd_ops
from megassm.kernels.mamba2_ssd import reference as ssd_ref

pytestmark = TRITON_WARNINGS


# --------------------------------------------------------------------------------------------------------
# Triton kernels at tiny shapes (interpreter on CPU, native on a GPU)

SSD_TINY = {
    # name: (bsz, seqlen, nheads, hdim, ngroups, dstate, chunk, ssd_inputs kwargs, resets, dt_limit)
    "all": (2, 37, 4, 16, 2, 16, 16, dict(d_mode="chan"), True, (0.0, 3.0)),
    "one_token": (2, 1, 2, 16, 1, 16, 16, dict(d_mode="head"), False, None),
    "bare_exact_chunk": (1, 32, 2, 16, 1, 16, 16, dict(d_mode=None, gate=False, bias=False, init=False),
                         False, None),
    "resets_nogate": (2, 40, 4, 16, 1, 32, 16, dict(d_mode="head", gate=False, init=False), True, None),
    "odd_dims": (1, 20, 2, 24, 1, 48, 16, dict(d_mode="chan"), True, None),  # P, N not powers of two
}


@needs_triton
@pytest.mark.parametrize("case", list(SSD_TINY))
def test_ssd_triton_fp32_vs_sequential_oracle(triton_mode, case):
    bsz, seqlen, nh, hd, ng, ds, chunk, mk, resets, lim = SSD_TINY[case]
    inp = ssd_inputs(bsz, seqlen, nh, hd, ng, ds, **mk)
    sid = seq_from_starts(reset_starts(seqlen, chunk, bsz), seqlen) if resets else None
    ours = run_ssd(K.ssd, inp, sid, chunk_size=chunk, dt_limit=lim)
    oracle = run_ssd(ssd_ref.ssd_sequential, cast_inputs(inp, to=F64), sid, dt_limit=lim)
    check_fp32(ours, oracle, 1e-5)


@needs_triton
@pytest.mark.parametrize("tiles", [
    # blocks smaller than the chunk everywhere; _dbc's blocks larger than _dcb's; two N blocks in _dbc and in
    # the chunk walks
    dict(cb_bt=16, states_bs=16, states_bn=16, scan_bt=32, scan_bs=16, scan_bk=16, dstates_bt=16, dstates_bn=16,
         dx_bs=16, dx_bk=16, dcb_bs=16, dbc_bs=32, dbc_bn=16),
    # source blocks larger than target blocks in _scan; _dbc's blocks smaller than _dcb's; blocks larger than
    # _cb_kernel's (CB's upper blocks are never written)
    dict(cb_bt=16, scan_bt=16, scan_bs=32, dx_bs=32, dcb_bs=32, dbc_bs=16),
    # chunk 64: several target blocks in _scan, each with whole source blocks before it (the factored decay),
    # source blocks smaller than target blocks; the same for _dx and _dcb
    dict(chunk=64, cb_bt=16, scan_bt=32, scan_bs=16, dx_bs=16, dcb_bs=16, dbc_bs=32),
    # the same without resets (the factored tiles' unmasked path)
    dict(chunk=64, resets=False, cb_bt=16, scan_bt=32, scan_bs=16, dx_bs=16, dcb_bs=16, dbc_bs=32),
], ids=["small", "mixed", "chunk64", "chunk64-no-resets"])
def test_ssd_triton_tile_variants(triton_mode, monkeypatch, tiles):
    from megassm.kernels.mamba2_ssd import triton_ssd_common as tssd

    tiles = dict(tiles)
    chunk = tiles.pop("chunk", 32)
    resets = tiles.pop("resets", True)
    monkeypatch.setattr(tssd, "TILES", {**tssd.TILES, **tiles})
    inp = ssd_inputs(2, 45 if chunk == 32 else 150, 2, 16, 1, 32, d_mode="chan")
    L = inp["x"].shape[1]
    sid = seq_from_starts(reset_starts(L, chunk, 2), L) if resets else None
    ours = run_ssd(K.ssd, inp, sid, chunk_size=chunk)
    oracle = run_ssd(ssd_ref.ssd_sequential, cast_inputs(inp, to=F64), sid)
    check_fp32(ours, oracle, 5e-5)  # dA, a sum over every position with cancellation, reaches ~2e-5 at 150 tokens


@needs_triton
@pytest.mark.parametrize("dtype,segments,gate", [("fp32", "3", True), ("fp32", "3", False), ("bf16", "2", True),
                                                 ("bf16", "2", False)])
def test_ssd_triton_state_segments(triton_mode, monkeypatch, dtype, segments, gate):
    """The chunk walks split into segments (MEGASSM_SSD_STATE_SEGMENTS) and completed by the fix-up passes
    give what one walk gives: against the token-by-token oracle (fp32) or within the bf16 budget, with an
    initial state and a final-state gradient, with and without the gate (the model's call). The backward's
    recompute starts every segment from the true segment end the forward kept (no fix-up pass)."""
    tbwd = importlib.import_module("megassm.kernels.mamba2_ssd.triton_ssd_bwd")
    starts = []
    real = tbwd._states
    monkeypatch.setattr(tbwd, "_states", lambda *a, **k: starts.append(k["seg_starts"] is not None) or real(*a, **k))
    monkeypatch.setenv("MEGASSM_SSD_STATE_SEGMENTS", segments)
    chunk, L = 16, 100  # 7 chunks: segments of 3 + 3 + 1 chunks, or 4 + 3
    # slow decay: states live for chunks
    inp = ssd_inputs(2, L, 2, 16, 1, 32, d_mode="chan", a_scale=0.01, gate=gate)
    # row 0: resets inside a segment, on a chunk edge, on the segment edge 48; row 1: one reset in the last
    # chunk, so states and their gradients cross every segment edge
    sid = seq_from_starts([[16, 48, 53, 99], [97]], L)
    if dtype == "fp32":
        ours = run_ssd(K.ssd, inp, sid, chunk_size=chunk)
        oracle = run_ssd(ssd_ref.ssd_sequential, cast_inputs(inp, to=F64), sid)
        check_fp32(ours, oracle, 5e-5)
    else:
        low = cast_inputs(inp, lowp=torch.bfloat16)
        ours = run_ssd(K.ssd, low, sid, chunk_size=chunk)
        ref = run_ssd(ssd_ref.ssd, low, sid, chunk_size=chunk)
        oracle = run_ssd(ssd_ref.ssd, cast_inputs(low, to=F64), sid, chunk_size=chunk)
        check_lowp(ours, ref, oracle, 3.0 if INTERP else 2.0)
    assert starts == [True]


@needs_triton
@pytest.mark.parametrize("gate", [True, False])
def test_ssd_triton_segments_changed_between_forward_and_backward(triton_mode, monkeypatch, gate):
    """The forward's segment ends fit only the same segmentation: when MEGASSM_SSD_STATE_SEGMENTS changes between
    forward and backward, the backward's walks ignore them and fix up their own segments (still exact), with
    and without the gate (without it the backward starts from dout and never recomputes the output)."""
    tbwd = importlib.import_module("megassm.kernels.mamba2_ssd.triton_ssd_bwd")
    real = tbwd._states

    def switch_then_walk(*a, **k):
        monkeypatch.setenv("MEGASSM_SSD_STATE_SEGMENTS", "3")
        return real(*a, **k)

    monkeypatch.setattr(tbwd, "_states", switch_then_walk)
    monkeypatch.setenv("MEGASSM_SSD_STATE_SEGMENTS", "2")
    inp = ssd_inputs(1, 100, 2, 16, 1, 32, d_mode="head", a_scale=0.01, gate=gate)
    sid = seq_from_starts([[48, 53]], 100)
    ours = run_ssd(K.ssd, inp, sid, chunk_size=16)
    oracle = run_ssd(ssd_ref.ssd_sequential, cast_inputs(inp, to=F64), sid)
    check_fp32(ours, oracle, 5e-5)


def _check_kept_matches_recompute(got, want, segments):
    """One walk: the kept states are the recomputed ones, bit for bit. In segments the kept states are the
    forward's completed by the fix-up pass, while the recompute starts each segment from the forward's true
    segment end: the same states up to their fp32 rounding, so the results agree far inside the bf16 budget."""
    if segments == "1":
        assert all(torch.equal(got[k], want[k]) for k in want)
    else:
        diffs = {k: rel(got[k], want[k]) for k in want}
        assert max(diffs.values()) < 1e-3, diffs


@needs_triton
@pytest.mark.parametrize("dtype,segments,path", [("fp32", "1", "eager"), ("bf16", "2", "op"),
                                                 ("bf16-mode", "1", "eager")])
def test_ssd_triton_saved_states(triton_mode, monkeypatch, dtype, segments, path):
    """MEGASSM_SSD_SAVE_STATES=1: the backward reads the states the forward kept instead of recomputing them
    (the recompute is made to fail) and gives the recomputing backward's results (_check_kept_matches_recompute).
    fp32 through kernels.ssd (eager) with the final states returned (the backward reads them from that output); bf16 in
    segments through the custom op without them (the backward needs none); bf16 in MEGASSM_SSD_PRECISION=bf16
    with the final states returned (the forward walk's split products, which the recompute must take too). The
    fake implementation promises the kept buffer's real shape."""
    tbwd = importlib.import_module("megassm.kernels.mamba2_ssd.triton_ssd_bwd")  # the module (the package exports the function)
    monkeypatch.setenv("MEGASSM_SSD_STATE_SEGMENTS", segments)
    monkeypatch.setenv("MEGASSM_SSD_PRECISION", "bf16" if dtype == "bf16-mode" else "split")
    inp = ssd_inputs(2, 40, 2, 16, 1, 16, d_mode="head")
    if dtype != "fp32":
        inp = cast_inputs(inp, lowp=torch.bfloat16)
    sid = seq_from_starts([[16, 21], [3]], 40)
    if path == "eager":
        fn = K.ssd
    else:  # y alone (a zero-weighted stand-in for the final states keeps run_ssd's signature)
        fn = (lambda **kw: (lambda y: (y, y.float().sum() * 0))(op_ssd(**{**kw, "return_final_states": False})))
    monkeypatch.setenv("MEGASSM_SSD_SAVE_STATES", "0")
    want = run_ssd(fn, inp, sid, chunk_size=16)
    monkeypatch.setenv("MEGASSM_SSD_SAVE_STATES", "1")

    def no_recompute(*a, **k):
        raise AssertionError("the backward recomputed the states it was given")

    monkeypatch.setattr(tbwd, "_states", no_recompute)
    got = run_ssd(fn, inp, sid, chunk_size=16)
    _check_kept_matches_recompute(got, want, segments)
    if path == "op":
        args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["dt_bias"], True,
                None, inp["initial_states"], sid, 16)
        for ret in (True, False):
            real = ssd_ops.ssd_op(*args, ret)
            with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
                fake = ssd_ops.ssd_op._abstract_fn(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                 for a in args), ret)
            assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
            assert real[2].numel() > 0  # the kept buffer
    monkeypatch.setenv("MEGASSM_SSD_SAVE_STATES", "yes")
    with pytest.raises(ValueError, match="MEGASSM_SSD_SAVE_STATES='yes'"):
        K.ssd(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])


@needs_triton
def test_ssd_state_segments_setting(monkeypatch):
    from megassm.kernels.mamba2_ssd.triton_ssd_states import _auto_segments, _state_segments

    x = torch.zeros(1, device=DEV)
    for text, nc, want in (("1", 10, (1, 10)), ("4", 10, (4, 3)), ("3", 7, (3, 3)), ("16", 3, (3, 1))):
        monkeypatch.setenv("MEGASSM_SSD_STATE_SEGMENTS", text)
        assert _state_segments(x, 1, 8, 64, 128, nc) == want, text
    # the backward trusts the forward's segment ends when their count matches: a count must fix the length
    for nc in range(1, 300):
        lengths = {}
        for k in range(1, nc + 1):
            monkeypatch.setenv("MEGASSM_SSD_STATE_SEGMENTS", str(k))
            nseg, cps = _state_segments(x, 1, 8, 64, 128, nc)
            assert lengths.setdefault(nseg, cps) == cps, (nc, k)
    monkeypatch.setenv("MEGASSM_SSD_STATE_SEGMENTS", "auto")
    assert _state_segments(x, 1, 64, 64, 128, 128) == (1, 128)  # auto is one walk off the GPU
    monkeypatch.delenv("MEGASSM_SSD_STATE_SEGMENTS")
    assert _state_segments(x, 1, 64, 64, 128, 128) == (1, 128)  # the default is auto
    # auto on an H100/H200 (132 SMs), anchors shape H 64, P 64, N 128: 64 walks (64 x 128 blocks) per row
    assert _auto_segments(64, 128, 132) == 4  # 1 x 32K: 256 programs
    assert _auto_segments(2 * 64, 64, 132) == 2  # 2 x 16K
    assert _auto_segments(4 * 64, 32, 132) == 1  # 4 x 8K: 256 programs already
    assert _auto_segments(64, 8, 132) == 4  # micro-batch 1 x 2K: 8 chunks, segments of 2
    assert _auto_segments(1, 6, 132) == 2  # never more than nc / 2 segments
    assert _auto_segments(1, 4096, 132) == 16  # nor more than 16
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv("MEGASSM_SSD_STATE_SEGMENTS", bad)
        with pytest.raises(ValueError, match=f"MEGASSM_SSD_STATE_SEGMENTS={bad!r}"):
            _state_segments(x, 1, 8, 64, 128, 10)


@needs_triton
@pytest.mark.parametrize("ngroups,split", [(1, "2"), (1, "4"), (2, "8"), (1, "1")])
def test_ssd_triton_dbc_split(triton_mode, monkeypatch, ngroups, split):
    """MEGASSM_SSD_DBC_SPLIT: dB / dC from programs sharing the head loop (fp32 partials summed by torch) equal
    the unsplit kernel's up to fp32 summation order, every other output and gradient bit for bit; against the
    fp64 oracle as the unsplit run. 8 at 2 heads a group is capped at 2; resets, odd length, initial states."""
    inp = ssd_inputs(2, 45, 4, 16, ngroups, 32, d_mode="chan")
    sid = seq_from_starts(reset_starts(45, 32, 2), 45)
    monkeypatch.setenv("MEGASSM_SSD_DBC_SPLIT", "1")
    base = run_ssd(K.ssd, inp, sid, chunk_size=32)
    monkeypatch.setenv("MEGASSM_SSD_DBC_SPLIT", split)
    ours = run_ssd(K.ssd, inp, sid, chunk_size=32)
    for name, v in ours.items():
        if name in ("dB", "dC"):
            assert rel(v, base[name]) < 1e-6, name
        else:
            assert torch.equal(v, base[name]), name
    check_fp32(ours, run_ssd(ssd_ref.ssd_sequential, cast_inputs(inp, to=F64), sid), 1e-5)
    monkeypatch.setenv("MEGASSM_SSD_DBC_SPLIT", "3")
    with pytest.raises(ValueError, match="MEGASSM_SSD_DBC_SPLIT='3'"):
        run_ssd(K.ssd, inp, sid, chunk_size=32)


@needs_triton
def test_ssd_side_stream_setting(monkeypatch):
    """MEGASSM_SSD_STREAMS: 1 (default) gives CUDA inputs a side stream, 0 none; never on the CPU; a bad value
    fails naming the variable."""
    from megassm.kernels import env
    from megassm.kernels.mamba2_ssd.triton_ssd_common import _Side

    monkeypatch.delenv("MEGASSM_SSD_STREAMS", raising=False)
    assert env.ssd_streams() is True
    monkeypatch.setenv("MEGASSM_SSD_STREAMS", "0")
    assert env.ssd_streams() is False
    monkeypatch.setenv("MEGASSM_SSD_STREAMS", "1")
    side = _Side(torch.zeros(1))
    assert side.stream is None
    ran = []
    assert side.run(lambda: ran.append(1)) is None and ran == [1]  # in place, at once
    side.wait(None)
    monkeypatch.setenv("MEGASSM_SSD_STREAMS", "on")
    with pytest.raises(ValueError, match="MEGASSM_SSD_STREAMS='on'"):
        env.check()


@needs_triton
def test_ssd_tuner_logs_each_decision(monkeypatch, capsys):
    """MEGASSM_TRITON_TUNE_LOG=1: the tuner prints one JSON line per decision (each config's time, the pick) and
    launches the pick; a known key is launched without a new decision. A bad value fails naming the variable."""
    import json

    import triton
    from megassm.kernels import env
    from megassm.kernels.mamba2_ssd.triton_ssd_common import _Tuned

    def _probe_kernel():
        """Stands in for the Python function behind a Triton kernel (only its name is read)."""

    launched = []

    class Kernel:  # the JITFunction surface _Tuned uses
        fn = _probe_kernel
        arg_names = ["X", "T"]

        def __getitem__(self, grid):
            return lambda *a, **k: launched.append(k)

    tuned = _Tuned(Kernel(), [triton.Config({}, num_warps=4, num_stages=2, maxnreg=168),
                              triton.Config({}, num_warps=8, num_stages=2)], key=["T"])
    times = iter([2.0, 1.5])
    monkeypatch.setattr(tuned, "_time", lambda *a: next(times))
    monkeypatch.setenv("MEGASSM_TRITON_TUNE_LOG", "1")
    tuned[(1,)](torch.zeros(1), 64, PREC="bf16")
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line == {"tune": "_probe_kernel", "key": ["64", "torch.float32", "('PREC', 'bf16')"],
                    "ms": {"w4s2r168": 2.0, "w8s2": 1.5}, "pick": "w8s2"}
    assert launched[-1]["num_warps"] == 8 and "maxnreg" not in launched[-1]
    tuned[(1,)](torch.zeros(1), 64, PREC="bf16")
    assert capsys.readouterr().err == "" and launched[-1]["num_warps"] == 8
    monkeypatch.setenv("MEGASSM_TRITON_TUNE_LOG", "yes")
    with pytest.raises(ValueError, match="MEGASSM_TRITON_TUNE_LOG='yes'"):
        env.check()


@needs_triton
def test_ssd_tiles_env_override(monkeypatch):
    """MEGASSM_SSD_TILES (kernels.ssd_tiles) as kernels/mamba2_ssd/triton_ssd_common.py applies it to its TILES at import."""
    from megassm.kernels import env

    table = {"dx_bs": 32, "dbc_bs": 128}
    monkeypatch.setenv("MEGASSM_SSD_TILES", " dx_bs=64 , dbc_bs=16,")
    table.update(env.ssd_tiles())
    assert table == {"dx_bs": 64, "dbc_bs": 16}
    for bad, msg in (("dx_bz=64", "NAME one of"), ("dx_bs", "NAME one of"), ("dx_bs=48", "dx_bs='48'"),
                     ("dbc_bs=8", "power of two >= 16"), ("dx_bs=x", "dx_bs='x'")):
        monkeypatch.setenv("MEGASSM_SSD_TILES", bad)
        with pytest.raises(ValueError, match=msg):
            env.ssd_tiles()


@needs_triton
def test_ssd_triton_bf16_within_reference_error(triton_mode):
    bsz, seqlen, chunk = 2, 40, 16
    inp = ssd_inputs(bsz, seqlen, 4, 16, 2, 16, d_mode="head")
    low = cast_inputs(inp, lowp=torch.bfloat16)
    sid = seq_from_starts(reset_starts(seqlen, chunk, bsz), seqlen)
    ours = run_ssd(K.ssd, low, sid, chunk_size=chunk)
    ref = run_ssd(ssd_ref.ssd, low, sid, chunk_size=chunk)
    oracle = run_ssd(ssd_ref.ssd, cast_inputs(low, to=F64), sid, chunk_size=chunk)
    assert ours["y"].dtype == torch.bfloat16 and ours["final"].dtype == torch.float32
    check_lowp(ours, ref, oracle, 3.0 if INTERP else 2.0)


def _check_a_gradient_own_error(inp, sid, chunk, factor):
    """dA and ddt_bias sum intra-chunk cs-gradient terms that cancel, weighted by dt sums of up to a chunk
    (docs/kernels.md, "the a gradient"), so a product error far below the bf16 outputs' shows there. With the
    oracle given the same bf16-rounded output gradient (the rounding otherwise dominates the reference's error),
    the bf16 inputs' own dA / ddt_bias error stays within `factor` x that of fp32 inputs (fp32 products)."""
    low = cast_inputs(inp, lowp=torch.bfloat16)
    f32 = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in low.items()}
    oracle = run_ssd(ssd_ref.ssd, cast_inputs(low, to=F64), sid, chunk_size=chunk, grad_via=torch.bfloat16)
    ours = run_ssd(K.ssd, low, sid, chunk_size=chunk)
    ours32 = run_ssd(K.ssd, f32, sid, chunk_size=chunk, grad_via=torch.bfloat16)
    errs = {k: (rel(ours[k], oracle[k]), rel(ours32[k], oracle[k])) for k in ("dA", "ddt_bias")}
    assert all(e <= factor * e32 + 1e-7 for e, e32 in errs.values()), f"(bf16, fp32) own errors: {errs}"


@needs_triton
@pytest.mark.parametrize("gate", [False, True], ids=["nogate", "gate"])
def test_ssd_triton_bf16_a_gradient(triton_mode, monkeypatch, gate):
    """The tests' scales (dt ~0.1 .. 3, A to -2.1: exponents of hundreds across a chunk), two 64-position tiles
    per chunk (_dx's off-diagonal tile too), resets. With the three-way split: 1.0-1.9x fp32's error; with _dx's diagonal-tile
    products split two ways instead of three, 12-39x (the GPU draws: 12-43x)."""
    monkeypatch.setenv("MEGASSM_SSD_PRECISION", "split")  # the split mode's property (the bf16 mode's is ~20x)
    chunk, L = 128, 256
    inp = ssd_inputs(1, L, 4, 16, 1, 16, d_mode="head", gate=gate)
    _check_a_gradient_own_error(inp, seq_from_starts(reset_starts(L, chunk, 1), L), chunk, 4.0)


@needs_triton
def test_ssd_triton_deterministic_and_finite_at_extremes(triton_mode):
    # dt up to ~10 after softplus, A down to -100: decays underflow to exactly 0, nothing may blow up
    inp = ssd_inputs(1, 48, 2, 16, 1, 16, dt_scale=6.0, a_scale=50.0)
    inp["dt_bias"] = torch.full_like(inp["dt_bias"], 4.0)
    a = run_ssd(K.ssd, inp, None, chunk_size=16)
    b = run_ssd(K.ssd, inp, None, chunk_size=16)
    for k in a:
        assert torch.isfinite(a[k]).all(), k
        assert torch.equal(a[k], b[k]), k
    # Loose on purpose: with |cs| in the thousands the kernels' exp(cs_t - cs_s) loses ~|cs| * 6e-8 in the
    # exponent (prefix sums are differenced; the reference's segsum sums each segment exactly).
    oracle = run_ssd(ssd_ref.ssd_sequential, cast_inputs(inp, to=F64), None)
    check_fp32(a, oracle, 3e-2)


@needs_triton
def test_ssd_unsupported_chunk_falls_back(triton_mode):
    inp = ssd_inputs(1, 10, 2, 4, 1, 4)
    y = K.ssd(**inp, chunk_size=6)  # not a power of two: the reference runs
    torch.testing.assert_close(y, ssd_ref.ssd(**inp, chunk_size=6))


if HAS_TRITON:  # a module-level kernel: triton.jit resolves names in the module's globals
    import triton
    import triton.language as tl

    from megassm.kernels.mamba2_ssd.triton_ssd_common import _bf16

    @triton.jit
    def _round_kernel(X, Y, n: tl.constexpr):
        i = tl.arange(0, n)
        tl.store(Y + i, _bf16(tl.load(X + i)))


@needs_triton
def test_bf16_rounding_matches_torch(triton_mode):
    """The kernels' fp32 -> bf16 operand rounding (_bf16) is torch's: nearest, ties to even, on a GPU and in the
    interpreter (whose own cast truncates: the CPU tests of rounded-once products would measure that)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.exp(3 * torch.randn(4096, generator=g))
    # exact ties (to even, down and up), a carry into the exponent, negatives, a tiny value
    x[:6] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 - 2 ** -9, -3.9999999, 1e-30])
    x = x.to(DEV)
    y = torch.empty(4096, dtype=torch.bfloat16, device=DEV)
    _round_kernel[(1,)](x, y, 4096)
    assert torch.equal(y, x.to(torch.bfloat16))


@needs_triton
def test_ssd_fast_precision_mode(triton_mode, monkeypatch):
    monkeypatch.setenv("MEGASSM_SSD_PRECISION", "bf16")
    inp = ssd_inputs(1, 20, 2, 16, 1, 16)
    low = cast_inputs(inp, lowp=torch.bfloat16)
    for final in (True, False):  # the forward walk's products: split with final states, rounded once without
        ours = run_ssd(K.ssd, low, None, chunk_size=16, final=final)
        oracle = run_ssd(ssd_ref.ssd, cast_inputs(low, to=F64), None, chunk_size=16, final=final)
        for k in oracle:
            assert rel(ours[k], oracle[k]) < 5e-2, (final, k)
    monkeypatch.setenv("MEGASSM_SSD_PRECISION", "bogus")
    with pytest.raises(ValueError):
        K.ssd(**low, chunk_size=16)


@needs_triton
@pytest.mark.parametrize("segments", ["1", "2"])
def test_ssd_fast_precision_final_states(triton_mode, monkeypatch, segments):
    """The bf16 mode rounds the walk's products once (x dt exp to bf16), which left a returned final state (fp32)
    at bf16's error, beyond the 2x of the reference's own that the grid allows: the forward walk takes the split products when
    the final state is returned (one walk, and in segments with their fix-up)."""
    monkeypatch.setenv("MEGASSM_SSD_PRECISION", "bf16")
    monkeypatch.setenv("MEGASSM_SSD_STATE_SEGMENTS", segments)
    low = cast_inputs(ssd_inputs(1, 70, 2, 16, 1, 16, init=True, d_mode="head"), lowp=torch.bfloat16)
    sid = seq_from_starts(reset_starts(70, 32, 1), 70)
    oracle = run_ssd(ssd_ref.ssd, cast_inputs(low, to=F64), sid, chunk_size=32)
    check_lowp({"final": run_ssd(K.ssd, low, sid, chunk_size=32)["final"]}, run_ssd(ssd_ref.ssd, low, sid, chunk_size=32),
               {"final": oracle["final"]}, 2.0)


def _by_mode(monkeypatch, low, sid, **kw):
    """Outputs and gradients of the Triton SSD in the split and the bf16 precision modes."""
    out = {}
    for mode in ("split", "bf16"):
        monkeypatch.setenv("MEGASSM_SSD_PRECISION", mode)
        out[mode] = run_ssd(K.ssd, low, sid, **kw)
    return out


def _check_fast_mode_parameters(out, oracle):
    # dA and ddt_bias are sums over every position of cs gradients whose target-side (_dcb's row sums) and
    # source-side (_dx's x . Q) terms cancel: the bf16 mode keeps them as accurate as the split mode only while
    # both sides come from accurate products (_dx's intra-chunk products split; with the gate z, also _dcb's,
    # dy being an fp32 operand). Rounded once, dA's error was 40x dx's without the gate (CPU) and 90x the split
    # mode's with it (GPU, H 32 x 4K)
    e = {(mode, k): rel(out[mode][k], oracle[k]) for mode in out for k in ("dA", "ddt_bias")}
    for k in ("dA", "ddt_bias"):
        assert e["bf16", k] <= 2 * e["split", k] + 1e-4, e


@needs_triton
@pytest.mark.parametrize("gate", [False, True], ids=["nogate", "gate"])
def test_ssd_fast_precision_keeps_parameter_gradients(triton_mode, monkeypatch, gate):
    low = cast_inputs(ssd_inputs(1, 128, 2, 32, 1, 32, d_mode=None, gate=gate), lowp=torch.bfloat16)
    sid = seq_from_starts(reset_starts(128, 32, 1), 128)
    kw = dict(chunk_size=32, dt_limit=(0.0, 3.0))
    oracle = run_ssd(ssd_ref.ssd, cast_inputs(low, to=F64), sid, **kw)
    _check_fast_mode_parameters(_by_mode(monkeypatch, low, sid, **kw), oracle)

# --------------------------------------------------------------------------------------------------------
# GPU: the full precision grid (pytest -m gpu)

# (bsz, seqlen, nheads, hdim, dstate, ngroups, chunk, initial states, resets)
GPU_GRID = [
    (2, 1, 4, 64, 64, 1, 64, True, False),
    (2, 63, 8, 64, 128, 1, 64, True, True),
    (2, 256, 8, 128, 64, 8, 128, False, True),
    (2, 256, 16, 64, 256, 8, 256, True, True),
    (1, 1000, 16, 64, 256, 1, 256, True, True),
    (1, 1000, 128, 64, 64, 8, 128, True, True),
    (1, 4096, 32, 64, 128, 1, 256, True, True),
    (1, 4096, 64, 128, 128, 8, 64, False, True),
    (1, 16384, 8, 64, 128, 1, 256, True, True),
    (1, 16384, 4, 128, 256, 1, 128, True, False),
]


def _gpu_case(case, seed=0, gate=True):
    bsz, seqlen, nh, hd, ds, ng, chunk, init, resets = case
    inp = ssd_inputs(bsz, seqlen, nh, hd, ng, ds, init=init, d_mode="head", seed=seed, device="cuda", gate=gate)
    sid = seq_from_starts(reset_starts(seqlen, chunk, bsz), seqlen, device="cuda") if resets else None
    return inp, sid, chunk


@gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_GRID, ids=lambda c: "L{1}-H{2}-P{3}-N{4}-G{5}-c{6}".format(*c))
def test_gpu_ssd_fp32(triton_mode, case):
    _check_gpu_fp32(case, _grid_gate(case))


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["bf16", "split"])
@pytest.mark.parametrize("case", GPU_GRID, ids=lambda c: "L{1}-H{2}-P{3}-N{4}-G{5}-c{6}".format(*c))
def test_gpu_ssd_bf16(triton_mode, monkeypatch, case, mode):
    """bf16 inputs, in both precision modes (MEGASSM_SSD_PRECISION; bf16 is the default)."""
    monkeypatch.setenv("MEGASSM_SSD_PRECISION", mode)
    _check_gpu_bf16(case, _grid_gate(case))


def _grid_gate(case):
    """Half the grid without the gate z (the model's call), half with it (the backward recomputes the output)."""
    return GPU_GRID.index(case) % 2 == 1


def _check_gpu_fp32(case, gate=True):
    """fp32 inputs against the fp64 chunked reference (and, up to 1000 tokens, the token-by-token one)."""
    inp, sid, chunk = _gpu_case(case, gate=gate)
    ours = run_ssd(K.ssd, inp, sid, chunk_size=chunk)
    oracle = run_ssd(ssd_ref.ssd, cast_inputs(inp, to=F64), sid, chunk_size=chunk)
    check_fp32(ours, oracle, 1e-4)
    if case[1] <= 1000:  # the chunked reference itself vs the token-by-token recurrence
        seqo = run_ssd(ssd_ref.ssd_sequential, cast_inputs(inp, to=F64), sid)
        check_fp32(ours, seqo, 1e-4)


def _check_gpu_bf16(case, gate=True, seed=1):
    """bf16 inputs within 2x the reference's own bf16 error against fp64."""
    inp, sid, chunk = _gpu_case(case, seed=seed, gate=gate)
    low = cast_inputs(inp, lowp=torch.bfloat16)
    ours = run_ssd(K.ssd, low, sid, chunk_size=chunk)
    ref = run_ssd(ssd_ref.ssd, low, sid, chunk_size=chunk)
    oracle = run_ssd(ssd_ref.ssd, cast_inputs(low, to=F64), sid, chunk_size=chunk)
    check_lowp(ours, ref, oracle, 2.0)


@gpu
@needs_cuda
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("gate", [False, True], ids=["nogate", "gate"])
def test_gpu_ssd_bf16_a_gradient_draws(triton_mode, monkeypatch, seed, gate):
    """The grid's 4K case, three draws each way: within 2x of the reference's own error on every output, and dA / ddt_bias's own error
    (the oracle given the same output gradient) within 4x fp32 products' (with a two-way split of the diagonal tile: 12-43x, and 2.3x
    the reference on dA in one draw)."""
    monkeypatch.setenv("MEGASSM_SSD_PRECISION", "split")  # the split mode's property, as above
    case = (1, 4096, 32, 64, 128, 1, 256, True, True)
    _check_gpu_bf16(case, gate, seed=seed)
    inp, sid, chunk = _gpu_case(case, seed=seed, gate=gate)
    _check_a_gradient_own_error(inp, sid, chunk, 4.0)


@gpu
@needs_cuda
@pytest.mark.parametrize("segments,gate,mode", [("4", True, "bf16"), ("4", False, "bf16"), ("auto", False, "bf16"),
                                               ("4", True, "split")])
def test_gpu_ssd_state_segments(triton_mode, monkeypatch, segments, gate, mode):
    """One 16K row (the case the segmented chunk walks are for), with resets and an initial state, with and
    without the gate: fp32 against the fp64 reference, bf16 within 2x of the reference's own error."""
    monkeypatch.setenv("MEGASSM_SSD_STATE_SEGMENTS", segments)
    monkeypatch.setenv("MEGASSM_SSD_PRECISION", mode)
    case = (1, 16384, 8, 64, 128, 1, 256, True, True)
    _check_gpu_fp32(case, gate)
    _check_gpu_bf16(case, gate)


@gpu
@needs_cuda
@pytest.mark.parametrize("case", [GPU_GRID[1], GPU_GRID[6], (1, 16384, 8, 64, 128, 1, 256, True, True)],
                         ids=lambda c: "L{1}-H{2}-c{6}".format(*c))
def test_gpu_ssd_bf16_mode(triton_mode, monkeypatch, case):
    """MEGASSM_SSD_PRECISION=bf16 (states and derived forward operands rounded once, as mamba_ssm does), with the
    gate, resets and an initial state: every output and gradient within 2x of the reference's own bf16 error,
    the final states included (the walk takes split products when they are returned), and again for the call
    without final states (the walk's products rounded once); dA and ddt_bias, whose terms cancel, also within
    2x of the split mode's error."""
    inp, sid, chunk = _gpu_case(case, seed=1)
    low = cast_inputs(inp, lowp=torch.bfloat16)
    out = _by_mode(monkeypatch, low, sid, chunk_size=chunk)
    ref = run_ssd(ssd_ref.ssd, low, sid, chunk_size=chunk)
    oracle = run_ssd(ssd_ref.ssd, cast_inputs(low, to=F64), sid, chunk_size=chunk)
    check_lowp(out["bf16"], ref, oracle, 2.0)
    _check_fast_mode_parameters(out, oracle)
    ref = run_ssd(ssd_ref.ssd, low, sid, chunk_size=chunk, final=False)
    oracle = run_ssd(ssd_ref.ssd, cast_inputs(low, to=F64), sid, chunk_size=chunk, final=False)
    monkeypatch.setenv("MEGASSM_SSD_PRECISION", "bf16")
    check_lowp(run_ssd(K.ssd, low, sid, chunk_size=chunk, final=False), ref, oracle, 2.0)


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["bf16", "split"])
def test_gpu_ssd_saved_states_match_recompute(triton_mode, monkeypatch, mode):
    """MEGASSM_SSD_SAVE_STATES=1 at a real shape (2 x 4K, H 8, resets, an initial state; bf16 with segments 4
    and one walk, in both precision modes): the recomputing backward's results (_check_kept_matches_recompute)."""
    monkeypatch.setenv("MEGASSM_SSD_PRECISION", mode)
    inp, sid, chunk = _gpu_case((2, 4096, 8, 64, 128, 1, 256, True, True))
    low = cast_inputs(inp, lowp=torch.bfloat16)
    for segments in ("1", "4"):
        monkeypatch.setenv("MEGASSM_SSD_STATE_SEGMENTS", segments)
        monkeypatch.setenv("MEGASSM_SSD_SAVE_STATES", "0")
        run_ssd(K.ssd, low, sid, chunk_size=chunk)  # the autotuner's first calls may time other configs
        want = run_ssd(K.ssd, low, sid, chunk_size=chunk)
        monkeypatch.setenv("MEGASSM_SSD_SAVE_STATES", "1")
        got = run_ssd(K.ssd, low, sid, chunk_size=chunk)
        _check_kept_matches_recompute(got, want, segments)


@gpu
@needs_cuda
@pytest.mark.parametrize("gate", [False, True], ids=["nogate", "gate"])
def test_gpu_ssd_side_stream_bitwise(triton_mode, monkeypatch, gate):
    """C B^T and dCB on the side stream (MEGASSM_SSD_STREAMS=1, the default) give the bits of the one-stream
    order (2 x 4K, H 8, resets, an initial state, bf16; with the gate dCB forks after the output recompute)."""
    inp = ssd_inputs(2, 4096, 8, 64, 1, 128, init=True, d_mode="head", gate=gate, seed=3, device="cuda")
    sid = seq_from_starts(reset_starts(4096, 256, 2), 4096, device="cuda")
    low = cast_inputs(inp, lowp=torch.bfloat16)
    monkeypatch.setenv("MEGASSM_SSD_STREAMS", "0")
    run_ssd(K.ssd, low, sid, chunk_size=256)  # the autotuner's first calls may time other configs
    want = run_ssd(K.ssd, low, sid, chunk_size=256)
    monkeypatch.setenv("MEGASSM_SSD_STREAMS", "1")
    got = run_ssd(K.ssd, low, sid, chunk_size=256)
    assert all(torch.equal(got[k], want[k]) for k in want)


@gpu
@needs_cuda
def test_gpu_ssd_extremes_16k_finite_and_deterministic(triton_mode):
    inp = ssd_inputs(1, 16384, 8, 64, 1, 128, dt_scale=6.0, a_scale=50.0, device="cuda")
    inp["dt_bias"] = torch.full_like(inp["dt_bias"], 4.0)  # softplus(dt) up to ~10+, A down to -100
    low = cast_inputs(inp, lowp=torch.bfloat16)
    a = run_ssd(K.ssd, low, None, chunk_size=256)
    b = run_ssd(K.ssd, low, None, chunk_size=256)
    for k in a:
        assert torch.isfinite(a[k]).all(), k
        assert torch.equal(a[k], b[k]), k  # no atomics: bitwise identical run to run

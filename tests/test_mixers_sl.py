"""The seed mixers `S` (Mamba-1 / S6) and `L` (Longhorn): forward == a token-by-token loop over step()
(document resets included), carried states (two halves == the whole, outputs and gradients), reset
behaviour, canonical init, config checks, FLOPs, the Triton path inside the mixers, a tiny `S-L-` LM that
learns, and tensor parallelism (TP=2 over gloo, with and without SP) against the single-device model."""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels are first imported

from megassm.config import ConfigError, LonghornConfig, Mamba1Config, ModelConfig, load_config  # noqa: E402
from megassm.models import build_model  # noqa: E402
from megassm.models.blocks import MIXERS  # noqa: E402
from megassm.models.state import ScanState  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.*")]

F64 = torch.float64
LETTERS = ["S", "L"]


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tiny_cfg(pattern="S-L-", d_model=16, **sections):
    return ModelConfig(pattern=pattern, d_model=d_model, vocab_size=40, pad_vocab_multiple=8,
                       mamba1=Mamba1Config(d_state=5, **sections.get("mamba1", {})),
                       longhorn=LonghornConfig(d_state=6, **sections.get("longhorn", {})))


def mixer(letter, dtype=F64, seed=0, **sections):
    m = MIXERS[letter](tiny_cfg(**sections), 4)
    from megassm.models.init import canonical_init

    canonical_init(m, seed)
    # non-trivial D / biases so that every term shows up in the comparisons
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        m.D.add_(0.3 * torch.randn(m.D.shape, generator=g))
        m.conv1d.bias.add_(0.1 * torch.randn(m.conv1d.bias.shape, generator=g))
    return m.to(dtype)


def seq_ids(bsz, seqlen, starts):
    sid = torch.zeros(bsz, seqlen, dtype=torch.int32)
    for r, ss in enumerate(starts):
        for s in ss:
            sid[r, s:] += 1
    return sid


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("MEGASSM_KERNELS", "torch")


# --------------------------------------------------------------------------------------------------------
# forward vs step, carried states, resets


@pytest.mark.parametrize("letter", LETTERS)
def test_forward_equals_step_loop_with_resets(letter):
    m = mixer(letter)
    bsz, seqlen = 2, 17
    u = torch.randn(bsz, seqlen, 16, dtype=F64)
    sid = seq_ids(bsz, seqlen, [[4, 5, 11], [9]])  # row 0 has a one-token document
    st0 = m.allocate_state(bsz)
    g = torch.Generator().manual_seed(3)
    st0 = ScanState(conv=torch.randn(st0.conv.shape, generator=g, dtype=F64),
                    ssm=torch.randn(st0.ssm.shape, generator=g, dtype=F64))
    y, fin = m(u, seq_idx=sid, state=st0, return_state=True)
    st, ys = st0, []
    for t in range(seqlen):
        if t > 0:
            st = st.reset(sid[:, t] != sid[:, t - 1])
        out, st = m.step(u[:, t], st)
        ys.append(out)
    assert rel(torch.stack(ys, 1), y) < 1e-12
    assert rel(st.ssm, fin.ssm) < 1e-12 and rel(st.conv, fin.conv) < 1e-12
    assert fin.ssm.shape == (bsz, m.d_inner, m.d_state) and fin.conv.shape == (bsz, m.d_inner, m.d_conv - 1)


@pytest.mark.parametrize("letter", LETTERS)
def test_two_halves_with_carried_state_equal_the_whole(letter):
    """Outputs, the final state and every parameter / input / initial-state gradient: the state (conv tail and
    scan state) handed from the first half to the second carries the gradient back."""
    m = mixer(letter)
    bsz, seqlen, cut = 2, 21, 8
    u = torch.randn(bsz, seqlen, 16, dtype=F64)
    sid = seq_ids(bsz, seqlen, [[3, 12], [cut]])  # row 1 starts a document exactly at the cut
    g = torch.Generator().manual_seed(5)
    gy = torch.randn(bsz, seqlen, 16, generator=g, dtype=F64)
    init = m.allocate_state(bsz)
    init = ScanState(conv=torch.randn(init.conv.shape, generator=g, dtype=F64),
                     ssm=torch.randn(init.ssm.shape, generator=g, dtype=F64))

    def run(split):
        m.zero_grad(set_to_none=True)
        uu = u.clone().requires_grad_(True)
        st = ScanState(conv=init.conv.clone().requires_grad_(True), ssm=init.ssm.clone().requires_grad_(True))
        if split:
            y1, mid = m(uu[:, :cut], seq_idx=sid[:, :cut], state=st, return_state=True)
            mid = mid.reset(sid[:, cut] != sid[:, cut - 1])
            y2, fin = m(uu[:, cut:], seq_idx=sid[:, cut:], state=mid, return_state=True)
            y = torch.cat([y1, y2], 1)
        else:
            y, fin = m(uu, seq_idx=sid, state=st, return_state=True)
        ((y * gy).sum() + fin.ssm.sum() + 0.5 * fin.conv.sum()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        grads.update(u=uu.grad, conv0=st.conv.grad, ssm0=st.ssm.grad)
        return y.detach(), fin, grads

    ya, fa, ga = run(False)
    yb, fb, gb = run(True)
    assert rel(yb, ya) < 1e-12 and rel(fb.ssm, fa.ssm) < 1e-12 and rel(fb.conv, fa.conv) < 1e-12
    bad = {k: rel(gb[k], ga[k]) for k in ga if not rel(gb[k], ga[k]) < 1e-10}
    assert not bad, bad
    assert ga["ssm0"].abs().sum() > 0 and ga["conv0"].abs().sum() > 0  # the initial state does get gradient


@pytest.mark.parametrize("letter", LETTERS)
def test_documents_are_independent_and_reset_zeroes_rows(letter):
    m = mixer(letter)
    u = torch.randn(1, 14, 16, dtype=F64)
    sid = seq_ids(1, 14, [[6]])
    st0 = m.allocate_state(1)
    st0 = ScanState(conv=torch.randn(st0.conv.shape, dtype=F64), ssm=torch.randn(st0.ssm.shape, dtype=F64))
    y, fin = m(u, seq_idx=sid, state=st0, return_state=True)
    y1, _ = m(u[:, :6], state=st0)
    y2, f2 = m(u[:, 6:], return_state=True)  # the second document starts from zero
    assert rel(y, torch.cat([y1, y2], 1)) < 1e-12 and rel(fin.ssm, f2.ssm) < 1e-12
    st = ScanState(conv=torch.ones(3, 4, 2), ssm=torch.ones(3, 4, 5))
    r = st.reset(torch.tensor([False, True, False]))
    assert r.ssm[1].abs().sum() == 0 and r.conv[1].abs().sum() == 0 and r.ssm[0].sum() == 20 and r.conv[2].sum() == 8
    assert st.ssm.sum() == 60  # not modified in place


@pytest.mark.parametrize("letter", LETTERS)
def test_triton_path_in_the_mixer(monkeypatch, letter):
    """The mixer on the Triton kernels (conv, scan, step; interpreter on CPU) against its reference path:
    outputs, final states and every parameter gradient in fp32."""
    from megassm.kernels import dispatch

    monkeypatch.setenv("MEGASSM_KERNELS", "triton")
    if not dispatch.triton_available():
        pytest.skip(f"triton kernels unavailable: {dispatch.triton_error()!r}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        from megassm.kernels.mamba2_ssd import triton_ssd_common as ssd_common

        if not ssd_common._INTERPRET:
            pytest.skip("the Triton kernels were imported before TRITON_INTERPRET=1 was set")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # an earlier test may have changed it; read at launch
    m = mixer(letter, dtype=torch.float32).to(dev)
    u = torch.randn(2, 19, 16, device=dev)
    sid = seq_ids(2, 19, [[5, 6], [17]]).to(dev)
    res = {}
    for mode in ("triton", "torch"):
        monkeypatch.setenv("MEGASSM_KERNELS", mode)
        m.zero_grad(set_to_none=True)
        y, fin = m(u, seq_idx=sid, return_state=True)
        ((y * torch.linspace(-1, 1, y.numel(), device=dev).view(y.shape)).sum() + fin.ssm.sum()).backward()
        step_out, _ = m.step(u[:, 0], m.allocate_state(2, device=dev))
        res[mode] = dict(y=y.detach(), ssm=fin.ssm, conv=fin.conv, step=step_out,
                         **{n: p.grad.clone() for n, p in m.named_parameters()})
    bad = {k: rel(res["triton"][k], v) for k, v in res["torch"].items() if not rel(res["triton"][k], v) < 1e-5}
    assert not bad, bad


# --------------------------------------------------------------------------------------------------------
# init, config, FLOPs


def test_canonical_init_follows_the_papers():
    m = build_model(tiny_cfg(pattern="SL"))
    m.init_weights(11)
    s, lh = m.layers[0].mixer, m.layers[1].mixer
    N = s.d_state
    torch.testing.assert_close(s.A_log, torch.log(torch.arange(1, N + 1, dtype=torch.float32)).expand(s.d_inner, N))
    dt = torch.nn.functional.softplus(s.dt_proj.bias)
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert bool((s.D == 1).all()) and bool((lh.D == 1).all()) and bool((lh.beta_proj.bias == 0).all())
    bound = 1 / math.sqrt(s.d_inner) / math.sqrt(2)  # out_proj: U(+-1/sqrt(fan_in)) / sqrt(blocks)
    assert s.out_proj.weight.abs().max() <= bound and s.out_proj.weight.abs().max() > 0.9 * bound
    assert s.dt_proj.weight.abs().max() <= s.dt_rank ** -0.5
    nwd = m.no_weight_decay_names()
    for n in ("layers.0.mixer.A_log", "layers.0.mixer.D", "layers.0.mixer.dt_proj.bias", "layers.1.mixer.D",
              "layers.1.mixer.beta_proj.bias"):
        assert n in nwd
    assert "layers.0.mixer.x_proj.weight" not in nwd
    m2 = build_model(tiny_cfg(pattern="SL"), device="meta")
    m2.to_empty(device="cpu")
    m2.init_weights(11)
    for (n, a), (_, b) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.equal(a, b), n
    mn = build_model(tiny_cfg(pattern="S", mamba1=dict(init="normal")))
    mn.init_weights(0)
    assert abs(mn.layers[0].mixer.in_proj.weight.std().item() - 0.02) < 0.004


def _cfg(*over):
    return load_config(None, ["data.builtin=stdlib", "model.d_model=32", "train.micro_batch=1",
                              "train.global_batch=1", "run.progress=false", *over])


def test_config_checks_name_the_key():
    cfg = _cfg("model.pattern=S-L-")
    assert cfg.model.mamba1.d_state == 16 and cfg.model.longhorn.dt_rank is None
    for over, msg in (
        (["model.pattern=S", "model.mamba1.init=kaiming"], "model.mamba1.init must be paper or normal"),
        (["model.pattern=L", "model.longhorn.d_conv=5"], "model.longhorn.d_conv must be 2..4"),
        (["model.pattern=L", "model.longhorn.dt_rank=0"], "model.longhorn.dt_rank must be >= 1"),
        (["model.pattern=S", "model.mamba1.dt_min=0.5"], "model.mamba1.dt_min=0.5 must be in"),
        (["model.pattern=S", "model.mamba1.d_state=0"], "model.mamba1.d_state must be >= 1"),
        (["model.pattern=S", "parallel.tp=3", "parallel.world_size=3", "train.global_batch=1"],
         r"parallel.tp=3 must divide model.mamba1.expand x model.d_model = 64"),
        (["model.pattern=L", "parallel.cp=2", "parallel.world_size=2"], "no plan for Longhorn"),
        (["model.pattern=S", "train.bptt=true"], r"train.bptt=true with Mamba-1"),
    ):
        with pytest.raises(ConfigError, match=msg):
            _cfg(*over)
    with pytest.raises(ConfigError, match="unknown key"):
        _cfg("model.pattern=S", "model.mamba1.dstate=4")


@pytest.mark.parametrize("letter", LETTERS)
def test_flops_projection_terms_are_twice_the_weights(letter):
    from megassm.training.flops import flops_per_sequence

    cfg = tiny_cfg(pattern=letter)
    m = build_model(cfg)
    mx = m.layers[0].mixer
    L = 33
    fl = flops_per_sequence(cfg, m.vocab_size_padded, L)
    key = "mamba1" if letter == "S" else "longhorn"
    lowrank = mx.dt_proj if letter == "S" else mx.beta_proj
    weights = sum(w.weight.numel() for w in (mx.in_proj, mx.x_proj, lowrank, mx.out_proj))
    assert fl[f"{key}_proj"] == 2 * L * weights
    assert fl[f"{key}_conv"] == 2 * L * mx.conv1d.weight.numel()
    assert fl[f"{key}_scan"] == L * mx.d_inner * mx.d_state * (6 if letter == "S" else 7)
    assert fl["total"] == fl[f"{key}_proj"] + fl[f"{key}_conv"] + fl[f"{key}_scan"] + fl["head"]


# --------------------------------------------------------------------------------------------------------
# training


def test_tiny_s_l_lm_learns():
    torch.manual_seed(0)
    cfg = tiny_cfg(pattern="S-L-", d_model=32)
    m = build_model(cfg)
    m.init_weights(0)
    opt = torch.optim.AdamW(m.param_groups(0.01), lr=3e-3)
    base = torch.arange(16) % 7 + 3 * (torch.arange(16) % 2)  # a periodic pattern the recurrence can learn
    tokens = torch.stack([(base + r) % 40 for r in range(4)])
    seq_idx = seq_ids(4, 16, [[], [8], [], [3]])
    losses = []
    for _ in range(40):
        opt.zero_grad(set_to_none=True)
        loss = m(tokens[:, :-1], seq_idx=seq_idx[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses[::8]


# --------------------------------------------------------------------------------------------------------
# tensor parallelism (gloo, real processes)

TP_CASES = [
    dict(pattern="S-L-", sections={"mamba1": {"d_state": 4}, "longhorn": {"d_state": 5}}),
    dict(pattern="SL", tie=False, sections={"mamba1": {"d_state": 3, "proj_bias": True, "init": "normal", "dt_rank": 3},
                                            "longhorn": {"d_state": 4, "proj_bias": True, "expand": 1}}),
]


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_matches_single_device(tmp_path, sp):
    """Logits, decode steps, loss, every gradient, clipped AdamW steps (the harness of test_parallel_tp.py), and
    the collectives: two per S / L layer forward -- the x_proj all-reduce and the out_proj all-reduce (SP: the
    all-gather in, the x_proj all-reduce, the reduce-scatter out)."""
    from multiproc import spawn
    from parallel_cases import equivalence_worker

    out = tmp_path / "report.json"
    spawn(equivalence_worker, 2, 2, sp, [json.loads(json.dumps(c)) for c in TP_CASES], str(out))
    report = json.loads(out.read_text())
    assert len(report) == len(TP_CASES)
    for rec in report:
        assert rec["worst_grad_rel"] <= 1e-5 and rec["logits_rel"] <= 1e-5 and rec["decode_rel"] <= 1e-5, rec
        want = {"S": {"all_reduce": 2}, "L": {"all_reduce": 2}, "-": {"all_reduce": 1}}
        if sp:
            want = {"S": {"all_gather": 1, "all_reduce": 1, "reduce_scatter": 1},
                    "L": {"all_gather": 1, "all_reduce": 1, "reduce_scatter": 1},
                    "-": {"all_gather": 1, "reduce_scatter": 1}}
        assert rec["per_layer_fwd"] == [want[k] for k in rec["kinds"]], rec["per_layer_fwd"]
        n_scan = sum(k in "SL" for k in rec["kinds"])
        n = len(rec["kinds"])
        if not sp:  # backward: x_proj's and the layer input's all-reduce per S / L, one per MLP, the head's input
            assert rec["bwd_total"] == {"all_reduce": 2 * n_scan + (n - n_scan) + 1}, rec["bwd_total"]
        else:
            assert rec["bwd_total"] == {"all_gather": n + 1, "reduce_scatter": n + 1, "all_reduce": n_scan}


# --------------------------------------------------------------------------------------------------------
# the LTI ablation of `S` (model.mamba1.lti, selective copying in docs/seeds.md)


def _lti_reference(m, u, sid):
    """The LTI mixer written out token by token: constants dt = softplus(dt_bias), B, C; resets at documents."""
    x, z = torch.split(m.in_proj(u), [m.d_inner, m.d_inner], dim=-1)
    xc = F.pad(x.transpose(1, 2), (m.d_conv - 1, 0))
    w = m.conv1d.weight.squeeze(1)
    x = torch.stack([(xc[:, :, t:t + m.d_conv] * w).sum(-1) + m.conv1d.bias for t in range(u.shape[1])], 1)
    dt = F.softplus(m.dt_bias)  # [d_inner]
    dA = torch.exp(dt[:, None] * -torch.exp(m.A_log))  # [d_inner, N]
    h = torch.zeros(u.shape[0], m.d_inner, m.d_state, dtype=u.dtype)
    ys = []
    for t in range(u.shape[1]):
        keep = (sid[:, t] == sid[:, t - 1]) if t > 0 else torch.ones(u.shape[0], dtype=torch.bool)
        xt = F.silu(x[:, t])
        h = h * keep[:, None, None] * dA + (dt * xt)[:, :, None] * m.B_lti
        ys.append((h * m.C_lti).sum(-1) + m.D * xt)
    y = torch.stack(ys, 1) * F.silu(z)
    return m.out_proj(y)


def test_lti_ablation_matches_the_token_loop_outputs_and_gradients():
    m = mixer("S", mamba1={"lti": True})
    assert not hasattr(m, "x_proj") and not hasattr(m, "dt_proj")
    with torch.no_grad():
        m.C_lti.normal_(generator=torch.Generator().manual_seed(9))
    bsz, seqlen = 2, 13
    u = torch.randn(bsz, seqlen, 16, dtype=F64)
    sid = torch.zeros(bsz, seqlen, dtype=torch.int32)  # conv resets are tested for `S` above; one document here
    g = torch.randn(bsz, seqlen, 16, dtype=F64)

    def grads(fn):
        m.zero_grad(set_to_none=True)
        uu = u.clone().requires_grad_(True)
        y = fn(uu)
        (y * g).sum().backward()
        return y.detach(), {**{n: p.grad.clone() for n, p in m.named_parameters()}, "u": uu.grad}

    ya, ga = grads(lambda uu: m(uu, seq_idx=sid)[0])
    yb, gb = grads(lambda uu: _lti_reference(m, uu, sid))
    assert rel(ya, yb) < 1e-12
    bad = {k: rel(ga[k], gb[k]) for k in gb if not rel(ga[k], gb[k]) < 1e-10}
    assert not bad, bad
    assert gb["B_lti"].abs().sum() > 0 and gb["dt_bias"].abs().sum() > 0


def test_lti_ablation_decode_and_config():
    m = mixer("S", mamba1={"lti": True})
    u = torch.randn(1, 9, 16, dtype=F64)
    y, _ = m(u, return_state=True)
    st, ys = m.allocate_state(1), []
    st = ScanState(conv=st.conv.double(), ssm=st.ssm.double())
    for t in range(9):
        out, st = m.step(u[:, t], st)
        ys.append(out)
    assert rel(torch.stack(ys, 1), y) < 1e-12
    assert _cfg("model.pattern=SS", "model.mamba1.lti=true").model.mamba1.lti
    with pytest.raises(ConfigError, match=r"model.mamba1.lti=true with parallel.tp=2"):
        _cfg("model.pattern=S", "model.mamba1.lti=true", "parallel.tp=2", "parallel.world_size=2")

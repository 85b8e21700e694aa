"""BPTT state caching (megassm/training/bptt.py): windows with carried states equal one full-length pass,
forward and backward; resets at document boundaries and stream restarts; exact resume through the Trainer."""
import pytest
import torch

from megassm.config import AttentionConfig, ConfigError, MambaConfig, MLPConfig, ModelConfig, load_config
from megassm.models import build_model
from megassm.models.state import KVCache, MambaState
from megassm.training.bptt import StateCarrier, carried_kinds

V = 61

MODELS = {
    "mamba2": dict(pattern="MMM"),
    "hybrid_window": dict(pattern="M*M-", window=5),  # W < window length
    "hybrid_long_window": dict(pattern="M*M-", window=13),  # W > window length: the cache spans windows
}


def tiny(pattern, window=0, rope=True):
    return ModelConfig(
        pattern=pattern,
        d_model=32,
        mamba=MambaConfig(d_state=8, headdim=8, chunk_size=4, ngroups=2),
        attn=AttentionConfig(n_heads=4, n_kv_heads=2, sliding_window=window, rope=rope),
        mlp=MLPConfig(ffn_hidden=48),
    )


def make(cfg, seed=0):
    m = build_model(cfg, vocab_size=V)
    m.init_weights(seed)
    return m.float()


def assert_close(a, b, tol=1e-5):
    a, b = a.detach().double(), b.detach().double()
    err = (a - b).abs().max().item()
    scale = max(b.abs().max().item(), 1e-12)
    assert err <= tol * scale, f"max abs diff {err:.3g} vs scale {scale:.3g} (rel {err / scale:.3g})"


def stream(B=2, T=40, seed=0, doc_starts=None):
    """tokens/labels [B, T], seq_idx [B, T] (document ids, full length); doc_starts: per row, token
    positions where a new document starts."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, V, (B, T + 1), generator=g)
    seq_idx = torch.zeros(B, T, dtype=torch.int32)
    for b, starts in enumerate(doc_starts or [[] for _ in range(B)]):
        for s in starts:
            seq_idx[b, s:] += 1
    return toks[:, :-1], toks[:, 1:], seq_idx


def windows_of(tokens, labels, seq_idx, L):
    """Cut a full-length stream into the batches the BPTT loader serves: local seq_idx from 0, and
    reset[b] when the window's first token starts a document."""
    out = []
    for k in range(tokens.shape[1] // L):
        sl = slice(k * L, (k + 1) * L)
        sid = seq_idx[:, sl]
        if k == 0:
            reset = torch.ones(tokens.shape[0], dtype=torch.bool)
        else:
            reset = seq_idx[:, k * L] != seq_idx[:, k * L - 1]
        out.append({"tokens": tokens[:, sl], "labels": labels[:, sl], "seq_idx": sid - sid[:, :1], "reset": reset})
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("docs", [False, True])
def test_windows_with_carried_state_equal_full_forward(name, docs):
    model = make(tiny(**MODELS[name])).eval()
    L, K = 8, 5
    # row 0: documents start inside a window (t=11) and exactly at a window start (t=24): a reset;
    # row 1: one long document
    starts = [[11, 24], []] if docs else None
    tokens, labels, seq_idx = stream(T=L * K, doc_starts=starts)
    with torch.no_grad():
        full = model(tokens, seq_idx=seq_idx if docs else None).logits
        carrier = StateCarrier(model, micro_batch=2)
        outs = []
        for w in windows_of(tokens, labels, seq_idx, L):
            states = carrier.begin(0, w["reset"])
            out = model(w["tokens"], seq_idx=w["seq_idx"], states=states, return_states=True)
            carrier.end(0, out.states)
            outs.append(out.logits)
    assert_close(torch.cat(outs, dim=1), full)


def test_without_carry_windows_differ():
    """Sanity: the equality above is not trivial (a window without the carried state differs)."""
    model = make(tiny("MMM")).eval()
    tokens, labels, seq_idx = stream(T=16)
    with torch.no_grad():
        full = model(tokens).logits
        second = model(tokens[:, 8:]).logits
    assert (second - full[:, 8:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["mamba2", "hybrid_window", "hybrid_long_window"])
def test_k_window_backprop_equals_full_backward(name):
    L, K = 8, 4
    tokens, labels, seq_idx = stream(T=L * K, seed=3, doc_starts=[[13], []])
    ref = make(tiny(**MODELS[name]))
    ref(tokens, seq_idx=seq_idx, labels=labels).loss.backward()
    model = make(tiny(**MODELS[name]))
    carrier = StateCarrier(model, micro_batch=2, windows=K)
    loss = carrier.run_windows(model, 0, windows_of(tokens, labels, seq_idx, L))
    with torch.no_grad():
        full_loss = ref(tokens, seq_idx=seq_idx, labels=labels).loss
    assert_close(loss, full_loss)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, tol=2e-5)
    # after the backward the carried states hold no graph
    for s in carrier.states[0]:
        if s is not None:
            assert all(not t.requires_grad for t in vars(s).values())


def test_truncated_bptt_cuts_gradient_but_carries_values():
    """K=1 windows: forward values carried (loss equals the full forward's window loss), gradients stop at
    the window boundary (equal those of a run with the incoming state as a constant)."""
    L = 8
    tokens, labels, seq_idx = stream(T=2 * L, seed=5)
    ws = windows_of(tokens, labels, seq_idx, L)
    model = make(tiny("M*M-", window=5))
    carrier = StateCarrier(model, micro_batch=2, windows=1)
    carrier.run_windows(model, 0, ws[:1])
    model.zero_grad()
    init = carrier.states[0]
    assert all(not t.requires_grad for s in init if s is not None for t in vars(s).values())
    loss = carrier.run_windows(model, 0, ws[1:])
    g = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(ws[1]["tokens"], seq_idx=ws[1]["seq_idx"], labels=ws[1]["labels"], states=init).loss
    ref.backward()
    assert_close(loss, ref.detach(), tol=0)
    for a, p in zip(g, model.parameters()):
        assert_close(a, p.grad, tol=1e-6)


def test_resets_and_stream_restart():
    model = make(tiny("M*M-", window=6)).eval()
    assert carried_kinds(model) == ["mamba", "window", "mamba", None]
    full_attn = make(tiny("M*M-", window=0))
    assert carried_kinds(full_attn) == ["mamba", None, "mamba", None]  # full attention is not carried
    tokens, labels, seq_idx = stream(T=16, seed=7)
    carrier = StateCarrier(model, micro_batch=2)
    with torch.no_grad():
        out = model(tokens[:, :8], states=carrier.begin(0, None), return_states=True)
        carrier.end(0, out.states)
        assert carrier.states[0][0].ssm.abs().sum() > 0
        # row 1 restarts (a new document at the window start), row 0 continues
        st = carrier.begin(0, torch.tensor([False, True]))
        got = model(tokens[:, 8:], states=st).logits
        fresh = model(tokens[:, 8:]).logits
        cont = model(tokens).logits[:, 8:]
    assert_close(got[1], fresh[1])
    assert_close(got[0], cont[0])
    assert st[0].ssm[1].abs().sum() == 0 and st[0].conv[1].abs().sum() == 0
    assert not st[1].valid[1].any() and st[1].pos[1] == 0 and st[1].pos[0] == 8
    # stream restart: saved states that do not belong to the data position are dropped
    saved = carrier.state_dict()
    other = StateCarrier(model, micro_batch=2)
    assert other.load_state_dict(saved, data_window=saved["window"] + 3) is False
    assert all(s is None or (s.ssm.abs().sum() == 0 if isinstance(s, MambaState) else s.length == 0)
               for s in other.states[0])
    assert other.load_state_dict(None, data_window=4) is False and other.window == 4
    assert other.load_state_dict(saved, data_window=saved["window"]) is True
    for a, b in zip(other.states[0], carrier.states[0]):
        if a is not None:
            for t, u in zip(vars(a).values(), vars(b).values()):
                assert torch.equal(t, u)


def test_state_dict_roundtrip_across_micro_batches():
    model = make(tiny("M*M-", window=3))
    carrier = StateCarrier(model, micro_batch=2, accumulation=3)
    tokens, labels, seq_idx = stream(B=6, T=8, seed=9)
    with torch.no_grad():
        for m in range(3):
            rows = slice(2 * m, 2 * m + 2)
            out = model(tokens[rows], states=carrier.begin(m, None), return_states=True)
            carrier.end(m, out.states)
    d = carrier.state_dict()
    assert d["rows"] == 6 and d["states"][0]["ssm"].shape[0] == 6
    assert d["states"][1]["k"].shape[2] == 3  # the last W keys only
    back = StateCarrier(model, micro_batch=2, accumulation=3)
    assert back.load_state_dict(d, data_window=d["window"])
    for m in range(3):
        for a, b in zip(back.states[m], carrier.states[m]):
            if isinstance(a, (MambaState, KVCache)):
                for t, u in zip(vars(a).values(), vars(b).values()):
                    assert torch.equal(t, u)


# ---------------------------------------------------------------------------------------------------
# the real Trainer on the builtin corpus

TINY = [
    "data.builtin=stdlib",
    "model.pattern=M*M-",
    "model.d_model=32",
    "model.mamba.d_state=8",
    "model.mamba.headdim=8",
    "model.mamba.chunk_size=8",
    "model.attn.n_heads=2",
    "model.attn.sliding_window=12",
    "model.mlp.ffn_hidden=64",
    "train.seq_len=32",
    "train.micro_batch=2",
    "train.global_batch=4",  # two accumulation micro-batches: rows 0-1 and 2-3
    "train.bptt=true",
    "train.log_interval=1",
    "train.eval_interval=0",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "data.prefetch=0",
    "run.progress=false",
    "run.tensorboard=false",
]


def bptt_cfg(run_dir, *extra):
    return load_config(None, TINY + [f"run.dir={run_dir}", *extra])


@pytest.mark.parametrize("K", [1, 2])
def test_trainer_bptt_resume_is_exact(tmp_path, K):
    from megassm.training import checkpoint as ckpt
    from megassm.training.trainer import Trainer

    N = 3
    common = [f"train.steps={2 * N}", f"run.save_interval={N}", f"train.bptt_windows={K}"]
    straight_tr = Trainer(bptt_cfg(tmp_path / "a", *common))
    straight = straight_tr.fit()
    assert straight_tr.carrier.window == 2 * N * K and straight_tr.data.state_dict()["window"] == 2 * N * K

    first = Trainer(bptt_cfg(tmp_path / "b", *common))
    first.cfg.train.steps = N
    head = first.fit()
    extra = ckpt.load_checkpoint(ckpt.find_latest(str(tmp_path / "b")), model=None)
    cs = extra["carried_states"]
    assert cs["window"] == N * K and cs["rows"] == 4 and cs["states"][0]["ssm"].abs().sum() > 0
    resumed = Trainer(bptt_cfg(tmp_path / "b", *common, "run.resume=auto"))
    assert resumed.step == N and resumed.carrier.window == N * K
    tail = resumed.fit()
    assert head + tail == straight  # identical floats at every step

    # resuming without the carried states (a stream restart) is not the same run
    lost = Trainer(bptt_cfg(tmp_path / "b", *common, "run.resume=" + str(tmp_path / "b" / "checkpoints" / "step_00000003")))
    lost.carrier.reset_all()
    assert lost.fit() != tail


def test_trainer_bptt_rows_follow_streams(tmp_path):
    """Micro-batch m of every step holds the same streams: window k+1 of a row continues window k."""
    from megassm.training.trainer import Trainer

    tr = Trainer(bptt_cfg(tmp_path / "s", "train.steps=1"))
    seen = []
    real = tr.data.next_batch

    def spy():
        b = real()
        seen.append(b)
        return b

    tr.data.next_batch = spy
    tr.train_step()
    tr.train_step()
    # accumulation 2: fetched [step0 m0, step0 m1, step1 m0, step1 m1]
    for m in range(2):
        assert torch.equal(seen[2 + m]["tokens"][:, 0], seen[m]["labels"][:, -1])
    tr.data.close()


def test_check_supported_bptt(monkeypatch):
    from megassm.training.trainer import check_supported

    with pytest.raises(ConfigError, match="needs train.bptt=true"):
        check_supported(load_config(None, ["data.builtin=stdlib", "train.bptt_windows=2"]))
    check_supported(load_config(None, ["data.builtin=stdlib", "train.bptt=true", "train.bptt_windows=2"]))
    # TP, PP, DP and CP all carry state now (tests/test_bptt_parallel.py, test_parallel_cp.py)
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_supported(load_config(None, ["data.builtin=stdlib", "train.bptt=true", "parallel.tp=2"]))
    check_supported(load_config(None, ["data.builtin=stdlib", "train.bptt=true", "train.global_batch=8"]))

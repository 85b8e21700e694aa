"""What the trainer relies on: canonical init, precision policy and weight-decay groups, the loss, gradients."""
import math

import pytest
import torch
import torch.nn.functional as F

from megassm.config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig
from megassm.models import build_model

V = 101


def tiny(pattern="M*M-", **kw):
    mamba = kw.pop("mamba", {})
    attn = kw.pop("attn", {})
    mlp = kw.pop("mlp", {})
    return ModelConfig(
        pattern=pattern,
        d_model=32,
        mamba=MambaConfig(d_state=8, headdim=8, chunk_size=8, ngroups=2, **mamba),
        attn=AttentionConfig(n_heads=4, n_kv_heads=2, **attn),
        mlp=MLPConfig(ffn_hidden=64, **mlp),
        **kw,
    )


def make(cfg, seed=0, device=None):
    m = build_model(cfg, vocab_size=V, device=device)
    m.init_weights(seed)
    return m


def sd_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k].dtype)) for k in sa)


# ----------------------------------------------------------------------------------------------------
# canonical init
# ----------------------------------------------------------------------------------------------------


def test_canonical_init_is_a_function_of_the_seed():
    cfg = tiny(tie_embeddings=False)
    a, b, c = make(cfg, 1), make(cfg, 1), make(cfg, 2)
    assert sd_equal(a, b)
    sa, sc = a.state_dict(), c.state_dict()
    for k in sa:
        if "norm" in k or k.endswith(".D"):
            assert torch.equal(sa[k], sc[k])  # constants
        else:
            assert not torch.equal(sa[k], sc[k]), k
    # global RNG state plays no part
    torch.manual_seed(123)
    d = make(cfg, 1)
    assert sd_equal(a, d)


def test_canonical_init_independent_of_device_dtype_and_layout():
    cfg = tiny()
    ref = make(cfg, 5)
    meta = build_model(cfg, vocab_size=V, device="meta")
    meta.to_empty(device="cpu")
    meta.init_weights(5)
    assert sd_equal(ref, meta)
    as64 = build_model(cfg, vocab_size=V).double()
    as64.init_weights(5)
    assert sd_equal(as64, ref)  # drawn in fp32, so fp64 holds exactly the same values
    bf = build_model(cfg, vocab_size=V).to(torch.bfloat16)
    bf.init_weights(5)
    for k, v in bf.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k].to(torch.bfloat16)), k
    # a parameter's value depends on its name only, not on the rest of the model
    other = make(tiny("M*M-M-M"), 5)
    names = ("layers.0.mixer.in_proj.weight", "layers.1.mixer.q_proj.weight", "layers.2.mixer.A_log", "embedding.weight")
    for k in names:
        assert torch.equal(other.state_dict()[k], ref.state_dict()[k]), k


@pytest.mark.parametrize("pattern,tie", [("M*M-", True), ("M*|M-", False), ("MM*M", True)])
def test_layers_keep_module_list_names(pattern, tie):
    """model.layers is keyed by global block index (a pipeline stage drops blocks, the rest keep their names):
    the state dict is the one an nn.ModuleList of the same blocks gives, key for key and in order."""
    from torch import nn

    m = make(tiny(pattern, tie_embeddings=tie))
    keys = list(m.state_dict())
    as_list = make(tiny(pattern, tie_embeddings=tie))
    as_list.layers = nn.ModuleList(list(as_list.layers))
    assert keys == list(as_list.state_dict())
    assert [k for k in keys if k.startswith("layers.")][0].startswith("layers.0.")
    assert m.layers.keys() == list(range(m.n_layers)) and m.layers[1] is list(m.layers)[1]


def test_init_distributions():
    cfg = ModelConfig(pattern="MM*-", d_model=256, mamba=MambaConfig(d_state=16, headdim=16),
                      attn=AttentionConfig(n_heads=4), mlp=MLPConfig(ffn_hidden=512))
    m = make(cfg, 0)
    mix = m.layers[0].mixer
    mc = cfg.mamba
    A = torch.exp(mix.A_log)
    assert (A >= mc.A_init_min).all() and (A <= mc.A_init_max).all()
    dt = F.softplus(mix.dt_bias)
    assert (dt >= mc.dt_min * 0.999).all() and (dt <= mc.dt_max * 1.001).all()
    assert torch.equal(mix.D, torch.ones_like(mix.D))
    assert torch.equal(mix.norm.weight, torch.ones_like(mix.norm.weight))
    assert mix.in_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    scaled = 0.02 / math.sqrt(2 * 4)
    for w in (mix.out_proj.weight, m.layers[2].mixer.o_proj.weight, m.layers[3].mixer.w2.weight):
        assert w.std().item() == pytest.approx(scaled, rel=0.05)
    bound = 1 / math.sqrt(mc.d_conv)
    assert mix.conv1d.weight.abs().max() <= bound and mix.conv1d.weight.abs().max() > 0.8 * bound
    assert m.embedding.weight.std().item() == pytest.approx(0.02, rel=0.05)


# ----------------------------------------------------------------------------------------------------
# precision policy and optimizer groups
# ----------------------------------------------------------------------------------------------------


def test_fp32_params_and_weight_decay_groups():
    cfg = tiny(tie_embeddings=False, mamba=dict(proj_bias=True), attn=dict(bias=True), mlp=dict(bias=True))
    m = make(cfg)
    assert all(p.dtype == torch.float32 for p in m.parameters())  # fp32 master weights
    no_wd = m.no_weight_decay_names()
    for name, p in m.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        special = leaf in ("A_log", "dt_bias", "D", "bias") or "norm" in name
        assert (name in no_wd) == special, name
        assert getattr(p, "_no_weight_decay", False) == special, name
    groups = m.param_groups(0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(m.parameters()))
    decayed = {id(p) for p in groups[0]["params"]}
    assert id(m.embedding.weight) in decayed and id(m.lm_head.weight) in decayed
    assert id(m.layers[0].mixer.conv1d.weight) in decayed and id(m.layers[0].mixer.A_log) not in decayed
    torch.optim.AdamW(groups, lr=1e-3)  # the groups are valid AdamW groups


def test_residual_stream_fp32_under_bf16_autocast():
    m = make(tiny())
    seen = []
    for layer in m.layers:
        layer.register_forward_hook(lambda mod, args, out: seen.append(out[1].dtype))
    tok = torch.randint(0, V, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(tok, seq_idx=torch.tensor([[0] * 8 + [1] * 8] * 2), labels=tok, return_states=True)
    assert seen == [torch.float32] * 4
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    assert out.states[0].ssm.dtype == torch.float32 and out.states[0].conv.dtype == torch.float32
    for name in ("A_log", "dt_bias", "D"):
        assert getattr(m.layers[0].mixer, name).dtype == torch.float32


# ----------------------------------------------------------------------------------------------------
# loss and gradients
# ----------------------------------------------------------------------------------------------------


def test_loss_matches_cross_entropy_on_logits():
    m = make(tiny())
    tok = torch.randint(0, V, (2, 12))
    labels = torch.randint(0, V, (2, 12))
    labels[0, :3] = -100
    labels[1, -1] = -100
    seq_idx = torch.tensor([[0] * 5 + [1] * 7, [2] * 12])
    out = m(tok, seq_idx=seq_idx, labels=labels)
    assert out.logits is None and out.loss.dim() == 0 and out.loss.dtype == torch.float32
    logits = m(tok, seq_idx=seq_idx).logits
    assert logits.shape == (2, 12, m.vocab_size_padded) and out.loss is not None
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, ref, rtol=1e-6, atol=0)
    none = m(tok, labels=torch.full_like(labels, -100)).loss
    assert none.item() == 0.0


@pytest.mark.parametrize("tie", [True, False])
def test_gradients_reach_every_parameter(tie):
    cfg = tiny("M*-M", tie_embeddings=tie, mamba=dict(proj_bias=True), attn=dict(bias=True, sliding_window=5),
               mlp=dict(bias=True))
    m = make(cfg)
    tok = torch.randint(0, V, (2, 12))
    seq_idx = torch.tensor([[0] * 5 + [1] * 7, [2] * 12])
    out = m(tok, seq_idx=seq_idx, labels=tok, states=m.allocate_states(2))
    out.loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_gradients_flow_into_carried_states():
    """BPTT later: the initial states get gradients (the kernels' backward covers initial_states)."""
    m = make(tiny("M*M-", attn=dict(sliding_window=4)))
    tok = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        states = m(tok, return_states=True).states
    leaves = []
    for s in states:
        if s is not None and hasattr(s, "ssm"):
            s.ssm.requires_grad_(True)
            s.conv.requires_grad_(True)
            leaves += [s.ssm, s.conv]
    m(tok, labels=tok, states=states).loss.backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in leaves)

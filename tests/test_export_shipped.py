"""Every shipped config (configs/*.yaml, configs/recipes/*.yaml) exports exactly (docs/interop.md "Which class each
shipped config exports to"). Each is cut down to a tiny width and the first blocks of its pattern, with the same
letters in the same arrangement and every other option as shipped (RoPE or none, GQA ratio, ngroups, tied or not,
vocabulary padding); megassm-export writes it as the class the docs name, transformers loads it with no missing or
unexpected keys and its fp32 logits on two one-document sequences are within 1e-4 of ours, and model.init_from
reads the export back to identical weights. The GraniteMoeHybrid options no shipped config uses go through the
same checks on tiny.yaml's reduced model."""
import os
import subprocess
import sys
from glob import glob

import pytest
import torch

from compare import worst
from megassm.config import attn_dims, blocks_of, dump_config, ffn_hidden, load_config, mamba_dims
from megassm.interop import mapping, sources
from megassm.models import build_model
from megassm.training import checkpoint as ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(glob(os.path.join(ROOT, "configs", "*.yaml"))
                 + glob(os.path.join(ROOT, "configs", "recipes", "*.yaml")))
# the class docs/interop.md gives each family of shipped configs (by file name)
CLASS = {"mamba2-": "Mamba2ForCausalLM", "hybrid-": "GraniteMoeHybridForCausalLM",
         "tiny": "GraniteMoeHybridForCausalLM"}
# what the reduction changes: sizes only
SIZES = {"pattern", "d_model", "vocab_size", "mamba.d_state", "mamba.chunk_size", "mamba.headdim", "attn.head_dim",
         "mlp.ffn_hidden"}
VOCAB, SEQ, TOL, QK_SCALE = 300, 37, 1e-4, 20.0
# what else GraniteMoeHybridForCausalLM takes, on tiny.yaml's reduced model
OPTIONS = {
    "tiny.yaml + attention first, attention biases, head_dim 12 (not d_model / heads), rope_theta 5000, dt_limit, "
    "Mamba projection biases, no conv bias, untied": [
        "model.pattern=*-M*M-", "model.attn.bias=true", "model.attn.head_dim=12", "model.attn.rope_theta=5000",
        "model.mamba.dt_limit=[0.001,5.0]", "model.mamba.proj_bias=true", "model.mamba.conv_bias=false",
        "model.tie_embeddings=false"],
    "tiny.yaml without MLP blocks (zero-width MLPs)": ["model.pattern=M*M*"],
}


def _name(path):
    return os.path.relpath(path, os.path.join(ROOT, "configs"))


def _expected_class(path):
    base = os.path.basename(path)
    found = [c for prefix, c in CLASS.items() if base.startswith(prefix)]
    assert found, f"{_name(path)}: a new shipped config: add its class to CLASS and to docs/interop.md"
    return found[0]


def _first_blocks(kinds):
    """The shortest prefix holding every letter, with the `-` after its last mixer; at least two blocks."""
    n = max(kinds.index(k) for k in set(kinds)) + 1
    while n < len(kinds) and kinds[n] == "-":
        n += 1
    return "".join(kinds[:max(n, min(2, len(kinds)))])


def _reduced(path, extra=()):
    """The shipped config at a tiny width: attention heads and K/V heads as shipped at head_dim 8 (d_model = heads
    x head_dim where the shipped one is), Mamba-2 ngroups as shipped with two heads per group, the MLP's width
    ratio kept; then `extra` overrides."""
    full = load_config(path, [], validate_config=False)
    m, kinds = full.model, blocks_of(full.model.pattern)
    over = [f"model.pattern={_first_blocks(kinds)}", f"model.vocab_size={VOCAB}", "model.mamba.d_state=16",
            "model.mamba.chunk_size=16", "train.seq_len=64"]
    d = 64
    if "*" in kinds:
        a = attn_dims(m)
        d = a["n_heads"] * 8 if a["n_heads"] * a["head_dim"] == m.d_model else 64
        if m.attn.head_dim is not None:
            over.append("model.attn.head_dim=8")
    over.append(f"model.d_model={d}")
    if "M" in kinds:
        heads = m.mamba.ngroups * min(mamba_dims(m)["nheads"] // m.mamba.ngroups, 2)
        assert m.mamba.expand * d % heads == 0, path
        over.append(f"model.mamba.headdim={m.mamba.expand * d // heads}")
    if "-" in kinds:
        over.append(f"model.mlp.ffn_hidden={round(ffn_hidden(m) / m.d_model * d)}")
    return full, load_config(path, [*over, *extra], validate_config=False)


def test_every_shipped_config_maps_to_its_class_and_the_reduction_keeps_its_options():
    assert len(SHIPPED) >= 16, SHIPPED
    for path in SHIPPED:
        full, small = _reduced(path)
        cls = _expected_class(path)
        assert mapping.HF_ARCH[mapping.export_target(full.model)] == cls, _name(path)
        assert mapping.HF_ARCH[mapping.export_target(small.model)] == cls, _name(path)
        kinds = blocks_of(full.model.pattern)
        short = blocks_of(small.model.pattern)
        assert short == kinds[:len(short)] and set(short) == set(kinds), (_name(path), small.model.pattern)
        a, b = mapping._flat(full.model), mapping._flat(small.model)
        changed = {k for k in a if a[k] != b[k]}
        assert changed <= SIZES, (_name(path), changed - SIZES)


def _model(cfg, seed):
    """Seeded init with the vectors (norm weights, D, A_log, dt_bias, biases) moved off their constant init, so a
    swapped or dropped one shows (tests/test_interop.py says why the other matrices stay at their init scale), and
    q / k scaled up so that attention is far from uniform and positions (RoPE) change the logits well beyond TOL."""
    model = build_model(cfg.model)
    model.init_weights(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_SCALE)
    return model.eval()


def test_shipped_configs_export_exactly_and_import_back(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from megassm.export_cli import main as export

    cases = {}  # model config -> [config, names, class]: configs whose reduced models are the same share one export
    for path in SHIPPED:
        _, small = _reduced(path)
        cases.setdefault(repr(small.model), [small, [], _expected_class(path)])[1].append(_name(path))
    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    for name, extra in OPTIONS.items():
        _, small = _reduced(tiny, extra)
        cases[repr(small.model)] = [small, [name], "GraniteMoeHybridForCausalLM"]
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    runs = []
    for g, (cfg, names, cls) in enumerate(cases.values()):
        model = _model(cfg, seed=g + 1)
        path = ckpt.save_checkpoint(tmp_path / f"run{g}", 1, model=model, optimizer=None,
                                    extra={"config": dump_config(cfg)})
        out = str(tmp_path / f"hf{g}")
        assert export(["--checkpoint", path, "--format", "hf", "--output", out, "--no-tokenizer"]) == 0
        # model.init_from reads the export back: the same weights, bit for bit
        src = sources.open_source(out)
        sources.check_config(src, cfg.model)
        state = sources.load_state(src, model)  # reads the model's parameter shapes only
        ours = model.state_dict()
        assert sorted(state) == sorted(ours), names
        differ = [k for k in ours if not mapping.equal_tensors(state[k], ours[k])]
        assert not differ, (names, differ)
        with torch.no_grad():
            runs.append((cfg, ", ".join(names), cls, out, model(tokens).logits, model))
    # transformers in a process of its own (tests/hf_logits.py says why)
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "hf_logits_many.py"),
                        str(tmp_path / "tokens.pt"), str(tmp_path / "hf.pt"), *(run[3] for run in runs)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = torch.load(tmp_path / "hf.pt")
    diffs = {}
    for cfg, names, cls, out, ours, model in runs:
        got = theirs[out]
        assert got["class"] == cls, (names, got["class"])
        assert not any(got["info"].values()), (names, got["info"])
        assert got["logits"].shape == ours.shape, names  # [2, SEQ, the padded vocabulary]
        diffs[names] = (got["logits"] - ours).abs().max().item()  # NaN stays NaN: worst() gives inf
        if cfg.model.attn.rope and "*" in cfg.model.pattern:
            # the tolerance sees RoPE: the same model without it is far from transformers' logits
            for layer in model.layers:
                if layer.kind == "*":
                    layer.mixer.rope = False
            with torch.no_grad():
                assert (model(tokens).logits - got["logits"]).abs().max().item() > 100 * TOL, names
    print("max |logit difference|:", diffs)
    assert worst(diffs.values()) <= TOL, diffs

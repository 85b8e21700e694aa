"""megassm-export --format hf and model.init_from (megassm/interop, docs/interop.md): transformers loads the
export and computes our logits; export -> init_from -> export is bit-identical; refusals name the block and
write nothing; a mamba_ssm-layout directory imports to the same logits; mismatches name the key; init_from under
TP=2 (gloo) starts from the same weights as one process."""
import json
import re
import os
import subprocess
import sys

import pytest
import torch

from megassm.config import ConfigError, dump_config, load_config
from megassm.interop import mamba_ssm, mapping, sources
from megassm.models import build_model
from megassm.training import checkpoint as ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["data.builtin=stdlib", "model.d_model=64", "model.mamba.d_state=16", "model.mamba.headdim=16",
         "model.mamba.chunk_size=16", "model.mamba.ngroups=2", "model.attn.n_heads=4", "model.attn.n_kv_heads=2",
         "model.mlp.ffn_hidden=96"]
MAMBA = ["model.pattern=MMM", "model.tie_embeddings=false", "model.pad_vocab_multiple=48",
         "model.mamba.dt_limit=[0.001,5.0]"]
HYBRID = ["model.pattern=M*|M-", "model.attn.rope=false", "model.mlp.activation=relu2"]
SEQ = 37  # not a multiple of the SSD chunk (16)


def _cfg(*extra):
    return load_config(None, [*SMALL, *extra])


def _model(cfg, seed=3):
    """Seeded init with the vectors moved off their constant init too (norm weights, D, A_log, dt_bias, biases), so
    a swapped or dropped one shows. The matrices stay at their init scale: transformers' reference SSD (no
    mamba_ssm kernels on CPU) loses precision in fp32 as activations grow (docs/interop.md), ours does not."""
    m = build_model(cfg.model, vocab_size=257)
    m.init_weights(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m


def _checkpoint(tmp_path, cfg, model, name="run", sharded=False):
    run = tmp_path / name
    path = ckpt.save_checkpoint(run, 5, model=model, optimizer=None, extra={"config": dump_config(cfg)})
    if sharded:
        from megassm.checkpoint_cli import convert

        out = str(run / "checkpoints" / "step_00000006")
        convert(path, out, "sharded")
        return run, out
    return run, path


def _export(*args):
    from megassm.export_cli import main

    return main([*args, "--format", "hf"])


def _ours(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def _hf_logits(tmp_path, out, tokens) -> dict:
    """transformers' logits for `tokens` from the export in `out`, computed in a subprocess (tests/hf_logits.py
    says why)."""
    torch.save(tokens, tmp_path / "tokens.pt")
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "hf_logits.py"), str(out),
                        str(tmp_path / "tokens.pt"), str(tmp_path / "hf_logits.pt")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(tmp_path / "hf_logits.pt")


def _rel(a, b):
    return ((a - b).abs().max() / a.abs().max()).item()


@pytest.mark.parametrize("kind", ["mamba2", "hybrid"])
def test_transformers_loads_export_with_our_logits(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    cfg = _cfg(*(MAMBA if kind == "mamba2" else HYBRID))
    model = _model(cfg)
    run, path = _checkpoint(tmp_path, cfg, model, sharded=kind == "hybrid")  # the hybrid from a sharded one
    out = tmp_path / "hf"
    assert _export("--run" if kind == "hybrid" else "--checkpoint", str(run if kind == "hybrid" else path),
                   "--output", str(out)) == 0
    tokens = torch.randint(0, 257, (2, SEQ), generator=torch.Generator().manual_seed(0))
    theirs = _hf_logits(tmp_path, out, tokens)
    assert not any(theirs["info"].values()), theirs["info"]
    assert theirs["class"] == ("Mamba2ForCausalLM" if kind == "mamba2" else "NemotronHForCausalLM")
    ours = _ours(model, tokens)
    theirs = theirs["logits"]
    assert theirs.shape == ours.shape  # the padded vocabulary
    assert _rel(ours, theirs) <= 1e-5
    # the byte-level tokenizer travels, exactly
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "déjà vu\n\tdef f(): 日本 🙂"
    assert tok.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
    assert tok.eos_token_id == 256 and json.loads((out / "config.json").read_text())["eos_token_id"] == 256
    assert "AutoTokenizer" in (out / "README.md").read_text()


# configs/tiny.yaml's layout (RoPE, SwiGLU, mixers without an MLP): GraniteMoeHybridForCausalLM
GRANITE = ["model.pattern=M*|M-", "model.attn.rope=true"]


@pytest.mark.parametrize("layout", ["nemotron_h", "granitemoehybrid"])
def test_export_import_export_is_bit_identical(tmp_path, layout):
    pytest.importorskip("transformers")
    from megassm.training.trainer import Trainer

    tiny = [*(HYBRID if layout == "nemotron_h" else GRANITE), "model.tie_embeddings=true", "train.seq_len=48",
            "train.micro_batch=2", "train.global_batch=2", "train.eval_interval=0", "run.progress=false",
            "run.tensorboard=false", "train.steps=1", "train.device=cpu"]
    cfg = _cfg(*tiny)
    _, path = _checkpoint(tmp_path, cfg, _model(cfg))
    assert _export("--checkpoint", path, "--output", str(tmp_path / "a")) == 0
    # init_from through the trainer: its step-0 checkpoint holds the imported weights
    tr = Trainer(_cfg(*tiny, f"run.dir={tmp_path / 'cont'}", f"model.init_from={tmp_path / 'a'}"))
    assert tr.step == 0
    tr.checkpoints.save(tr.step)
    tr.close()
    assert _export("--run", str(tmp_path / "cont"), "--output", str(tmp_path / "b")) == 0
    for f in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert json.loads((tmp_path / "a" / "config.json").read_text())["architectures"] == [mapping.HF_ARCH[layout]]


@pytest.mark.parametrize("extra,block", [
    (["model.pattern=MMCM"], "block 2 'C'"),
    (["model.pattern=M|B"], "block 1 'B'"),
    (["model.pattern=LM"], "block 0 'L'"),
    (["model.pattern=MS"], "block 1 'S'"),
    # RoPE: no Nemotron-H; relu2: no GraniteMoeHybrid
    (["model.pattern=M*-", "model.attn.rope=true", "model.mlp.activation=relu2"],
     "block 1 '*': attention uses RoPE (model.attn.rope=true), where NemotronHForCausalLM"),
    (["model.pattern=M*", "model.attn.rope=false", "model.attn.sliding_window=8"], "block 1 '*': sliding-window"),
    # SwiGLU: no Nemotron-H; an MLP after an MLP: no GraniteMoeHybrid layer
    (["model.pattern=M--"], "block 1 '-': model.mlp.activation=swiglu, where NemotronHForCausalLM's MLP is a "
                            "squared ReLU without a gate (and 1 more block); block 2 '-': an MLP that does not "
                            "directly follow"),
    (["model.pattern=-M"], "block 0 '-': an MLP that does not directly follow an M or * block"),
    (["model.pattern=M*-", "model.mlp.bias=true", "model.attn.rope=false"],
     "block 2 '-': model.mlp.bias=true, where GraniteMoeHybridForCausalLM's MLP has no bias"),
    (["model.pattern=MM", "model.mamba.D_has_hdim=true"], "block 0 'M': model.mamba.D_has_hdim"),
])
def test_refused_patterns_write_nothing_and_name_the_block(tmp_path, capsys, extra, block):
    cfg = _cfg(*extra)
    with pytest.raises(mapping.NotExportable, match=re.escape(block)):
        mapping.export_target(cfg.model)
    if extra[0] in ("model.pattern=MMCM", "model.pattern=M*"):  # through the CLI: exit 2, nothing at OUT
        _, path = _checkpoint(tmp_path, cfg, build_model(cfg.model, vocab_size=257))
        out = tmp_path / "out" / "hf"
        out.parent.mkdir()
        assert _export("--checkpoint", path, "--output", str(out)) == 2
        assert block in capsys.readouterr().err
        assert os.listdir(out.parent) == []


def test_granite_layers_and_what_their_import_refuses():
    """Each GraniteMoeHybrid layer is a mixer and the `-` right after it; a mixer without one gets an all-zero MLP
    (or, with no `-` in the pattern, zero-width ones), which the import reads back as no block, refusing one that
    is not zero. A GraniteMoeHybrid config.json that computes something else (experts, multipliers, another
    attention scale, scaled RoPE) is refused by key; one without megassm_pattern is a mixer and an MLP per layer."""
    assert mapping.granite_layers("M*M-") == [(0, None), (1, None), (2, 3)]
    assert mapping.granite_layers("M-|*-") == [(0, 1), (2, 3)] and mapping.granite_layers("M--") == 2
    cfg = _cfg("model.pattern=M*M-", "model.attn.rope=true", "model.attn.rope_theta=5000")
    assert mapping.export_target(cfg.model) == "granitemoehybrid"
    state = _model(cfg).state_dict()
    kwargs, hf = mapping.to_hf(state, cfg.model, "granitemoehybrid", 384)
    raw = {"model_type": "granitemoehybrid", **kwargs}
    assert kwargs["layer_types"] == ["mamba", "attention", "mamba"] and kwargs["shared_intermediate_size"] == 96
    assert not hf["model.layers.1.shared_mlp.input_linear.weight"].any()
    m, back = mapping.from_hf(raw, hf)
    assert m.pattern == "M*M-" and m.attn.rope and m.attn.rope_theta == 5000.0
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)
    hf["model.layers.0.shared_mlp.output_linear.weight"] = torch.ones(64, 96)
    with pytest.raises(mapping.MappingError, match=r"model.layers.0.shared_mlp.output_linear.weight' is not zero, "
                                                   r"but megassm_pattern 'M\*M-' has no MLP after block 0"):
        mapping.from_hf(raw, hf)
    no_mlp = mapping.to_hf(_model(_cfg("model.pattern=M*")).state_dict(), _cfg("model.pattern=M*").model,
                           "granitemoehybrid", 384)
    assert no_mlp[0]["shared_intermediate_size"] == 0
    assert no_mlp[1]["model.layers.0.shared_mlp.input_linear.weight"].shape == (0, 64)
    foreign = {k: v for k, v in raw.items() if k != "megassm_pattern"}
    assert mapping.hf_model_config(foreign)[1].pattern == "M-*-M-"
    for key, value, why in (("num_local_experts", 4, "megassm builds no MoE layers"),
                            ("embedding_multiplier", 12.0, "no such multiplier"),
                            ("attention_multiplier", 0.015625, "scales by 1/sqrt"),
                            ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "the default \\(unscaled\\)"),
                            ("megassm_pattern", "MM-M", "does not fit layer_types")):
        with pytest.raises(mapping.MappingError, match=f"{key}=.*{why}|{why}"):
            mapping.hf_model_config({**raw, key: value})


def test_mamba_ssm_layout_imports_to_the_same_logits(tmp_path):
    cfg = _cfg("model.pattern=MM", "model.pad_vocab_multiple=16")
    model = _model(cfg)
    ssm_cfg, ssm_state = mamba_ssm.to_mamba_ssm(model.state_dict(), cfg.model, vocab=257)
    d = tmp_path / "mamba2-tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(ssm_cfg))
    torch.save({k: v.clone() for k, v in ssm_state.items()}, d / "pytorch_model.bin")
    assert "backbone.layers.1.mixer.conv1d.weight" in ssm_state and ssm_state["lm_head.weight"] is not None
    src = sources.open_source(str(d))
    assert src.kind == "mamba_ssm"
    sources.check_config(src, cfg.model)
    fresh = build_model(cfg.model, vocab_size=257, device="meta")
    state = sources.load_state(src, fresh)
    again = build_model(cfg.model, vocab_size=257)
    again.load_state_dict(state, strict=True)
    tokens = torch.randint(0, 257, (2, SEQ))
    assert torch.equal(_ours(model, tokens), _ours(again, tokens))
    # a mamba_ssm Mamba-1 checkpoint (ssm_cfg.layer absent) is refused by name
    (d / "config.json").write_text(json.dumps({**ssm_cfg, "ssm_cfg": {}}))
    with pytest.raises(sources.InitFromError, match="ssm_cfg.layer is 'Mamba1'"):
        sources.open_source(str(d))


def test_init_from_mismatches_name_the_key_and_both_values(tmp_path):
    cfg = _cfg("model.pattern=MM")
    _, path = _checkpoint(tmp_path, cfg, _model(cfg))
    src = sources.open_source(path)  # a megassm checkpoint
    with pytest.raises(ConfigError, match=r"model.d_model: 64 in the source, 32 in this run"):
        sources.check_config(src, _cfg("model.pattern=MM", "model.d_model=32").model)
    with pytest.raises(ConfigError, match=r"model.pattern: 'MM' in the source, 'MMM' in this run"):
        sources.check_config(src, _cfg("model.pattern=MMM").model)
    sources.check_config(src, _cfg("model.pattern=M|M", "model.mamba.chunk_size=32").model)  # same weights
    other_vocab = build_model(_cfg("model.pattern=MM", "model.pad_vocab_multiple=64").model, vocab_size=257,
                              device="meta")
    with pytest.raises(ConfigError, match=r"'embedding.weight' is \[384, 64\] in the source, \[320, 64\]"):
        sources.load_state(src, other_vocab)
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=f"model.init_from: {missing} does not exist"):
        sources.open_source(str(missing))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="unrecognised layout"):
        sources.open_source(str(tmp_path / "odd"))
    with pytest.raises(ConfigError, match="model.init_from"):  # the trainer refuses before any device work
        from megassm.training.trainer import Trainer

        Trainer(_cfg("model.pattern=MM", f"model.init_from={missing}", f"run.dir={tmp_path / 'r'}"))


def test_relu2_mlp_default_unchanged():
    cfg = _cfg("model.pattern=M-")
    assert cfg.model.mlp.activation == "swiglu"
    assert build_model(cfg.model, vocab_size=257).layers[1].mixer.w3 is not None
    m = build_model(_cfg("model.pattern=M-", "model.mlp.activation=relu2").model, vocab_size=257)
    assert m.layers[1].mixer.w3 is None and "layers.1.mixer.w3.weight" not in m.state_dict()
    with pytest.raises(ConfigError, match="model.mlp.activation must be swiglu or relu2"):
        _cfg("model.pattern=M-", "model.mlp.activation=gelu")


def test_init_from_under_tp2_starts_from_the_same_weights(tmp_path):
    """The canonical weights are loaded on every rank before the TP plan: the first loss equals one process'."""
    pytest.importorskip("safetensors")
    pytest.importorskip("transformers")
    from multiproc import losses, run_train
    from megassm.training.trainer import Trainer

    tiny = [*HYBRID, "train.seq_len=48", "train.micro_batch=2", "train.global_batch=2", "train.eval_interval=0",
            "train.log_interval=1", "run.progress=false", "run.tensorboard=false", "train.steps=1",
            "train.device=cpu", "run.save_final=false"]
    cfg = _cfg(*tiny)
    _, path = _checkpoint(tmp_path, cfg, _model(cfg, seed=11))
    assert _export("--checkpoint", path, "--output", str(tmp_path / "src"), "--no-tokenizer") == 0
    init = f"model.init_from={tmp_path / 'src'}"

    def one(name, *extra):
        tr = Trainer(_cfg(*tiny, f"run.dir={tmp_path / name}", *extra))
        loss = tr.train_step().loss
        tr.close()
        return loss

    single, seeded = one("single", init), one("seeded")
    assert abs(single - seeded) > 1e-3  # the imported weights, not the seeded init
    (tmp_path / "empty.yaml").write_text("{}\n")
    tp2 = losses(run_train(ROOT, ["--config", str(tmp_path / "empty.yaml"), *SMALL, *tiny, init, "parallel.tp=2",
                                  f"run.dir={tmp_path / 'tp2'}"], 2, timeout=300))
    assert abs(tp2[1] - single) <= 1e-5 * abs(single), (tp2, single)


def test_file_tokenizers_travel_exactly(tmp_path):
    """tokenizer.json (its BOS post-processor dropped: training added none) and SentencePiece .model exports give
    megassm's ids through AutoTokenizer (write_tokenizer verifies on probes and raises otherwise)."""
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    spm = pytest.importorskip("sentencepiece")
    from megassm.data_tools.tokenizers import load_tokenizer
    from megassm.interop.tokenizer import write_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over déjà vu" for i in range(200)))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.train([str(corpus)], tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                   model_type="bpe", minloglevel=2)
    from transformers import AutoTokenizer

    for spec in (tmp_path / "tokenizer.json", tmp_path / "sp.model"):
        out = tmp_path / ("out-" + spec.name)
        out.mkdir()
        write_tokenizer(str(spec), str(out))
        text = "the lazy fox, déjà vu 42"
        assert AutoTokenizer.from_pretrained(out).encode(text) == load_tokenizer(str(spec)).encode(text)

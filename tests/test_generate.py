"""Generation (megassm/evaluation/generation.py, megassm-generate): greedy decoding through the recurrent step
equals the argmax of the full forward, token by token; sampling is reproducible; top-k=1 is greedy."""
import json

import pytest
import torch

from megassm.config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig, load_config
from megassm.evaluation.generation import check_decodable, filter_logits, generate
from megassm.models import build_model

V = 50


def _model(pattern: str, window: int = 0):
    cfg = ModelConfig(pattern=pattern, d_model=32, mamba=MambaConfig(d_state=8, headdim=8, chunk_size=4),
                      attn=AttentionConfig(n_heads=2, sliding_window=window), mlp=MLPConfig(ffn_hidden=48))
    model = build_model(cfg, vocab_size=V)
    model.init_weights(3)
    return model.eval()


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (7, 3, 7, 12)]


@pytest.mark.parametrize("pattern,window", [("MM", 0), ("M*M-", 0), ("M*M-", 5)])
def test_greedy_equals_argmax_of_full_forward(pattern, window):
    model = _model(pattern, window)
    prompts = _prompts()
    gen = generate(model, prompts, max_new_tokens=9)
    assert gen.stopped == ["length"] * 4 and all(len(t) == 9 for t in gen.tokens)
    with torch.no_grad():
        for p, new in zip(prompts, gen.tokens):
            seq = torch.tensor(p + new)[None]
            logits = model(seq).logits[0, :, :V]
            # the token after position len(p) - 1 + i is new[i]
            want = logits[len(p) - 1 : len(p) - 1 + len(new)].argmax(-1).tolist()
            assert new == want
    # one prompt at a time gives the same tokens as the batch (cat_states pads the shorter KV caches)
    alone = [generate(model, [p], max_new_tokens=9).tokens[0] for p in prompts]
    assert alone == gen.tokens


def test_eos_and_stop_end_rows_and_finished_rows_leave_the_batch():
    model = _model("M*M-")
    prompts = _prompts()
    full = generate(model, prompts, max_new_tokens=8).tokens
    eos = full[1][2]  # row 1's third token plays EOS
    gen = generate(model, prompts, max_new_tokens=8, eos_id=eos, stop=lambda i, ids: i == 3 and len(ids) == 4)
    for i, toks in enumerate(full):
        cut = toks.index(eos) + 1 if eos in toks else len(toks)
        if i == 3:
            cut = min(cut, 4)
        assert gen.tokens[i] == toks[:cut]
    assert gen.stopped[1] == "eos" and gen.stopped[3] in ("stop", "eos")


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = _model("M*M-")
    prompts = _prompts()
    greedy = generate(model, prompts, max_new_tokens=6).tokens
    a = generate(model, prompts, max_new_tokens=6, temperature=1.5, top_p=0.9, seed=7).tokens
    b = generate(model, prompts, max_new_tokens=6, temperature=1.5, top_p=0.9, seed=7).tokens
    c = generate(model, prompts, max_new_tokens=6, temperature=1.5, top_p=0.9, seed=8).tokens
    assert a == b and a != c and a != greedy
    assert generate(model, prompts, max_new_tokens=6, temperature=2.0, top_k=1, seed=1).tokens == greedy
    # every sampled id is a real vocabulary entry (the padded rows are never drawn)
    assert all(0 <= t < V for row in a + c for t in row)


def test_filter_logits_top_k_and_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.1)).tolist() == [[False, True, True, True]]


def test_a_mixer_without_step_is_refused_by_name():
    model = _model("M*M-")
    model.layers[1].mixer.step = None
    with pytest.raises(ValueError, match=r"block 1 `\*` \(attention\): no step"):
        check_decodable(model)


def test_megassm_generate_on_a_tiny_checkpoint(tmp_path, capsys):
    from megassm.generate_cli import main
    from megassm.training.trainer import Trainer

    run = tmp_path / "run"
    cfg = load_config(None, [
        "data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=32", "model.mamba.d_state=8",
        "model.mamba.headdim=8", "model.mamba.chunk_size=8", "model.attn.n_heads=2", "model.mlp.ffn_hidden=64",
        "train.seq_len=32", "train.micro_batch=2", "train.global_batch=2", "train.steps=2", "train.eval_interval=0",
        "run.progress=false", "run.tensorboard=false", "data.prefetch=0", f"run.dir={run}",
    ])
    Trainer(cfg).fit()
    argv = ["--run", str(run), "--prompt", "def f(", "--prompt", "import", "--max-new-tokens", "5", "--json",
            "--ignore-eos"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == ["def f(", "import"] and all(len(r["tokens"]) == 5 for r in rows)
    assert rows[0]["prompt_tokens"] == list(b"def f(") and rows[0]["step"] == 2
    # the same greedy tokens from the checkpoint directory itself; seeded sampling repeats
    ck = run / "checkpoints" / "step_00000002"
    assert main(["--checkpoint", str(ck)] + argv[2:]) == 0
    assert [json.loads(x)["tokens"] for x in capsys.readouterr().out.splitlines()] == [r["tokens"] for r in rows]
    samp = ["--temperature", "1", "--top-k", "20", "--seed", "3"]
    outs = []
    for _ in range(2):
        assert main(argv + samp) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert main(["--run", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "no such directory" in capsys.readouterr().err

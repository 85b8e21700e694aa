"""megassm-eval harness (megassm/evaluation/harness.py): lm-evaluation-harness through its Python API on a tiny
checkpoint, offline, with local JSON tasks; our loglikelihoods against a direct computation from the logits."""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from megassm.config import dump_config, load_config
from megassm.models import build_model
from megassm.training import checkpoint as ckpt

lm_eval = pytest.importorskip("lm_eval")

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

MC = [
    {"q": "2 + 2 =", "choices": ["4", "5", "22"], "label": 0},
    {"q": "The sky is", "choices": ["blue", "green"], "label": 0},
    {"q": "def f(x): return", "choices": ["x", "None", "f(x)"], "label": 2},
]
GEN = [{"q": "Say hi:", "a": "hi"}, {"q": "Count: 1 2", "a": "3"}]


def _tiny_checkpoint(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, [
        "model.pattern=M*M-", "model.d_model=32", "model.mamba.d_state=8", "model.mamba.headdim=8",
        "data.builtin=stdlib", "model.mamba.chunk_size=4", "model.attn.n_heads=2", "model.mlp.ffn_hidden=48",
        "train.seq_len=16",
        f"run.dir={run}",
    ])
    model = build_model(cfg.model, vocab_size=257)
    model.init_weights(5)
    path = ckpt.save_checkpoint(str(run), 7, model=model, optimizer=None, extra={"config": dump_config(cfg)})
    return run, path, model.eval()


def _tasks(tmp_path):
    d = tmp_path / "tasks"
    d.mkdir()
    for name, rows in (("mc.jsonl", MC), ("gen.jsonl", GEN)):
        with open(d / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    (d / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    (d / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
""")
    return d


def _direct_loglik(model, context: str, continuation: str) -> tuple[float, bool]:
    ctx, cont = list(context.encode()), list(continuation.encode())
    seq = torch.tensor(ctx + cont)[None]
    with torch.no_grad():
        logp = F.log_softmax(model(seq[:, :-1]).logits[0, :, :257].double(), -1)
    lp = logp[len(ctx) - 1:]
    tgt = torch.tensor(cont)
    return float(lp.gather(-1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all())


def test_harness_loglikelihoods_and_generation_match_the_model(tmp_path):
    from megassm.evaluation.generation import generate
    from megassm.evaluation.harness import run_harness
    from megassm.evaluation.loading import load_trained

    run, path, model = _tiny_checkpoint(tmp_path)
    tasks = _tasks(tmp_path)
    trained = load_trained(run=str(run), device="cpu")
    assert trained.step == 7 and trained.tokenizer.name == "byte"
    res = run_harness(trained, ["tiny_mc", "tiny_gen"], batch_size=2, include_path=str(tasks),
                      include_defaults=False, log_samples=True, bootstrap_iters=0)
    samples = res["samples"]["tiny_mc"]
    assert len(samples) == len(MC)
    n_correct = 0
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        doc = MC[s["doc_id"]]
        got = [r[0] for r in s["resps"]]
        # the harness asks for (question, " " + choice): its default target delimiter is a space
        assert [tuple(a) for a in s["arguments"]] == [(doc["q"], " " + c) for c in doc["choices"]]
        want = [_direct_loglik(model, doc["q"], " " + c) for c in doc["choices"]]
        for (g_ll, g_greedy), (w_ll, w_greedy) in zip(got, want):
            assert math.isclose(float(g_ll), w_ll, rel_tol=1e-5, abs_tol=1e-4) and bool(g_greedy) == w_greedy
        n_correct += int(max(range(len(want)), key=lambda i: want[i][0]) == doc["label"])
    assert math.isclose(res["results"]["tiny_mc"]["acc,none"], n_correct / len(MC))
    # generate_until: the greedy decode of the context, cut at the first stop string
    gens = sorted(res["samples"]["tiny_gen"], key=lambda s: s["doc_id"])
    for s in gens:
        new = generate(model, [list(GEN[s["doc_id"]]["q"].encode())], 6, eos_id=256).tokens[0]
        text = bytes(t for t in new if t < 256).decode("utf-8", errors="replace")
        for stop in ("\n", "."):
            text = text.split(stop, 1)[0]
        assert s["resps"][0][0] == text
    assert "exact_match,none" in res["results"]["tiny_gen"]


def test_rolling_loglikelihood_in_chunks_equals_one_forward(tmp_path):
    from megassm.evaluation.harness import MegassmLM
    from megassm.evaluation.loading import load_trained

    run, _, model = _tiny_checkpoint(tmp_path)
    lm = MegassmLM(load_trained(run=str(run), device="cpu"), chunk=5)
    text = "import os\nprint(os.getcwd())\n"
    ids = [256] + list(text.encode())

    class Req:
        args = (text,)

    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor(ids[:-1])[None]).logits[0, :, :257].double(), -1)
    want = float(logp.gather(-1, torch.tensor(ids[1:])[:, None]).sum())
    assert math.isclose(lm.loglikelihood_rolling([Req()])[0], want, rel_tol=1e-5)
    # trailing spaces of a context move to the continuation; an empty context is the EOS token
    assert lm.encode_pair("a b ", "c") == (list(b"a b"), list(b" c"))
    assert lm.encode_pair("", "xy") == ([256], list(b"xy"))


def test_cli_harness_writes_results_and_old_eval_form_still_parses(tmp_path, capsys):
    from megassm.evaluation.cli import build_parser, main

    run, path, _ = _tiny_checkpoint(tmp_path)
    tasks = _tasks(tmp_path)
    out = tmp_path / "res.json"
    rc = main(["harness", "--checkpoint", path, "--tasks", "tiny_mc", "--include-path", str(tasks),
               "--no-builtin-tasks", "--limit", "2", "--bootstrap-iters", "0", "--output", str(out)])
    assert rc == 0
    res = json.load(open(out))
    assert res["step"] == 7 and res["n-samples"]["tiny_mc"]["effective"] == 2 and "acc,none" in res["results"]["tiny_mc"]
    assert "tiny_mc: acc=" in capsys.readouterr().out
    # `megassm-eval --run X` is still the context evaluation
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--run", "x"])  # the parser itself wants a subcommand ...
    assert main(["--run", str(tmp_path / "missing")]) == 2  # ... main() inserts `context`
    assert "config file not found" in capsys.readouterr().err
    assert main(["harness", "--run", str(tmp_path / "missing"), "--tasks", "x"]) == 2


def test_missing_lm_eval_is_named(monkeypatch, capsys):
    import sys

    from megassm.evaluation.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    assert main(["harness", "--run", "x", "--tasks", "t"]) == 2
    assert "pip install 'megassm[eval]'" in capsys.readouterr().err

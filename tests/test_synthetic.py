"""Synthetic tasks (megassm/synthetic): each generator's defining property, determinism, the accuracy
metric, and the runner end to end at toy size."""
import json

import numpy as np
import pytest
import torch

from megassm.synthetic import run as R
from megassm.synthetic.tasks import IGNORE, coffee_induction, induction_heads, make_batch, mqar, selective_copying


def rng(seed=0):
    return np.random.default_rng(seed)


def test_induction_heads_answer_follows_the_first_trigger():
    b = induction_heads(rng(), 64, 40, vocab=16)
    tok, lab = b["tokens"], b["labels"]
    assert tok.shape == lab.shape == (64, 40) and tok.max() <= 15 and tok.min() >= 0
    assert (lab[:, :-1] == IGNORE).all() and (tok[:, -1] == 15).all()
    for t, y in zip(tok, lab[:, -1]):
        first = np.flatnonzero(t == 15)
        assert len(first) == 2  # the trigger occurs exactly twice
        assert y == t[first[0] + 1] and y != 15


def test_coffee_induction_format():
    b = coffee_induction(rng(1), 200, 16, n_symbols=8, trigger=1)
    tok, lab = b["tokens"], b["labels"]
    assert tok.min() >= 1 and tok.max() <= 7  # pad 0 never appears
    for t, y in zip(tok, lab[:, -1]):
        trig = np.flatnonzero(t == 1)
        assert len(trig) == 2 and trig[1] == 15 and trig[0] <= 13
        assert y == t[trig[0] + 1] and y != 1
    assert len(set(lab[:, -1])) == 6  # every non-trigger symbol shows up as a target


def test_selective_copying_labels_are_the_data_in_order():
    b = selective_copying(rng(2), 8, 64, n_data=5, vocab=10)
    for t, y in zip(b["tokens"], b["labels"]):
        data = t[:59][t[:59] != 0]
        assert len(data) == 5 and (t[59:] == 9).all()
        assert (y[59:] == data).all() and (y[:59] == IGNORE).all()


def test_mqar_queries_recall_their_values():
    b = mqar(rng(3), 16, 128, n_kv=8, vocab=64)
    for t, y in zip(b["tokens"], b["labels"]):
        keys, values = t[0:16:2], t[1:16:2]
        assert len(set(keys)) == 8 and (keys < 32).all() and (values >= 32).all()
        q = np.flatnonzero(y != IGNORE)
        assert len(q) == 8 and q.min() >= 16
        for pos in q:
            assert y[pos] == values[list(keys).index(t[pos])]
    # power law: queries crowd near the pairs
    pos = np.concatenate([np.flatnonzero(y != IGNORE) for y in mqar(rng(4), 200, 512, 8, 64)["labels"]])
    assert np.median(pos) < 16 + (512 - 16) / 2


@pytest.mark.parametrize("name,params", [("induction_heads", {}), ("coffee_induction", {}),
                                         ("selective_copying", {"n_data": 4}), ("mqar", {"n_kv": 4, "vocab": 32})])
def test_generators_are_deterministic(name, params):
    a = make_batch(name, rng(7), 4, 32, params)
    b = make_batch(name, rng(7), 4, 32, params)
    c = make_batch(name, rng(8), 4, 32, params)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["tokens"], c["tokens"])


def test_bad_task_parameters_fail_clearly():
    with pytest.raises(ValueError, match="seq_len >= 3 x n_kv"):
        mqar(rng(), 1, 20, n_kv=8, vocab=64)
    with pytest.raises(ValueError, match="unknown synthetic task"):
        make_batch("copy", rng(), 1, 8, {})


def test_accuracy_on_hand_made_logits():
    logits = torch.zeros(1, 4, 5)
    logits[0, 1, 3] = 1
    logits[0, 3, 2] = 1
    labels = torch.tensor([[IGNORE, 3, IGNORE, 4]])
    assert R.accuracy(logits, labels) == (1, 2)


def test_runner_end_to_end(tmp_path):
    out = tmp_path / "run"
    rc = R.main(["--task", "mqar", "--steps", "3", "--batch", "2", "--train-len", "24", "--eval-lens", "24,48",
                 "--device", "cpu", "--out", str(out), "model.pattern=*M", "model.d_model=32", "task.vocab=64",
                 "model.mamba.headdim=8", "model.mamba.d_state=8", "model.mamba.chunk_size=8",
                 "model.attn.n_heads=2", "--eval-fp32"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["accuracy"]) == {"24", "48"} and all(0 <= v <= 1 for v in res["accuracy"].values())
    assert res["accuracy_fp32"] == res["accuracy"]  # on the CPU both evaluations run in fp32
    assert res["config"]["task"]["params"] == {"vocab": 64} and res["curve"][-1]["step"] == 3
    assert "| 48 |" in (out / "results.md").read_text()
    assert res["steps_done"] == 3 and not res["time_limited"]


def test_runner_time_limit_stops_training_and_still_evaluates(tmp_path):
    out = tmp_path / "run"
    rc = R.main(["--task", "induction_heads", "--steps", "100000", "--batch", "2", "--train-len", "16",
                 "--time-limit", "0.5", "--device", "cpu", "--out", str(out), "model.pattern=MM",
                 "model.d_model=32", "model.mamba.headdim=8", "model.mamba.d_state=8", "model.mamba.chunk_size=8"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["time_limited"] and 1 <= res["steps_done"] < 100000
    assert res["curve"][-1]["step"] == res["steps_done"] and set(res["accuracy"]) == {"16"}
    assert "stopped by train.time_limit" in (out / "results.md").read_text()


def test_runner_config_file_and_errors(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task: {name: coffee_induction}\nmodel: {core: coffee, n: 2, d: 8}\n"
                   "train: {steps: 2, batch: 4, train_len: 16}\neval: {lens: [16], batches: 1, batch: 4}\n")
    assert R.main(["--config", str(cfg), "--device", "cpu", "--out", str(tmp_path / "o")]) == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["params"] == 3 * 2 * 8 + 8 * 8  # CoffeeCore: 3nD + |M| D
    cfg.write_text("task: {name: coffee_induction}\ntrain: {stepz: 2}\n")
    assert R.main(["--config", str(cfg), "--out", str(tmp_path / "x")]) == 2
    assert "unknown key 'stepz'" in capsys.readouterr().err
    cfg.write_text("task: {name: coffee_induction}\ntrain: {precision: fp16}\n")
    assert R.main(["--config", str(cfg), "--out", str(tmp_path / "x")]) == 2
    assert "train.precision must be bf16 or fp32, got 'fp16'" in capsys.readouterr().err
    cfg.write_text("task: {name: coffee_induction}\n")
    assert R.main(["--config", str(cfg), "--grad-clip", "-1", "--out", str(tmp_path / "x")]) == 2
    assert "train.grad_clip must be >= 0 (0: no clipping), got -1.0" in capsys.readouterr().err
    assert R.main(["--config", str(cfg), "--eval-batches", "0", "--out", str(tmp_path / "x")]) == 2
    assert "eval.batches must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # config mistakes fail before any output


def test_runner_grad_clip_and_eval_batches_flags(tmp_path, monkeypatch):
    """--grad-clip 0 trains without clipping (clip_grad_norm_ never called); --eval-batches sets the
    evaluation sample count."""
    calls = []
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda p, m: calls.append(m) or real(p, m))
    base = ["--task", "induction_heads", "--steps", "2", "--batch", "2", "--train-len", "16", "--device", "cpu",
            "model.pattern=M", "model.d_model=32", "model.mamba.headdim=8", "model.mamba.d_state=8",
            "model.mamba.chunk_size=8"]
    assert R.main(base + ["--out", str(tmp_path / "a")]) == 0
    assert calls == [1.0, 1.0]  # the default clips at 1.0
    calls.clear()
    assert R.main(base + ["--grad-clip", "0", "--eval-batches", "3", "--out", str(tmp_path / "b")]) == 0
    assert calls == []
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["config"]["train"]["grad_clip"] == 0 and res["config"]["eval"]["batches"] == 3


def test_runner_cuda_graph_refusals(tmp_path, capsys):
    base = ["--task", "induction_heads", "--steps", "2", "--train-len", "16", "--out", str(tmp_path / "o"),
            "--cuda-graph", "model.d_model=32"]
    assert R.main(base + ["model.pattern=M*C"]) == 2  # attention is graph-safe, the COFFEE block is not
    assert "model.pattern='M*C' has block(s) 'C'" in capsys.readouterr().err
    assert R.main(base + ["model.pattern=MM", "--device", "cpu"]) == 2
    assert "train.cuda_graph needs a CUDA device; this run uses cpu" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task: {name: coffee_induction}\nmodel: {core: coffee, n: 4, d: 8}\ntrain: {cuda_graph: true}\n")
    assert R.main(["--config", str(cfg), "--out", str(tmp_path / "x")]) == 2
    assert "the COFFEE core" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["MM", "SL", "BB", "M*"])
def test_runner_cuda_graph_trains_like_the_eager_loop(tmp_path, pattern):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train: {log_every: 5}\n")
    args = ["--config", str(cfg), "--task", "induction_heads", "--steps", "40", "--batch", "4", "--train-len", "48", "--eval-lens", "48,96",
            "--lr", "3e-3", f"model.pattern={pattern}", "model.d_model=32", "model.mamba.headdim=8",
            "model.mamba.d_state=8", "model.mamba.chunk_size=16", "model.mamba1.d_state=8", "model.longhorn.d_state=8",
            "model.bmojo.window=16", "model.bmojo.n_eidetic=4", "model.attn.n_heads=2"]
    curves = []
    for name, extra in (("eager", []), ("graph", ["--cuda-graph"])):
        assert R.main(args + extra + ["--out", str(tmp_path / name)]) == 0
        res = json.loads((tmp_path / name / "results.json").read_text())
        curves.append([c["loss"] for c in res["curve"]])
    assert len(curves[0]) == 8 and curves[0][0] > 0
    # same kernels in the same order; bf16 autocast, and the autotuner may pick another config per process
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=2e-3, atol=1e-4)

"""megassm-plan (megassm/planner/): each term of the model on a hand-worked case, the validation against every
measured row from the committed calibration file (a band the rows must stay in, so a trainer change the model
does not know about is noticed), the ranked table and the recipe it writes, and `calibrate` as a CPU smoke run."""
import glob
import json
import math
import os
import subprocess
import sys

import pytest

from megassm.config import load_config
from megassm.planner import costs
from megassm.planner.costs import Calibration, Link, bubble, collective_s, predict
from megassm.planner.validate import summary, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = os.path.join(ROOT, "configs", "planner", "h100-80gb.json")


def test_link_alpha_beta_by_hand():
    link = Link("x", alpha_s=10e-6, bw=100e9, half_size=0.0, source="test")
    assert link.seconds(0, 1e6) == 0.0
    assert math.isclose(link.seconds(1e9, 1e9), 10e-6 + 1e9 / 100e9)
    half = Link("y", alpha_s=0.0, bw=100e9, half_size=1e6, source="test")
    assert math.isclose(half.seconds(1e6, 1e6), 1e6 / 50e9)  # a message of half_size runs at half the bandwidth


def test_collective_inside_and_across_by_hand():
    inside = Link("in", 0.0, 400e9, 0.0, "t")
    across = Link("out", 0.0, 50e9, 0.0, "t")
    # all-reduce of 1 GB over 8 ranks in one node: 2 x 7/8 GB over NVLink
    assert math.isclose(collective_s("all_reduce", 8, 1, 1e9, inside, across), 2 * 7 / 8 * 1e9 / 400e9)
    # over 32 ranks on 4 nodes: 4/32 of the sends cross (1/8), the rest stays; the slower part decides
    sent = 2 * 31 / 32 * 1e9
    t = collective_s("all_reduce", 32, 4, 1e9, inside, across)
    assert math.isclose(t, max(sent * 28 / 32 / 400e9, sent * 4 / 32 / 50e9))
    # one rank per node (HSDP's replicas): every byte crosses
    assert math.isclose(collective_s("all_reduce", 4, 4, 1e9, inside, across), 2 * 3 / 4 * 1e9 / 50e9)
    assert collective_s("reduce_scatter", 1, 1, 1e9, inside, across) == 0.0


def test_bubble_by_hand():
    assert bubble(1, 1, 8) == 0.0
    assert math.isclose(bubble(4, 1, 8), 3 / 11)
    assert math.isclose(bubble(4, 2, 8), 3 / 19)


def test_per_token_interpolation_and_missing_entries():
    rows = [{"tokens": 1000, "v": 10.0}, {"tokens": 4000, "v": 20.0}]  # 10 and 5 us a token
    assert math.isclose(Calibration._per_token(rows, 1000, "v"), 10.0)
    assert math.isclose(Calibration._per_token(rows, 2000, "v"), 2000 * (10 + (5 - 10) * 0.5) / 1000)
    assert math.isclose(Calibration._per_token(rows, 8000, "v"), 8000 * 5 / 1000)  # beyond: the nearest's rate
    cal = Calibration({"blocks": {}}, "x.json")
    with pytest.raises(costs.MissingCalibration, match="x.json has no 'M|"):
        cal.block_ms("M|d=1", 1, False, 1000, True, False)


def _cal(block=2.0, ends=1.0, eager=None, ns=0.01):
    """A table of one block kind at TP 1: `block` ms per 1000 tokens (graph), `eager` under eager."""
    rows = [dict(tp=1, sp=False, tokens=1000, mode="graph", ac=False, block_ms=block)]
    if eager is not None:
        rows.append(dict(tp=1, sp=False, tokens=1000, mode="eager", ac=False, block_ms=eager))
    ends_rows = [dict(r, ends_ms=ends) for r in rows]
    return rows, ends_rows, ns


def test_one_gpu_step_by_hand(monkeypatch):
    """4 blocks x 2 ms + the ends 1 ms, per micro-batch of 1000 tokens, 2 micro-batches, + 1M params x 10 ns:
    the step is 2 x 9 ms + 0.01 s."""
    cfg = load_config(None, ["data.builtin=stdlib", "parallel.world_size=1", "model.pattern=MMMM", "model.d_model=64",
                             "model.vocab_size=256", "train.seq_len=500", "train.micro_batch=2",
                             "train.global_batch=4", "train.cuda_graph=true", "train.device=cuda"],
                      validate_config=False)
    from megassm.planner.calibrate import block_signature, head_signature

    rows, ends_rows, ns = _cal()
    cal = Calibration({"blocks": {block_signature(cfg.model, "M"): rows},
                       "ends": {head_signature(cfg.model, 256): ends_rows},
                       "optimizer": {"large_ns_per_param": ns, "tensor_us": 0.0}, "gpu": "NVIDIA H100 80GB HBM3"},
                      "hand.json")
    p = predict(cfg, cal, comm=False)
    from megassm.models import build_model

    model = build_model(cfg.model, vocab_size=256, device="meta")
    n, tensors = model.num_parameters(), len(list(model.parameters()))
    # the table's micro-batches accumulate their gradients; a step's first writes them fresh (one data-parallel
    # rank): one accumulation, 12 of the optimizer's 40 bytes a parameter, comes off the compute
    want = 2 * (4 * 2.0 + 1.0) / 1e3 - 0.3 * ns * 1e-9 * n + ns * 1e-9 * n
    assert math.isclose(p.step_s, want, rel_tol=1e-9), (p.step_s, want)
    assert math.isclose(p.tokens_per_s_per_gpu, 2000 / want)
    # the optimizer: the slower of the GPU (parameters x ns) and the host (tensors x us)
    cal.data["optimizer"]["tensor_us"] = 2 * ns * 1e-3 * n / tensors  # the host twice the GPU
    assert math.isclose(predict(cfg, cal, comm=False).optimizer_s, 2 * ns * 1e-9 * n, rel_tol=1e-9)
    cal.data["optimizer"] = {"ns_per_param": 3 * ns}  # an earlier file: its synthetic figure, and a note says so
    p3 = predict(cfg, cal, comm=False)
    assert math.isclose(p3.optimizer_s, 3 * ns * 1e-9 * n, rel_tol=1e-9) and "earlier file" in " ".join(p3.notes)
    cal.data["optimizer"] = {"large_ns_per_param": ns, "tensor_us": 0.0}
    assert not predict(cfg, cal, comm=False).notes
    # a file that measured the accumulation itself: its figure, not the bytes at the optimizer's rate
    cal.data["optimizer"]["accumulate_ns_per_param"] = 0.5 * ns
    assert math.isclose(predict(cfg, cal, comm=False).compute_s, 2 * (4 * 2.0 + 1.0) / 1e3 - 0.5 * ns * 1e-9 * n,
                        rel_tol=1e-9)
    del cal.data["optimizer"]["accumulate_ns_per_param"]
    # eager: the host's time where it is the longer (3 ms a block), the GPU's where it is not
    rows, ends_rows, ns = _cal(eager=3.0)
    cal.data["blocks"][block_signature(cfg.model, "M")] = rows
    cfg.train.cuda_graph = False
    assert predict(cfg, cal, comm=False).compute_s > p.compute_s
    assert math.isclose(predict(cfg, cal, comm=False).compute_s, 2 * (4 * 3.0 + 1.0) / 1e3 - 0.3 * ns * 1e-9 * n,
                        rel_tol=1e-9)
    rows, _, _ = _cal(eager=1.0)  # an eager figure below the GPU's is noise: the GPU's time stands
    cal.data["blocks"][block_signature(cfg.model, "M")] = rows
    assert math.isclose(predict(cfg, cal, comm=False).compute_s, p.compute_s, rel_tol=1e-9)


def test_fresh_first_gradients_follow_the_engine():
    """Which layouts' first micro-batch writes fresh gradients (parallel/engines.py build_engine), so the table's
    accumulating micro-batch overstates it by one accumulation."""
    def fresh(*over):
        cfg = load_config(None, ["data.builtin=stdlib", "model.pattern=MM", "model.d_model=64", *over],
                          validate_config=False)
        from megassm.config import data_parallel_size
        return costs._fresh_first_gradients(cfg, data_parallel_size(cfg))

    assert fresh("parallel.world_size=1")  # the plain engine: zero_grad(set_to_none)
    assert fresh("parallel.world_size=2", "parallel.tp=2")  # one DP rank
    assert fresh("parallel.world_size=2", "train.cuda_graph=true", "train.device=cuda")  # DDP, all-reduce after
    assert not fresh("parallel.world_size=2")  # torch DDP overlapped: bucket views, zeroed in place
    assert not fresh("parallel.world_size=2", "parallel.zero_stage=1")  # the distributed optimizer's buffer
    assert not fresh("parallel.world_size=2", "parallel.cp=2", "parallel.zero_stage=1")  # over CP, at DP 1
    assert not fresh("parallel.world_size=2", "parallel.engine=fsdp2")


def test_exposed_overlap_rules_by_hand():
    from megassm.training.traffic import Flow

    ddp = Flow("DDP gradient all-reduce (fp32)", "all_reduce", "dp", 4, 1, 1e9, 1)
    assert costs._exposed(ddp, 0.5, last_bwd_s=0.4, fwd_s=0.2, overlapped_reduce=True, units=10) == \
        pytest.approx(0.1)  # 0.4 s of it under the backward
    assert costs._exposed(ddp, 0.5, 0.4, 0.2, overlapped_reduce=True, units=2) == pytest.approx(0.25)  # the last bucket
    assert costs._exposed(ddp, 0.5, 0.4, 0.2, overlapped_reduce=False, units=10) == 0.5  # after the backward
    tp = Flow("TP all-reduce of activations", "all_reduce", "tp", 2, 1, 1e6, 100)
    assert costs._exposed(tp, 0.3, 0.4, 0.2, True, 10) == 0.3  # on the critical path
    rs = Flow("FSDP2 gradient reduce-scatter (fp32)", "reduce_scatter", "shard", 4, 1, 1e9, 4)
    # 4 calls of 0.1 s, each under a 0.4 s backward but for its last unit's tenth
    assert costs._exposed(rs, 0.4, 0.4, 0.2, True, 10) == pytest.approx(4 * 0.01)


@pytest.fixture(scope="module")
def h100():
    return Calibration.load(H100)


def test_the_committed_calibration_names_its_machine(h100):
    d = h100.data
    assert "H100" in d["gpu"] and d["date"] and d["torch"] and d["device"] == "cuda"
    assert d["blocks"] and d["ends"] and d["optimizer"]["large_ns_per_param"] > 0 and d["fsdp2"] and d["cp"]
    for link in costs.LINKS.values():
        assert link.source  # every link class says where its figures come from


# The validation band, from the committed calibration (docs/planner.md "Validation"): a trainer change that moves a
# row out of its band, or a model change that does, fails here. The bands are the figures reached, not the goals.
MEDIAN_MAX, ROW_MAX, WITHIN_25_MIN = 0.06, 1.40, 30


def test_validation_against_every_measured_row(h100):
    res = validate(h100)
    assert all(r["predicted"] is not None for r in res), [r for r in res if r["predicted"] is None]
    s = summary(res)
    assert s["median_abs_error"] <= MEDIAN_MAX, s
    assert s["max_abs_error"] <= ROW_MAX, s
    assert s["within_25pct"] >= WITHIN_25_MIN, s
    assert all(g["ok"] for g in s["ranking"].values()), s["ranking"]  # the measured best layout ranked first


def test_the_default_calibration_is_the_median_of_the_committed_runs(h100):
    """configs/planner/h100-80gb.json is each entry's median over the H100 runs in h100-80gb-runs/ (docs/planner.md
    "Repeatability"), exactly: a run added or a figure edited by hand is noticed."""
    from megassm.planner.calibrate import median_of

    runs = sorted(glob.glob(os.path.join(ROOT, "configs", "planner", "h100-80gb-runs", "*.json")))
    assert len(runs) >= 3 and [m["file"] for m in h100.data["median_of"]] == [os.path.basename(r) for r in runs]
    tables = []
    for r in runs:
        with open(r) as f:
            tables.append(json.load(f))
    assert median_of(tables, [os.path.basename(r) for r in runs]) == h100.data


def test_median_of_calibrations_by_hand(tmp_path):
    """`calibrate --median`: each entry's figure the median over the files that measured it; other GPUs refused."""
    def table(block, opt, fsdp, extra=None):
        row = dict(config="c", tp=1, sp=False, micro=1, seq=8, tokens=8, mode="graph", ac=False, block_ms=block,
                   model1_ms=2 * block)
        blocks = {"M|d=8": [row] + ([dict(row, mode="eager", block_ms=extra, model1_ms=extra)] if extra else [])}
        return dict(format=1, date="2026-12-07", gpu="G", torch="t", triton="x", device="cuda", iters=1, warmup=1,
                    blocks=blocks, ends={}, optimizer=opt, fsdp2={"step": dict(ms=fsdp, dp=4)},
                    cp=[], not_measured=[], seconds=10.0)

    paths = []
    one = {"ns_per_param": 0.02}  # an earlier file: the synthetic figure only
    two = {"ns_per_param": 0.04, "large_ns_per_param": 0.01, "tensor_us": 5.0, "accumulate_ns_per_param": 0.004}
    three = {"ns_per_param": 0.03, "large_ns_per_param": 0.02, "tensor_us": 4.0}
    for i, t in enumerate([table(1.0, one, 30.0, extra=5.0), table(3.0, two, 10.0), table(2.0, three, 20.0)]):
        paths.append(tmp_path / f"c{i}.json")
        paths[-1].write_text(json.dumps(t))
    out = tmp_path / "m.json"
    r = subprocess.run([sys.executable, "-m", "megassm.planner.cli", "calibrate", "--median", *map(str, paths),
                        "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    m = json.loads(out.read_text())
    graph, eager = sorted(m["blocks"]["M|d=8"], key=lambda x: x["mode"] != "graph")
    assert (graph["block_ms"], graph["model1_ms"], graph["files"]) == (2.0, 4.0, 3)
    assert (eager["block_ms"], eager["files"]) == (5.0, 1)  # measured by one file only: its own figure
    assert m["optimizer"]["ns_per_param"] == 0.03 and m["fsdp2"]["step"]["ms"] == 20.0
    assert (m["optimizer"]["large_ns_per_param"], m["optimizer"]["tensor_us"]) == (0.015, 4.5)
    assert m["optimizer"]["files"] == {"ns_per_param": 3, "large_ns_per_param": 2, "tensor_us": 2,
                                       "accumulate_ns_per_param": 1}
    assert m["optimizer"]["accumulate_ns_per_param"] == 0.004
    assert [x["file"] for x in m["median_of"]] == ["c0.json", "c1.json", "c2.json"] and m["seconds"] == 30.0
    Calibration.load(str(out)).block_ms("M|d=8", 1, False, 8, graph=True, ac=False)  # the planner reads it
    paths[2].write_text(json.dumps(dict(table(2.0, three, 20.0), gpu="H")))
    r = subprocess.run([sys.executable, "-m", "megassm.planner.cli", "calibrate", "--median", *map(str, paths),
                        "--out", str(tmp_path / "n.json")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "differ in 'gpu'" in r.stderr and not (tmp_path / "n.json").exists()


def test_plan_ranks_layouts_and_writes_the_best_as_a_config(tmp_path):
    out = tmp_path / "recipe.yaml"
    r = subprocess.run([sys.executable, "-m", "megassm.planner.cli", "--config", "configs/hybrid-1.3b.yaml",
                        "--nodes", "1", "--gpus-per-node", "2", "--json", "--write", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    lay = res["layouts"]
    assert lay and all(a["tokens_per_s_per_gpu"] >= b["tokens_per_s_per_gpu"] for a, b in zip(lay, lay[1:]))
    assert all(x["needed_gib"] < 79.1 for x in lay)
    text = out.read_text()
    assert text.startswith("# Written by megassm-plan") and "predicted" in text
    cfg = load_config(str(out), ["data.builtin=stdlib"])  # a valid config, with the best layout
    assert cfg.parallel.world_size == 2
    bad = subprocess.run([sys.executable, "-m", "megassm.planner.cli", "--config", "configs/hybrid-1.3b.yaml",
                          "--gpu", "h200-141gb"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "megassm-plan calibrate --out" in bad.stderr


def test_calibrate_runs_on_cpu_as_a_smoke_run(tmp_path):
    out = tmp_path / "cal.json"
    r = subprocess.run([sys.executable, "-m", "megassm.planner.cli", "calibrate", "--device", "cpu", "--config",
                        "configs/tiny.yaml", "--budget-s", "3", "--out", str(out)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "MEGASSM_INIT_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    t = json.loads(out.read_text())
    assert t["device"] == "cpu" and t["optimizer"]["large_ns_per_param"] > 0 and t["optimizer"]["tensor_us"] >= 0
    assert t["optimizer"]["accumulate_ns_per_param"] > 0
    measured = {k[0] for k in t["blocks"]}
    cut = {w.get("letter") for w in t["not_measured"]}
    assert set("M*-") <= measured | cut and cut  # what the 3 s budget did not reach is listed, not dropped
    gpu = subprocess.run([sys.executable, "-m", "megassm.planner.cli", "calibrate", "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert gpu.returncode == 2 and "on a GPU and none is visible" in gpu.stderr

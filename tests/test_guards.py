"""The long-run guards (megassm/training/guards.py; docs/reliability.md "Loss spikes" and "Stragglers") with their
faults injected (training/faults.py: `spike` multiplies a rank's losses of one step of data, so the real loss and
gradient norm spike; `slow` sleeps in one rank's every forward):

- skip: the spiking step leaves model and optimizer exactly as the step before left them, the lr schedule and the
  data go on, the count is logged; a resume from a checkpoint before the spike judges it alike (the window is in
  the checkpoint) and gives the uninterrupted run's losses;
- rollback: the last checkpoint comes back and the data position stays past the spiking batches (a replay would
  spike again and stop the run at spike_max_rollbacks=1), the losses after it are those of a resume from that
  checkpoint with the data moved on; spikes past the limit stop the run with exit 7;
- over 2 ranks (gloo): a spike on one rank's data is skipped by both (DDP + ZeRO-1, FSDP2); the straggler report
  names the sleeping rank and its host, and nobody without the fault.
"""
import json
import logging
import os
import re
import shutil
import socket
from types import SimpleNamespace

import pytest
import torch

from megassm import train as T
from megassm.config import ConfigError, load_config
from megassm.training import checkpoint as ckpt
from megassm.training import faults
from megassm.training.failures import EXIT_OK, EXIT_SPIKE
from megassm.training.guards import SpikeGuard, SpikeStopError

from multiproc import launch, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["model.pattern=M*M-", "model.d_model=32", "model.mamba.d_state=8", "model.mamba.headdim=16",
         "model.mamba.chunk_size=16", "model.attn.n_heads=2", "model.attn.n_kv_heads=1", "model.mlp.ffn_hidden=64",
         "train.seq_len=32", "train.micro_batch=2", "train.global_batch=4", "train.log_interval=1",
         "train.eval_interval=0", "optim.warmup_steps=2", "run.progress=false", "run.tensorboard=false",
         "train.device=cpu", "data.builtin=stdlib"]
# a short window, judging from the 4th accepted step on; sigma stays the default 6
GUARD = ["train.spike_window=8", "train.spike_min_steps=4"]


@pytest.fixture
def one_thread():
    """In-process runs on one thread, as the launched ranks run (OMP_NUM_THREADS=1): on CI's 2 shared cores a
    second intra-op thread only spins."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _main(run_dir, *extra, resume=None):
    args = ["--config", "configs/tiny.yaml", *SMALL, *GUARD, f"run.dir={run_dir}", *extra]
    return T.main(args + (["--resume", str(resume)] if resume else []))


def _records(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def _state(run_dir, step, name):
    return torch.load(os.path.join(run_dir, "checkpoints", ckpt.checkpoint_name(step), f"{name}.pt"),
                      weights_only=False)


def _same_tensors(a, b) -> bool:
    """Bit for bit (NaN fails), through nested dicts / lists."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same_tensors, a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _spike_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("spike at step")]


# ----------------------------------------------------------------------------------------------------
# config, fault specs, the decision itself
# ----------------------------------------------------------------------------------------------------


def test_guard_keys_are_checked(monkeypatch):
    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    cfg = load_config(tiny, [])
    t = cfg.train
    assert (t.spike_action, t.spike_window, t.spike_sigma, t.spike_min_steps, t.spike_max_rollbacks) == \
        ("off", 128, 6.0, None, 3)
    assert (t.straggler_interval, t.straggler_fraction) == (None, 0.2)
    for over, msg in [("train.spike_action=undo", "train.spike_action must be off, skip or rollback"),
                      ("train.spike_window=1", "train.spike_window must be >= 2"),
                      ("train.spike_sigma=0", "train.spike_sigma must be a finite number > 0"),
                      ("train.spike_sigma=inf", "train.spike_sigma must be a finite number > 0"),
                      ("train.spike_min_steps=200", r"train.spike_min_steps must be in \[2, train.spike_window=128\]"),
                      ("train.spike_max_rollbacks=-1", "train.spike_max_rollbacks must be >= 0"),
                      ("train.straggler_interval=-2", "train.straggler_interval must be >= 0"),
                      ("train.straggler_fraction=0", "train.straggler_fraction must be a finite number > 0")]:
        with pytest.raises(ConfigError, match=msg):
            load_config(tiny, [over])
    with pytest.raises(ConfigError, match=r"train.spike_action=rollback needs run.save_interval > 0"):
        load_config(tiny, ["train.spike_action=rollback", "run.save_interval=0"])
    # DeepSpeed steps before its norm exists: skip is refused there (not at one DP rank: no DeepSpeed is built)
    from megassm.training.checks import check_supported

    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = ["parallel.engine=deepspeed", "parallel.zero_stage=1", "train.global_batch=16"]
    with pytest.raises(ConfigError, match="train.spike_action=skip with parallel.engine=deepspeed"):
        check_supported(load_config(tiny, [*ds, "train.spike_action=skip"]), device=torch.device("cpu"))
    for ok in (["train.spike_action=rollback"], ["parallel.engine=fsdp2", "train.spike_action=skip"]):
        try:
            check_supported(load_config(tiny, [*ds, *ok]), device=torch.device("cpu"))
        except ConfigError as e:
            assert "spike_action" not in str(e), e  # another refusal (DeepSpeed absent) is not this test's


def test_fault_specs():
    assert faults.parse("spike:1:5") == ("spike", 1, 5, 1000.0)
    assert faults.parse("spike:0:5:50") == ("spike", 0, 5, 50.0)
    assert faults.parse("slow:1:0.3") == ("slow", 1, 0, 0.3)
    for bad in ("spike:1:0", "spike:1:5:0", "spike:1:5:inf", "spike:1:5:nan", "slow:1", "slow:1:0", "slow:1:2:3"):
        with pytest.raises(ValueError, match="MEGASSM_FAULT"):
            faults.parse(bad)


def _guard(action="skip"):
    t = SimpleNamespace(spike_action=action, spike_window=6, spike_sigma=6.0, spike_min_steps=4,
                        spike_max_rollbacks=1)
    return SpikeGuard(t, SimpleNamespace(world_size=1, rank=0), torch.device("cpu"))


def test_spike_decision():
    g = _guard()
    steady = [(3.0, 1.0), (3.1, 1.1), (2.9, 0.9), (3.0, 1.05)]
    for i, (loss, norm) in enumerate(steady[:3], 1):  # fewer than spike_min_steps: not judged
        assert g.judge(i, loss * (100 if i == 3 else 1), norm, checkpoint=None, declines=True)
    g = _guard()
    for i, (loss, norm) in enumerate(steady, 1):
        assert g.judge(i, loss, norm, checkpoint=None, declines=True)
    assert not g.judge(5, 3.05, 50.0, checkpoint=None, declines=True)  # the norm alone
    assert not g.judge(6, 40.0, 1.0, checkpoint=None, declines=True)  # the loss alone
    assert g.judge(7, 3.02, 1.0, checkpoint=None, declines=True)
    assert (list(g.losses), g.skipped) == ([3.0, 3.1, 2.9, 3.0, 3.02], 2)  # spikes stay out of the window
    g2 = _guard()
    g2.load_state_dict(g.state_dict())
    assert (list(g2.losses), list(g2.norms), g2.counters()) == (list(g.losses), list(g.norms), g.counters())

    r = _guard("rollback")
    for i, (loss, norm) in enumerate(steady, 1):
        r.judge(i, loss, norm, checkpoint="ck", declines=True)
    assert not r.judge(5, 99.0, 1.0, checkpoint="ck", declines=True) and r.rollback_due
    r.rolled_back(r.pending, 4, "ck", r.counters())
    assert r.counters() == (0, 1) and not r.rollback_due
    assert r.judge(5, 99.0, 1.0, checkpoint=None, declines=True) is False and r.skipped == 1  # no checkpoint: skip
    with pytest.raises(SpikeStopError, match=r"1 rollback\(s\) to ck .*train.spike_max_rollbacks=1"):
        r.judge(5, 99.0, 1.0, checkpoint="ck", declines=True)
    r.saved()  # a new checkpoint: rollbacks go to it
    assert r.judge(9, 99.0, 1.0, checkpoint="ck2", declines=False) is True and r.rollback_due  # DeepSpeed stepped


def _agree_worker(rank, world):
    g = _guard()
    for i, (loss, norm) in enumerate([(3.0, 1.0), (3.1, 1.1), (2.9, 0.9), (3.0, 1.05)], 1):
        g.judge(i, loss, norm, checkpoint=None, declines=True)
    g.world = world
    # the ranks' numbers differ (here by far, on purpose; in a run at most in the last bits): one decision, taken on
    # their maximum
    return g.judge(5, 3.0 + 0.6 * rank, 1.0, checkpoint=None, declines=True), list(g.losses)


def test_every_rank_takes_the_same_decision():
    (a, wa), (b, wb) = spawn(_agree_worker, 2)
    assert a is b is False and wa == wb  # rank 1's 3.6 is a spike (band 3.0 + 6 x 0.082): rank 0 declines too


# ----------------------------------------------------------------------------------------------------
# one process, in this interpreter
# ----------------------------------------------------------------------------------------------------


def test_skip_discards_the_update_and_a_resume_keeps_the_window(tmp_path, monkeypatch, caplog, one_thread):
    monkeypatch.setenv(faults.ENV, "spike:0:7")
    run = tmp_path / "run"
    over = ["train.steps=10", "run.save_interval=1", "run.keep_last=0", "train.spike_action=skip"]
    with caplog.at_level(logging.WARNING, logger="megassm.train"):
        assert _main(run, *over) == EXIT_OK
    (warning,) = _spike_warnings(caplog)
    assert re.match(r"spike at step 7: loss [\d.]+ > [\d.]+ \(mean [\d.]+ \+ 6 x std [\d.e-]+ of the last 6 accepted "
                    r"steps\); grad norm [\d.]+ > [\d.]+ .*; step skipped: gradients discarded, no optimizer step",
                    warning), warning
    recs = _records(run)
    assert [r["step"] for r in recs] == list(range(1, 11))
    assert [r["guard_skipped_steps"] for r in recs] == [0] * 6 + [1] * 4
    assert recs[6]["loss"] > 100 * recs[5]["loss"] and recs[6]["grad_norm"] > 100 * recs[5]["grad_norm"]
    # step 7 left model and optimizer as step 6 did; step 8 changed them; schedule and data moved on
    assert _same_tensors(_state(run, 6, "model"), _state(run, 7, "model"))
    assert _same_tensors(_state(run, 6, "optim")["state"], _state(run, 7, "optim")["state"])  # the lr moved on
    assert not _same_tensors(_state(run, 7, "model"), _state(run, 8, "model"))
    assert _state(run, 7, "scheduler")["next_step"] == 7 and _state(run, 7, "data")["consumed_samples"] == 7 * 4

    # resumed from step 5 (another run.dir): the window is in the checkpoint, so step 7 is judged (spike_min_steps 4)
    # and skipped again; without it the guard would have 1 accepted step there and take the update
    resumed = tmp_path / "resumed"
    assert _main(resumed, *over, resume=run / "checkpoints" / ckpt.checkpoint_name(5)) == EXIT_OK
    again = _records(resumed)
    assert [r["step"] for r in again] == list(range(6, 11))
    assert [r["loss"] for r in again] == [r["loss"] for r in recs[5:]]  # exact: fails on NaN
    assert again[-1]["guard_skipped_steps"] == 1


def test_rollback_restores_the_checkpoint_and_keeps_the_data_position(tmp_path, monkeypatch, caplog, one_thread):
    monkeypatch.setenv(faults.ENV, "spike:0:6")
    run = tmp_path / "run"
    over = ["train.steps=8", "run.save_interval=4", "train.spike_action=rollback", "train.spike_max_rollbacks=1"]
    with caplog.at_level(logging.WARNING, logger="megassm.train"):
        assert _main(run, *over) == EXIT_OK  # a replay of data step 6 would spike again and stop it (exit 7)
    (warning,) = _spike_warnings(caplog)
    four = os.path.join(run, "checkpoints", ckpt.checkpoint_name(4))
    assert re.match(rf"spike at step 6: loss .*; rolled back to {re.escape(four)} \(step 4\), rollback 1 of at most 1 "
                    r"to it; the data goes on past step 6's batches \(the batches of 2 step\(s\) are not replayed\)",
                    warning), warning
    recs = _records(run)  # what steps 5 and 6 logged before the rollback is dropped, as on a resume
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert [r["guard_rollbacks"] for r in recs] == [0] * 4 + [1] * 4
    assert _state(run, 8, "data")["consumed_samples"] == (8 + 2) * 4  # the data of steps 5-6 consumed once

    # the same as resuming step 4's checkpoint with its data position moved past those 2 steps: model, optimizer,
    # scheduler, RNG and the guard's window all came back
    moved = tmp_path / "moved" / ckpt.checkpoint_name(4)
    shutil.copytree(four, moved)
    data = torch.load(moved / "data.pt", weights_only=False)
    data["consumed_samples"] += 2 * 4
    torch.save(data, moved / "data.pt")
    meta = json.loads((moved / "meta.json").read_text())
    meta["integrity"]["files"]["data.pt"] = ckpt.file_record(str(moved / "data.pt"))
    (moved / "meta.json").write_text(json.dumps(meta))
    monkeypatch.delenv(faults.ENV)
    assert _main(tmp_path / "reference", *over, resume=moved) == EXIT_OK
    ref = _records(tmp_path / "reference")
    assert [r["step"] for r in ref] == [5, 6, 7, 8]
    assert [r["loss"] for r in ref] == [r["loss"] for r in recs[4:]]  # exact: fails on NaN


def test_spikes_past_the_rollback_limit_stop_the_run(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv(faults.ENV, "spike:0:6,spike:0:7")  # the batches after the first spike's are bad too
    run = tmp_path / "run"
    assert _main(run, "train.steps=8", "run.save_interval=4", "train.spike_action=rollback",
                 "train.spike_max_rollbacks=1") == EXIT_SPIKE == 7
    with open(run / "last_exit.json") as f:
        status = json.load(f)
    assert status["exit_code"] == 7 and status["step"] == 4
    assert status["checkpoint"] == os.path.join(run, "checkpoints", ckpt.checkpoint_name(4))
    assert re.match(r"spike at step 5: loss .*; 1 rollback\(s\) to .*step_00000004 did not get past it "
                    r"\(train.spike_max_rollbacks=1\); training stopped", status["reason"]), status["reason"]


# ----------------------------------------------------------------------------------------------------
# two ranks over gloo
# ----------------------------------------------------------------------------------------------------


def _two_ranks(run, env, *extra):
    args = ["--config", "configs/tiny.yaml", *SMALL, *GUARD, f"run.dir={run}", "train.spike_action=skip",
            "train.steps=5", "train.spike_min_steps=3", "run.save_interval=1", "run.keep_last=0",
            "train.straggler_interval=1", *extra]
    r = launch(ROOT, args, nproc=2, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stderr, _records(run)


def _skipped_step_4(run, stderr, recs):
    assert len(re.findall(r"spike at step \d+", stderr)) == 1 and "spike at step 4: loss" in stderr  # rank 0 speaks
    assert [r["guard_skipped_steps"] for r in recs] == [0, 0, 0, 1, 1]
    assert _same_tensors(_state(run, 3, "model"), _state(run, 4, "model"))
    assert _same_tensors(_state(run, 3, "optim")["state"], _state(run, 4, "optim")["state"])
    assert not _same_tensors(_state(run, 4, "model"), _state(run, 5, "model"))


def test_straggler_is_named_and_a_spike_on_one_rank_is_skipped_by_both(tmp_path):
    """DDP + ZeRO-1, 2 micro-batches per rank; rank 1 sleeps 0.3 s in every forward and its data of step 4 spikes."""
    run = tmp_path / "run"
    stderr, recs = _two_ranks(run, {faults.ENV: "slow:1:0.3,spike:1:4"}, "parallel.zero_stage=1",
                              "train.micro_batch=1")
    _skipped_step_4(run, stderr, recs)
    named = re.findall(r"straggler at step (\d+): rank (\d+) \(host (\S+)\) spent ([\d.]+) s on data wait \+ forward, "
                       r"([\d.]+)x the median", stderr)
    # step 1 (compilation, autotuning) is never reported; every later step names rank 1 on this host
    assert [(int(s), int(r), h) for s, r, h, _, _ in named] == [(s, 1, socket.gethostname()) for s in (2, 3, 4, 5)]
    assert all(float(t) >= 0.6 for _, _, _, t, _ in named)  # 2 forwards x 0.3 s
    assert [r.get("straggler_slowest_rank") for r in recs] == [None, 1, 1, 1, 1]
    assert all(r["straggler_slowest_over_median"] > 1.2 for r in recs[1:])


def test_fsdp2_skips_alike_and_no_straggler_is_named_without_the_fault(tmp_path):
    """FSDP2 (reshard=step: the forwards after a step's first find the weights gathered and are timed), 4 micro-batches
    per rank, the spike on rank 1's data only. Nobody sleeps, so nobody is named: the bar is 1.5x the median here
    (train.straggler_fraction=0.5), not the default 1.2x, because the 2 ranks share 2 cores with other tests."""
    run = tmp_path / "run"
    stderr, recs = _two_ranks(run, {faults.ENV: "spike:1:4"}, "parallel.engine=fsdp2", "train.micro_batch=1",
                              "train.global_batch=8", "train.straggler_fraction=0.5")
    _skipped_step_4(run, stderr, recs)
    assert "straggler at step" not in stderr, stderr[-3000:]
    assert all(r["straggler_slowest_over_median"] >= 1.0 for r in recs[1:])  # measured (not step 1: start-up)
    assert "straggler_slowest_over_median" not in recs[0]

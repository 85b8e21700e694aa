"""Preemption (megassm/training/preemption.py): SIGUSR1 to a running `megassm-train` makes it checkpoint at
the next step boundary and exit 99 with run_dir/last_exit.json; `--resume auto` then finishes the run with
the losses of an uninterrupted one (a constant learning rate after warm-up, so that the runs of
different lengths share a schedule). Under torchrun a signal to ONE rank stops every rank at the same step."""
import json
import os
import signal
import subprocess
import sys

from megassm.training.preemption import PREEMPT_EXIT_CODE

from multiproc import stop, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=64", "model.mamba.d_state=16",
        "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.attn.n_heads=4", "model.mlp.ffn_hidden=128",
        "train.seq_len=48", "train.micro_batch=2", "train.global_batch=4", "train.log_interval=1",
        "train.eval_interval=0", "optim.warmup_steps=2", "optim.lr=3e-3", "optim.min_lr=3e-3", "run.progress=false", "run.save_interval=0",
        "train.device=cpu"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _train_cmd(run_dir, steps, *extra):
    return ["-m", "megassm.train", "--config", "configs/tiny.yaml", *TINY, f"train.steps={steps}",
            f"run.dir={run_dir}", *extra]


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _wait_for_steps(run_dir, proc, n, group=False):
    path = os.path.join(run_dir, "metrics.jsonl")
    wait_until(proc, lambda: os.path.exists(path) and len(_losses(run_dir)) >= n, 120, f"{n} training steps",
               group=group)


def test_sigusr1_checkpoints_exits_99_and_resumes_exactly(tmp_path):
    run = str(tmp_path / "pre")
    p = subprocess.Popen([sys.executable, *_train_cmd(run, 400)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(run, p, 3)
        p.send_signal(signal.SIGUSR1)
        out, err = p.communicate(timeout=120)
    finally:
        stop(p)
    assert p.returncode == PREEMPT_EXIT_CODE, err[-2000:]
    status = json.load(open(os.path.join(run, "last_exit.json")))
    k = status["step"]
    assert status["exit_code"] == PREEMPT_EXIT_CODE and status["signal"] == "SIGUSR1" and 3 <= k < 400
    assert os.path.basename(status["checkpoint"]) == f"step_{k:08d}" and os.path.isdir(status["checkpoint"])
    assert "resume with --resume auto" in err

    # resume to k + 2 steps; the whole equals a straight run of k + 2 steps, float for float
    r = subprocess.run([sys.executable, *_train_cmd(run, k + 2), "--resume", "auto"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.load(open(os.path.join(run, "last_exit.json")))["exit_code"] == 0
    straight = str(tmp_path / "straight")
    r = subprocess.run([sys.executable, *_train_cmd(straight, k + 2)], cwd=ROOT, env=ENV, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert _losses(run) == _losses(straight)


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _rank_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env.get(b"RANK", b"-1"))


def test_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    run = str(tmp_path / "ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           *_train_cmd(run, 400)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        _wait_for_steps(run, p, 3, group=True)
        workers = {_rank_of(c): c for c in _children(p.pid)}
        assert set(workers) == {0, 1}, workers
        os.kill(workers[1], signal.SIGUSR1)  # rank 0 (which saves the metadata) is never signalled
        out, err = p.communicate(timeout=180)
    finally:
        stop(p, group=True)  # the ranks too, should torchrun have left any
    # torchrun turns a worker's non-zero exit into its own failure; the batch script therefore reads the
    # code from last_exit.json, written by rank 0
    assert p.returncode != 0, err[-3000:]
    status = json.load(open(os.path.join(run, "last_exit.json")))
    k = status["step"]
    assert status["exit_code"] == PREEMPT_EXIT_CODE and status["signal"] is None  # rank 0 learned it by the all-reduce
    assert os.path.isdir(status["checkpoint"]) and os.path.basename(status["checkpoint"]) == f"step_{k:08d}"
    assert max(_losses(run)) == k  # nobody trained past the agreed step

"""Faults under torchrun on CPU (gloo, real processes; the hook is megassm/training/faults.py):

- a rank SIGKILLed between steps ends every rank at once (its peer fails in the gradient all-reduce, torchrun
  stops the rest), leaves no checkpoint newer than the last complete one, and `--resume auto` continues with
  the losses of an uninterrupted run;
- a rank that stalls for good makes its peer's collective fail after parallel.timeout_s (the stderr names the
  timeout), and torchrun ends the stalled rank: the job exits non-zero by itself;
- a checkpoint writer killed at any point of a save leaves no complete-looking checkpoint;
- every process group gets parallel.timeout_s, also the ones created without a timeout (DeepSpeed's)."""
import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from megassm.config import ConfigError, load_config
from megassm.training import checkpoint as ckpt
from megassm.training import faults

from multiproc import launch, losses, run_train, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config", "configs/tiny.yaml", "data.builtin=stdlib", "model.d_model=32", "model.mamba.d_state=8",
        "model.mamba.headdim=8", "model.mamba.chunk_size=16", "model.mlp.ffn_hidden=64", "train.seq_len=32",
        "train.micro_batch=2", "train.global_batch=4", "train.log_interval=1", "train.eval_interval=0",
        "optim.warmup_steps=2", "run.progress=false", "run.tensorboard=false", "run.save_interval=2",
        "train.device=cpu", "train.steps=6"]
GRACE_S = 30  # torchrun's SIGTERM -> SIGKILL wait when it stops the ranks left after a failure
START_S = 60  # start-up and the first steps of two ranks on a busy 2-core machine


def _args(run_dir, *extra):
    return [*TINY, f"run.dir={run_dir}", *extra]


def _assert_no_rank_alive(run_dir, nproc=2):
    """Every rank's process (RUN_DIR/pids/*.pid) is gone."""
    pids = [int(open(os.path.join(run_dir, "pids", f)).read()) for f in os.listdir(os.path.join(run_dir, "pids"))]
    assert len(pids) == nproc
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _checkpoint_steps(run_dir):
    """Steps of the complete checkpoints; every step_* directory must be one."""
    complete = [s for s, _ in ckpt.list_checkpoints(str(run_dir))]
    assert complete == [s for s, _ in ckpt.list_checkpoints(str(run_dir), complete_only=False)]
    return complete


def test_timeout_must_be_a_positive_number():
    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    assert load_config(tiny, []).parallel.timeout_s == 600.0
    for value in ("0", "-5", "nan", "inf"):
        with pytest.raises(ConfigError, match=r"parallel\.timeout_s must be a finite number of seconds > 0, got"):
            load_config(tiny, [f"parallel.timeout_s={value}"])


def test_fault_spec_is_checked():
    assert faults.parse("kill:1:4") == ("kill", 1, 4, float("inf"))
    assert faults.parse("hang:0:2:5") == ("hang", 0, 2, 5.0)
    assert faults.parse("hangsave:1:2") == ("hangsave", 1, 2, float("inf"))
    for bad in ("kill:1", "kill:1:4:5", "hangsave:1", "hang:-1:2", "hang:1:0", "stop:1:4", "hang:1:2:0", "kill:a:4"):
        with pytest.raises(ValueError, match="MEGASSM_FAULT"):
            faults.parse(bad)


def test_killed_rank_ends_the_job_and_resume_auto_continues_exactly(tmp_path):
    run = tmp_path / "run"
    r = launch(ROOT, _args(run, "parallel.timeout_s=20"), nproc=2, env={"MEGASSM_FAULT": "kill:1:4"}, timeout=300,
               torchrun=True)
    assert r.returncode != 0, r.stderr[-3000:]
    assert "[rank 1] megassm: MEGASSM_FAULT=kill:1:4: killed before step 4" in r.stderr
    assert "Signal 9 (SIGKILL) received by PID" in r.stderr  # torchrun's summary names the lost rank
    assert r.seconds < 20 + START_S, r.seconds  # within parallel.timeout_s: the peer failed at once
    _assert_no_rank_alive(run)
    assert _checkpoint_steps(run) == [2]  # step 4's checkpoint was never reached

    resumed = losses(run_train(ROOT, _args(run, "--resume", "auto"), nproc=2))
    straight = losses(run_train(ROOT, _args(tmp_path / "straight"), nproc=2))
    assert sorted(resumed) == sorted(straight) == [1, 2, 3, 4, 5, 6]
    # fp32 rounding: DDP's first step after a resume uses its initial bucket layout (docs/parallelism.md)
    assert all(abs(resumed[s] - straight[s]) <= 1e-6 * abs(straight[s]) for s in straight), (resumed, straight)


def test_stalled_rank_fails_its_peer_after_the_timeout_and_the_job_ends(tmp_path):
    run = tmp_path / "run"
    r = launch(ROOT, _args(run, "parallel.timeout_s=4"), nproc=2, env={"MEGASSM_FAULT": "hang:1:4"}, timeout=300,
               torchrun=True)
    assert r.returncode != 0, r.stderr[-3000:]
    assert "[rank 1] megassm: MEGASSM_FAULT=hang:1:4: stalls before step 4" in r.stderr
    assert "Timed out waiting 4000ms" in r.stderr, r.stderr[-3000:]  # rank 0's gradient all-reduce
    # rank 0 fails after the timeout; torchrun then SIGTERMs the stalled rank (which only notes it, as a
    # preemption request) and SIGKILLs it after its grace period
    assert r.seconds < 4 + GRACE_S + START_S, r.seconds
    _assert_no_rank_alive(run)
    assert _checkpoint_steps(run) == [2]


def test_a_rank_stalled_before_the_save_leaves_no_checkpoint_of_that_step(tmp_path):
    """Rank 1 finishes step 4 and stalls before its checkpoint; rank 0 writes step 4 but must not publish it
    before every rank has confirmed the step (under NCCL the watchdog's abort can let the peers finish a step
    on garbage: a published checkpoint of it would be resumed from)."""
    run = tmp_path / "run"
    r = launch(ROOT, _args(run, "parallel.timeout_s=4"), nproc=2, env={"MEGASSM_FAULT": "hangsave:1:4"},
               timeout=300, torchrun=True)
    assert r.returncode != 0, r.stderr[-3000:]
    assert "[rank 1] megassm: MEGASSM_FAULT=hangsave:1:4: stalls before the checkpoint of step 4" in r.stderr
    assert r.seconds < 4 + GRACE_S + START_S, r.seconds
    _assert_no_rank_alive(run)
    assert _checkpoint_steps(run) == [2]
    assert not [d for d in os.listdir(run / "checkpoints") if d.startswith(".tmp-")]  # rank 0 removed its temp


def test_sigusr2_prints_every_threads_stack_and_training_goes_on(tmp_path):
    """A user's view of a hung rank: `kill -USR2 PID` prints where each thread waits, the process lives on."""
    import time

    env = {**os.environ, "MEGASSM_FAULT": "hang:0:3:8", "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "megassm.train", *_args(tmp_path / "run")], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        deadline = time.monotonic() + 120
        while "stalls before step 3" not in seen and time.monotonic() < deadline and p.poll() is None:
            # read only what is there (unbuffered): a run that prints nothing more must not block the test
            if select.select([p.stderr], [], [], 1.0)[0]:
                seen += os.read(p.stderr.fileno(), 65536).decode(errors="replace")
        assert "stalls before step 3" in seen, seen[-2000:]
        p.send_signal(signal.SIGUSR2)
        rest = p.communicate(timeout=120)[1]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, rest[-3000:]  # the dump did not stop training: the stall ends, the run finishes
    assert "Current thread" in rest and "faults.py" in rest and "in at_step" in rest, rest[-3000:]


def test_checkpoint_writer_killed_mid_save_leaves_no_complete_looking_checkpoint(tmp_path):
    """The writer (rank 0) SIGKILLed before the completion marker (meta.json) or before the rename: the new
    step is not listed, `--resume auto` picks the previous checkpoint, the temp directory stays for inspection.
    One interpreter (torch imported once) forks a writer per stage."""
    stages = {"meta": "disk.write_json = die", "rename": "os.rename = die"}
    code = textwrap.dedent(f"""
        import os, signal, sys, torch
        from megassm.training import checkpoint as ckpt
        from megassm.training.checkpoint import disk

        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        for stage, patch in {stages!r}.items():
            pid = os.fork()
            if pid == 0:  # the writer: one good checkpoint, then one killed mid-save
                model = torch.nn.Linear(4, 4)
                opt = torch.optim.AdamW(model.parameters())
                model(torch.ones(1, 4)).sum().backward()
                opt.step()
                run = os.path.join({str(tmp_path)!r}, stage)
                for step in (1, 2):
                    if step == 2:
                        exec(patch)
                    ckpt.save_checkpoint(run, step, model=model, optimizer=opt,
                                         extra={{"rng": ckpt.capture_rng_state()}})
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            print(stage, os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0 and r.stdout.split() == ["meta", "True", "rename", "True"], (r.stdout, r.stderr[-2000:])
    for stage in stages:
        run = str(tmp_path / stage)
        assert _checkpoint_steps(run) == [1]
        assert ckpt.resolve_resume(run, "auto") == os.path.join(run, "checkpoints", "step_00000001")
        assert [n for n in os.listdir(os.path.join(run, "checkpoints")) if n.startswith(".tmp-step_00000002-")]


def _group_timeout_worker(rank, world):
    import datetime
    import importlib.util

    import torch
    import torch.distributed as dist

    from megassm.parallel import state

    assert state.init_distributed("cpu", timeout_s=7)  # the group itself (spawn: the environment only)
    want = datetime.timedelta(seconds=7)
    builders = ["torch"] + (["megatron"] if importlib.util.find_spec("megatron") else [])
    for builder in builders:
        os.environ["MEGASSM_PROCESS_GROUPS"] = builder
        groups = state.build_groups(tp=2)
        foreign = dist.new_group([0, 1])  # as DeepSpeed creates its groups: no timeout given
        for name, pg in [("world", dist.group.WORLD), ("tp", groups.tp_group), ("dp", groups.dp_group),
                         ("cp", groups.cp_group), ("pp", groups.pp_group), ("foreign", foreign)]:
            got = pg._get_backend(torch.device("cpu")).options._timeout
            assert got == want, (builder, name, got)
    state.destroy()


def test_every_process_group_gets_the_configured_timeout():
    """torch gives a group created without a timeout its own default (30 min on gloo), not the world group's:
    the groups of both builders (plain torch, megatron-core when installed) and a foreign one all get 7 s."""
    spawn(_group_timeout_worker, 2, group=False)

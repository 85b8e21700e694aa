"""The generated sbatch script under a real SLURM: two nodes on this machine (tests/slurm_cluster.py: munged,
slurmctld, and a slurmd per node in its own network, UTS and mount namespaces). The job is what
`megassm-launch slurm --nodes 2 --gpus-per-node 2` writes, less its `#SBATCH --gpus-per-node` line (these nodes
have no GPU, so SLURM refuses a GPU request), submitted with sbatch: 2 nodes x 2 CPU ranks over gloo, HSDP
(FSDP2 shards inside each node, replicas across the nodes). Mid-run the training processes of node n2 are
SIGKILLed; the job must end by itself, is requeued (scontrol requeue, the operator's or the cluster's policy)
and resumes from the last complete checkpoint. Then SIGUSR1 to its batch shell (what `--signal=B:USR1@LEAD`
sends before the time limit): the ranks on both hosts checkpoint, the script requeues the job itself, and it
resumes again. It ends with the losses of an uninterrupted job of the same layout, step for step.

Needs root and Debian's slurmctld, slurmd, slurm-client and munge (.ci/run installs them); skipped otherwise.
Also here, without the cluster: every exit code that ends the job has the script's hint."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megassm.launch import slurm
from megassm.training import failures

import slurm_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHY_NOT = slurm_cluster.missing()
needs_cluster = pytest.mark.skipif(WHY_NOT is not None, reason=f"real SLURM cluster: {WHY_NOT}")

STEPS = 60
SAVE = 4
TINY = ["data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=32", "model.mamba.d_state=8",
        "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.attn.n_heads=2", "model.mlp.ffn_hidden=64",
        "train.seq_len=32", "train.micro_batch=1", "train.global_batch=4", "train.log_interval=1",
        "train.eval_interval=0", "run.progress=false", f"run.save_interval={SAVE}", "run.keep_last=3",
        "train.device=cpu", f"train.steps={STEPS}",
        "parallel.engine=fsdp2", "parallel.shard_size=2", "parallel.gpus_per_node=2"]
GPU_LINE = "#SBATCH --gpus-per-node=2"


@pytest.fixture
def cluster(tmp_path):
    with slurm_cluster.SlurmCluster(tmp_path / "cluster") as c:
        yield c


def _write_scripts(tmp_path, runs: dict[str, list[str]]) -> dict[str, str]:
    """megassm-launch slurm for each run directory (in parallel: each imports torch), then the script a GPU-less
    node accepts: the same text without the `#SBATCH --gpus-per-node` line."""
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "megassm.launch.cli", "slurm", "--nodes", "2", "--gpus-per-node", "2",
         "--config", "configs/tiny.yaml", "--python", sys.executable, *extra, f"run.dir={tmp_path / name}", *TINY],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name, extra in runs.items()}
    scripts = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        path = tmp_path / name / "launch" / "job.sbatch"
        with open(path) as f:
            text = f.read()
        assert out == f"{path}\n" and text.count(GPU_LINE + "\n") == 1  # stdout: the script's path
        scripts[name] = str(tmp_path / f"{name}.sbatch")
        with open(scripts[name], "w") as f:
            f.write(text.replace(GPU_LINE + "\n", ""))
    return scripts


def _records(run_dir, polling=False):
    """metrics.jsonl's records; `polling`: while rank 0 writes it, a last line not yet complete is left out."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if polling and not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.readlines()
    if polling and lines and not lines[-1].endswith("\n"):
        lines.pop()
    return [json.loads(x) for x in lines if x.strip()]


def _losses(run_dir, polling=False):
    return {r["step"]: r["loss"] for r in _records(run_dir, polling) if "loss" in r}


def _complete_checkpoints(run_dir):
    d = os.path.join(run_dir, "checkpoints")
    return sorted(int(n[5:]) for n in os.listdir(d) if n.startswith("step_") and
                  os.path.exists(os.path.join(d, n, "meta.json"))) if os.path.isdir(d) else []


def _pids(run_dir):
    """{pid-file name: pid} of RUN_DIR/pids/<host>-<rank>.pid, written by each rank at start."""
    d = os.path.join(run_dir, "pids")
    return {n: int(open(os.path.join(d, n)).read()) for n in sorted(os.listdir(d))} if os.path.isdir(d) else {}


def _cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")


def _ppid(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _wait_for(cluster, job, done, timeout, what):
    deadline = time.monotonic() + timeout
    while not done():
        state = cluster.job(job)
        if state["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING") or time.monotonic() > deadline:
            raise AssertionError(f"{what}: job {job} is {state['JobState']} ({state.get('Reason')})\n"
                                 f"{cluster.logs_tail()}")
        time.sleep(0.05)


def _wait_resumed(cluster, job, run, step, trained_to):
    """The job's next run resumed from checkpoint `step` and has logged step `trained_to` (past the lines an
    earlier attempt left, which the resume removed)."""
    line = f"resumed from {os.path.join(run, 'checkpoints', f'step_{step:08d}')} at step {step}"
    _wait_for(cluster, job, lambda: line in _log(run, job) and
              max(_losses(run, polling=True), default=0) >= trained_to, 240, f"the job to resume from step {step}")


def _log(run_dir, job):
    with open(os.path.join(run_dir, "logs", f"slurm-{job}.out"), errors="replace") as f:
        return f.read()


def test_every_code_that_ends_the_job_has_a_hint():
    """The script ends the job on every exit code but 99 and prints what to do: each code megassm-train may
    end with (megassm/training/failures.py) has its line, or the user reads only a number."""
    codes = {v for k, v in vars(failures).items() if k.startswith("EXIT_")}
    assert set(slurm.NO_REQUEUE_HINTS) == codes - {failures.EXIT_OK, failures.EXIT_PREEMPTED, failures.EXIT_ABORTED}
    assert slurm.PREEMPT_EXIT_CODE == failures.EXIT_PREEMPTED


@needs_cluster
def test_two_node_job_loses_a_node_requeues_and_resumes_exactly(cluster, tmp_path):
    run, ref = str(tmp_path / "run"), str(tmp_path / "ref")
    # the reference job uses another rendezvous port: it shares node n1 with the job
    scripts = _write_scripts(tmp_path, {"run": [], "ref": ["--port", "29501"]})
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}

    # 1. the fault: mid-run, node n2's training processes are SIGKILLed (found by their PID files, checked to
    # be megassm ranks in n2's network namespace)
    job = cluster.sbatch(scripts["run"], env, cwd=str(tmp_path))
    _wait_for(cluster, job, lambda: len(_pids(run)) == 4 and max(_complete_checkpoints(run), default=0) >= 2 * SAVE,
              240, "four ranks and a checkpoint")
    pids = _pids(run)
    assert sorted(pids) == ["n1-0.pid", "n1-1.pid", "n2-2.pid", "n2-3.pid"], pids
    for name, pid in pids.items():
        assert cluster.node_of(pid) == name[:2], (name, pid)
        assert b"megassm.train" in _cmdline(pid)
    # n2's torchrun agent joined the rendezvous at n1's address on the bridge (its own loopback is not n1's)
    agent = _cmdline(_ppid(pids["n2-2.pid"]))
    assert f"--rdzv-endpoint={slurm_cluster.ADDR['n1']}:29500".encode() in agent, agent
    for name in ("n2-2.pid", "n2-3.pid"):
        os.kill(pids[name], signal.SIGKILL)
    newest = _complete_checkpoints(run)[-1]

    # the job ends by itself (torchrun on n2, then srun --kill-on-bad-exit), and is not requeued by the script
    failed = cluster.wait_job(job, {"FAILED"}, 150)
    assert failed["ExitCode"] != "0:0" and failed["Restarts"] == "0", failed
    resume_from = _complete_checkpoints(run)[-1]  # a save under way at the kill may have completed
    killed_at = max(_losses(run, polling=True))  # a line cut short by the crash is not a step
    assert newest <= resume_from <= killed_at < STEPS
    log = _log(run, job)
    assert "host      : n2" in log and "(SIGKILL)" in log and "requeueing" not in log, log[-4000:]

    # 2. requeued as an operator (or a requeue-on-failure policy) does; SLURM starts it once eligible again.
    # The uninterrupted reference job runs meanwhile
    cluster.scontrol("requeue", str(job))
    ref_job = cluster.sbatch(scripts["ref"], env, cwd=str(tmp_path))
    _wait_resumed(cluster, job, run, resume_from, killed_at + 2)

    # 3. SIGUSR1 before the time limit, as SLURM sends it: the batch shell's trap reaches the ranks on both
    # hosts by their PID files (one srun task per node), they checkpoint and exit 99, the script requeues
    cluster.client("scancel", "--signal=USR1", "--batch", str(job))
    done = cluster.wait_job(job, {"COMPLETED"}, 300)
    assert done["Restarts"] == "2" and done["ExitCode"] == "0:0" and done["NodeList"] == "n[1-2]", done
    assert cluster.wait_job(ref_job, {"COMPLETED"}, 300)["Restarts"] == "0"
    log = _log(run, job)
    assert f"megassm: checkpointed; requeueing job {job}" in log and "last_exit.json 99)" in log, log[-4000:]
    preempted = [int(k) for k in re.findall(r"megassm-train: preempted \(.*?\) at step (\d+)", log)]
    assert len(preempted) == 1 and killed_at + 2 <= preempted[0] < STEPS, preempted
    resumed = [int(k) for k in re.findall(r"resumed from \S+/checkpoints/step_\d+ at step (\d+)", log)]
    assert resumed == [resume_from, preempted[0]], resumed

    head = f"head n1 ({slurm_cluster.ADDR['n1']})"  # the rendezvous address: n1's IP, never localhost
    for restart in range(3):
        assert f"megassm: job {job} restart {restart} on n[1-2], {head}" in log, log[-4000:]
        assert os.path.isdir(os.path.join(run, "logs", f"torchrun-{job}-{restart}"))
    for node, rank in (("n1", 0), ("n2", 1)):  # each node's task, on its own host
        assert log.count(f"megassm: node {node}: SLURM node {rank} of 2 starts torchrun") == 3, log[-4000:]
    assert json.load(open(os.path.join(run, "last_exit.json")))["exit_code"] == 0

    # the losses of an uninterrupted job on the same nodes, same layout: exactly (fp32; NaN fails ==), one
    # record per step (the lines logged after the checkpoint a run resumes from are replaced)
    got, want = _losses(run), _losses(ref)
    assert sorted(want) == list(range(1, STEPS + 1)), sorted(want)
    assert got == want, {s: (got.get(s), want[s]) for s in want if got.get(s) != want[s]}
    steps = [r["step"] for r in _records(run) if "loss" in r]
    assert steps == list(range(1, STEPS + 1)), steps

"""megassm-launch slurm: node lists, hostfiles, the script's checks, and the generated sbatch script itself
run on this machine as a two-node job (stand-ins for srun / scontrol / hostname; two torchrun agents, two
CPU ranks each, gloo): it trains, a SIGUSR1 to the batch shell checkpoints and requeues, the requeued job
resumes and ends with the losses of an uninterrupted run."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from megassm.launch import slurm
from megassm.launch.cli import main

from multiproc import free_port, run_bounded, stop, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_expand_nodelist():
    assert slurm.expand_nodelist("gpu[01-03,07]") == ["gpu01", "gpu02", "gpu03", "gpu07"]
    assert slurm.expand_nodelist("a1,b[9-10],c") == ["a1", "b9", "b10", "c"]
    assert slurm.expand_nodelist("n[1-2]-ib") == ["n1-ib", "n2-ib"]
    assert slurm.expand_nodelist("r[1-2]n[01-02]") == ["r1n01", "r1n02", "r2n01", "r2n02"]
    for bad in ("gpu[03-01]", "gpu[a-b]", "gpu[1-2", ""):
        with pytest.raises(ValueError, match="node list"):
            slurm.expand_nodelist(bad)
    assert slurm.hostfile_text(["g1", "g2"], 8) == "g1 slots=8\ng2 slots=8\n"


def _script(tmp_path, *extra, launcher="torchrun"):
    r = subprocess.run([sys.executable, "-m", "megassm.launch.cli", "slurm", "--nodes", "2", "--gpus-per-node", "2",
                        "--config", "configs/tiny.yaml", "--launcher", launcher, "--time", "1:00:00", "--dry-run",
                        f"run.dir={tmp_path}/run", "train.global_batch=32", *extra], capture_output=True, text=True, cwd=ROOT)
    return r


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_script_is_valid_bash_with_the_contract(tmp_path, launcher):
    r = _script(tmp_path, launcher=launcher)
    assert r.returncode == 0, r.stderr
    path = tmp_path / "job.sbatch"
    path.write_text(r.stdout)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    if shutil.which("shellcheck"):
        assert subprocess.run(["shellcheck", "-S", "error", str(path)]).returncode == 0
    s = r.stdout
    for line in ("#SBATCH --nodes=2", "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", "#SBATCH --time=1:00:00",
                 "trap forward_usr1 USR1", "scontrol requeue", "run.resume=auto", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 'rm -f "$RUN_DIR/last_exit.json"', 'grep -qa megassm "/proc/$p/cmdline"', "4) echo \"megassm: exit 4:"):
        assert line in s, line
    code = "\n".join(x for x in s.splitlines() if not x.lstrip().startswith("#"))
    assert "localhost" not in code and "127.0.0.1" not in code
    if launcher == "deepspeed":
        assert "deepspeed.launcher.runner" in s and "slots=2" in s and "--no_local_rank --module megassm.train" in s
    else:
        assert "--rdzv-backend=c10d" in s and '--rdzv-endpoint="$HEAD_ADDR:29500"' in s
    assert not (tmp_path / "run").exists()  # --dry-run writes nothing


def test_config_errors_fail_before_anything_is_written(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megassm.launch.cli", "slurm", "--nodes", "2", "--gpus-per-node", "8",
                        "--config", "configs/tiny.yaml", f"run.dir={tmp_path}/run"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 2 and "world size 16" in r.stderr and "train.global_batch=8" in r.stderr
    r = _script(tmp_path, "data.builtin=null", "data.paths=[/nonexistent/shards]")
    assert r.returncode == 2 and "/nonexistent/shards" in r.stderr
    assert main(["slurm", "--nodes", "1", "--gpus-per-node", "1", "--config", "configs/tiny.yaml", "--time", "90min",
                 f"run.dir={tmp_path}/run"]) == 2
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------------
# the script, run as a two-node job on this machine

FAKE_SRUN = r"""#!/bin/bash
# srun stand-in: run the command once per node of --nodes (all on this machine), wait for all of them
n=1
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in --nodes=*) n=${1#--nodes=} ;; -w) shift ;; esac
  shift
done
pids=()
for i in $(seq 0 $((n - 1))); do SLURM_NODEID=$i "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""
FAKE_SCONTROL = r"""#!/bin/bash
case "$1 $2" in
  "show hostnames") printf 'node1\nnode2\n' ;;
  requeue*) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
  *) echo "scontrol stand-in: $*" >&2; exit 1 ;;
esac
"""
FAKE_HOSTNAME = ('#!/bin/bash\nif [ "${1:-}" = --ip-address ]; then echo 127.0.0.1; else exec %s "$@"; fi\n'
                 % shutil.which("hostname"))

TINY = ["data.builtin=stdlib", "model.pattern=M*M-", "model.d_model=32", "model.mamba.d_state=8",
        "model.mamba.headdim=16", "model.mamba.chunk_size=16", "model.attn.n_heads=2", "model.mlp.ffn_hidden=64",
        "train.seq_len=32", "train.micro_batch=1", "train.global_batch=4", "train.log_interval=1",
        "train.eval_interval=0", "run.progress=false", "run.save_interval=0", "train.device=cpu", "train.steps=30"]


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, filter(str.strip, f)) if "loss" in r}


def test_generated_script_trains_preempts_requeues_and_resumes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("hostname", FAKE_HOSTNAME)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run = str(tmp_path / "run")
    r = subprocess.run([sys.executable, "-m", "megassm.launch.cli", "slurm", "--nodes", "2", "--gpus-per-node", "2",
                        "--config", "configs/tiny.yaml", "--port", str(free_port()), "--python", sys.executable,
                        f"run.dir={run}", *TINY], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    script = os.path.join(run, "launch", "job.sbatch")
    assert os.access(script, os.X_OK)
    assert r.stdout == f"{script}\n"  # the result: the script's path; the script itself is logged on stderr
    assert "memory check: none: train.device=cpu" in r.stderr  # CPU ranks: no GPU memory to fit
    version = json.load(open(os.path.join(run, "launch", "version.json")))
    assert version["nodes"] == 2 and "git_commit" in version and version["source"] == ROOT  # the checkout
    assert (version["gpu"], version["memory_check"]) == (None, False)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node[1-2]", "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}

    # first allocation: SIGUSR1 to the batch shell once training runs -> checkpoint, exit 99, requeue
    p = subprocess.Popen(["bash", script], env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until(p, lambda: os.path.exists(os.path.join(run, "metrics.jsonl")) and len(_losses(run)) >= 2, 180,
                   "two logged steps of the first allocation", group=True)
        p.send_signal(signal.SIGUSR1)
        out, err = p.communicate(timeout=180)
    finally:
        stop(p, group=True)  # whatever of the job is still running (its ranks outlive a killed batch shell)
    assert p.returncode == 0, err[-3000:]
    status = json.load(open(os.path.join(run, "last_exit.json")))
    k = status["step"]
    assert status["exit_code"] == 99 and 2 <= k < 30, status
    assert (tmp_path / "slurm.log").read_text() == "requeue 4242\n"
    assert "checkpointed; requeueing job 4242" in err
    # the stand-in `hostname --ip-address` answers 127.0.0.1, as Debian's /etc/hosts makes it on a real node: the
    # script takes the node's first non-loopback IPv4 address instead (hostname -I), which other nodes can reach
    head = re.search(r"head node1 \(([0-9.]+)\)", out)
    assert head and not head.group(1).startswith("127."), out[-2000:]

    # the requeued job: same script, resumes from step k and finishes
    r = run_bounded(["bash", script], 300, env={**env, "SLURM_RESTART_COUNT": "1"}, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.load(open(os.path.join(run, "last_exit.json")))["exit_code"] == 0
    assert (tmp_path / "slurm.log").read_text() == "requeue 4242\n"  # no second requeue
    assert os.path.isdir(os.path.join(run, "logs", "torchrun-4242-1"))  # per-restart, per-rank logs
    assert len(os.listdir(os.path.join(run, "pids"))) == 4  # one per rank: how the trap finds them

    # an uninterrupted 4-rank run gives the same losses at every step
    straight = str(tmp_path / "straight")
    r = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                     "-m", "megassm.train", "--config", "configs/tiny.yaml", *TINY, f"run.dir={straight}"], 300,
                    env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    # equal to fp32 rounding: torch DDP reduces the first step after the resume with its initial bucket
    # layout, the uninterrupted run with the layout it rebuilt after step 1 (gloo's ring sums each element in
    # an order that depends on its offset in the bucket), so single bits may differ (docs/parallelism.md)
    got, want = _losses(run), _losses(straight)
    assert sorted(got) == sorted(want) and all(abs(got[s] - want[s]) <= 1e-6 * abs(want[s]) for s in want), (got, want)

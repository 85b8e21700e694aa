"""SLURM batch scripts for multi-node training (`megassm-launch slurm`, docs/launch.md).

    nodes = expand_nodelist("gpu[01-03,07]")            # ['gpu01', 'gpu02', 'gpu03', 'gpu07']
    text = batch_script(SlurmJob(...))                  # the sbatch script, torchrun or the DeepSpeed launcher

One SLURM task per node logs its host, then runs the launcher, which starts one training process per GPU with
the same command line as `megassm-launch local` (`launch.cli.train_command`). The rendezvous address is the first
node of the allocation, resolved to an IP on a compute node (no localhost fallback: an unresolved head
stops the job). `#SBATCH --signal=B:USR1@LEAD` reaches only the batch shell, whose trap forwards SIGUSR1 to
the training processes on every node by the PID files they write (RUN_DIR/pids/<host>-<rank>.pid), never to
the launcher between, which would die of it; they checkpoint at the same step boundary and exit 99 (megassm/training/preemption.py). Rank 0
records the code in RUN/last_exit.json; 99 there makes the script requeue the job, which resumes with
run.resume=auto. Every other code ends the job with that code (docs/reliability.md): a requeue could not
fix a full disk (4), a run directory in use by another trainer (5) or damaged checkpoints (6).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

__all__ = ["expand_nodelist", "hostfile_text", "SlurmJob", "batch_script", "launcher_command"]

PREEMPT_EXIT_CODE = 99  # megassm.training.preemption.PREEMPT_EXIT_CODE (not imported: no torch needed here)
# megassm.training.failures: the codes a requeue cannot fix, each with what the job's log tells the user
NO_REQUEUE_HINTS = {
    2: "config or input error (the message above names it): fix it, then resubmit",
    3: "non-finite loss: resume from the checkpoint named above, perhaps with a lower optim.lr",
    4: "I/O error (full disk or unwritable run directory): fix it, then resubmit; the run resumes where it stopped",
    5: "the run directory is in use by another trainer (named above): not requeued",
    6: "no intact checkpoint to resume from (each is named above): restore one or start a new run.dir",
    7: "loss spikes went on past train.spike_max_rollbacks rollbacks (step and checkpoint named above): inspect the "
       "data near that step or lower optim.lr, then resubmit",
}


def _split_top(expr: str) -> list[str]:
    """Split at commas outside brackets; unbalanced brackets are an error."""
    parts, depth, cur = [], 0, ""
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f"node list {expr!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"node list {expr!r}: unbalanced brackets")
    return parts + [cur]


def expand_nodelist(expr: str) -> list[str]:
    """SLURM's compact host list ("gpu[01-03,07],login1") as host names, in order, zero padding kept."""
    hosts: list[str] = []
    for part in _split_top(expr.replace(" ", "")):
        if not part:
            raise ValueError(f"node list {expr!r}: empty host name")
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", part)
        if not m:
            if "[" in part or "]" in part:
                raise ValueError(f"node list {expr!r}: cannot parse {part!r}")
            hosts.append(part)
            continue
        prefix, ranges, rest = m.groups()
        tails = expand_nodelist(rest) if rest else [""]
        for r in ranges.split(","):
            if not re.fullmatch(r"\d+(-\d+)?", r):
                raise ValueError(f"node list {expr!r}: bad range {r!r} in {part!r}")
            lo, _, hi = r.partition("-")
            hi = hi or lo
            if int(hi) < int(lo):
                raise ValueError(f"node list {expr!r}: range {r!r} runs backwards")
            for i in range(int(lo), int(hi) + 1):
                hosts.extend(f"{prefix}{str(i).zfill(len(lo))}{t}" for t in tails)
    return hosts


def hostfile_text(hosts: list[str], slots: int) -> str:
    """A DeepSpeed hostfile: one `host slots=G` line per node."""
    return "".join(f"{h} slots={slots}\n" for h in hosts)


@dataclass
class SlurmJob:
    nodes: int
    gpus_per_node: int
    config: str
    overrides: list[str]
    run_dir: str
    job_name: str = "megassm"
    time: str | None = None  # HH:MM:SS or D-HH:MM:SS
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    signal_lead_s: int = 300  # SIGUSR1 this long before the time limit: one step plus a checkpoint must fit
    port: int = 29500
    launcher: str = "torchrun"  # torchrun | deepspeed
    python: str = "python3"
    extra_sbatch: list[str] = field(default_factory=list)


def launcher_command(job: SlurmJob, train_args: list[str]) -> str:
    """The command one SLURM task runs on each node (shell text; $HEAD_ADDR etc. are set by the script)."""
    py = shlex.quote(job.python)
    if job.launcher == "torchrun":
        return (f"{py} -m torch.distributed.run --nnodes={job.nodes} --nproc-per-node={job.gpus_per_node} "
                f"--rdzv-backend=c10d --rdzv-endpoint=\"$HEAD_ADDR:{job.port}\" --rdzv-id=\"$SLURM_JOB_ID\" "
                f"--log-dir=\"$RUN_DIR/logs/torchrun-$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}\" --tee=3 "
                + shlex.join(train_args))
    if job.launcher == "deepspeed":  # one task (the head) starts every node through the hostfile
        return (f"{py} -m deepspeed.launcher.runner --hostfile=\"$HOSTFILE\" --num_nodes={job.nodes} "
                f"--num_gpus={job.gpus_per_node} --master_addr=\"$HEAD_ADDR\" --master_port={job.port} "
                f"--no_local_rank --module " + shlex.join(train_args[1:]))  # runner's --module takes the name
    raise ValueError(f"launcher must be torchrun or deepspeed, got {job.launcher!r}")


def batch_script(job: SlurmJob, train_args: list[str]) -> str:
    """The sbatch script. `train_args` is `launch.cli.train_command(config, overrides)`."""
    if job.nodes < 1 or job.gpus_per_node < 1:
        raise ValueError(f"--nodes and --gpus-per-node must be >= 1, got {job.nodes} and {job.gpus_per_node}")
    if job.time is not None and not re.fullmatch(r"(\d+-)?\d{1,2}:\d{2}:\d{2}", job.time):
        raise ValueError(f"--time {job.time!r}: expected HH:MM:SS or D-HH:MM:SS")
    q = shlex.quote
    sb = [f"#SBATCH --job-name={job.job_name}", f"#SBATCH --nodes={job.nodes}", "#SBATCH --ntasks-per-node=1",
          f"#SBATCH --gpus-per-node={job.gpus_per_node}", f"#SBATCH --signal=B:USR1@{job.signal_lead_s}",
          "#SBATCH --requeue", "#SBATCH --open-mode=append", f"#SBATCH --output={job.run_dir}/logs/slurm-%j.out"]
    for key, val in (("time", job.time), ("partition", job.partition), ("account", job.account),
                     ("cpus-per-task", job.cpus_per_task)):
        if val is not None:
            sb.append(f"#SBATCH --{key}={val}")
    sb += [f"#SBATCH {x}" for x in job.extra_sbatch]
    one_task = job.launcher == "deepspeed"
    srun = "srun --nodes=1 --ntasks=1 -w \"$HEAD_NODE\"" if one_task else \
        f"srun --nodes={job.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1"
    hostfile = ""
    if job.launcher == "deepspeed":
        hostfile = ("HOSTFILE=\"$RUN_DIR/launch/hostfile-$SLURM_JOB_ID\"\n"
                    f"scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed 's/$/ slots={job.gpus_per_node}/' "
                    "> \"$HOSTFILE\"\n")
    return f"""#!/bin/bash
{chr(10).join(sb)}
# Written by megassm-launch slurm (docs/launch.md). One task per node runs {job.launcher}, which starts
# {job.gpus_per_node} training processes per node ({job.nodes * job.gpus_per_node} ranks in all).
set -uo pipefail
RUN_DIR={q(job.run_dir)}
mkdir -p "$RUN_DIR/logs"

# NCCL / network, set for your cluster (docs/launch.md "InfiniBand and RoCE"):
#   export NCCL_SOCKET_IFNAME=ib0        # the interface NCCL's bootstrap uses (default: ib* first, lo/docker* last)
#   export NCCL_IB_HCA=mlx5              # InfiniBand adapters to use; NCCL_IB_DISABLE=1 forces TCP
#   export NCCL_IB_GID_INDEX=3           # RoCE only, when NCCL's own choice (2.21+) is wrong or NCCL is older
#   export NCCL_DEBUG=WARN               # INFO prints the chosen transports, once per rank
# a failed or timed-out collective (parallel.timeout_s) ends the rank instead of hanging; torchrun then stops the job
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${{TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}}
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-4}}  # set, so torchrun does not set 1 with a warning banner

# rendezvous on the first node, by its first non-loopback IPv4 address, resolved on that node: the address its
# name resolves to, else its interfaces' (Debian maps a host's own name to 127.0.1.1 in /etc/hosts, which the other
# nodes cannot reach); never a localhost fallback
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
HEAD_ADDR=$(srun --nodes=1 --ntasks=1 -w "$HEAD_NODE" bash -c \
  'for a in $(hostname --ip-address 2>/dev/null) $(hostname -I 2>/dev/null); do
     case "$a" in 127.*|*:*) ;; *.*.*.*) echo "$a"; exit 0 ;; esac
   done' 2>/dev/null | head -n 1)
if [ -z "$HEAD_NODE" ] || [ -z "$HEAD_ADDR" ]; then
  echo "megassm: cannot resolve the head node's address to a non-loopback IPv4 address (node list" \
       "'$SLURM_JOB_NODELIST'; on $HEAD_NODE: hostname --ip-address and hostname -I gave none)" >&2
  exit 1
fi
export HEAD_ADDR
{hostfile}echo "megassm: job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST, head $HEAD_NODE ($HEAD_ADDR)"

# SIGUSR1 before the time limit: forward it to the training processes on every node (never to the launcher's
# children); each writes RUN_DIR/pids/<host>-<rank>.pid at start. They checkpoint at the same step and exit
# {PREEMPT_EXIT_CODE}, then the job is requeued below
forward_usr1() {{
  echo "megassm: SIGUSR1 before the time limit: asking the training processes to checkpoint" >&2
  srun --overlap --nodes={job.nodes} --ntasks-per-node=1 bash -c \\
    'for f in "$0"/pids/"$(hostname)"-*.pid; do [ -e "$f" ] && p=$(cat "$f") && grep -qa megassm "/proc/$p/cmdline" 2>/dev/null && kill -USR1 "$p"; done; true' "$RUN_DIR" || true
}}
trap forward_usr1 USR1

# a stale code must not decide this run's requeue. RUN_DIR/pids is not cleared here: when another trainer
# holds the directory its files are live; the trainer clears them once it holds the lock, and the trap above
# signals only PIDs that are megassm processes
rm -f "$RUN_DIR/last_exit.json"
{_head_note(job)}{srun} \\
  bash -c '{_node_prologue(job)}echo "megassm: node $(hostname): SLURM node ${{SLURM_NODEID:-?}} of ${{SLURM_NNODES:-?}} starts {job.launcher}" >&2; exec "$@"' megassm-node \\
  {launcher_command(job, train_args)} &
STEP_PID=$!
while true; do  # `wait` returns early when the trap fires; wait again until the step ends
  wait "$STEP_PID"; rc=$?
  kill -0 "$STEP_PID" 2>/dev/null || break
done

code=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["exit_code"])' \\
       "$RUN_DIR/last_exit.json" 2>/dev/null || echo "$rc")
echo "megassm: training exited (srun $rc, last_exit.json $code)" >&2
if [ "$code" = "{PREEMPT_EXIT_CODE}" ]; then
  echo "megassm: checkpointed; requeueing job $SLURM_JOB_ID (resumes with run.resume=auto)" >&2
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
case "$code" in
{_hint_cases()}
esac
exit "$code"
"""


def _head_note(job: SlurmJob) -> str:
    if job.launcher != "torchrun":
        return ""
    return ("# the first node hosts torchrun's rendezvous store: said outright (PET_RDZV_CONF is --rdzv-conf), since\n"
            "# torchrun's own guess compares HEAD_ADDR with the addresses the node's name resolves to, and misses when\n"
            "# that name maps to a loopback address in /etc/hosts\n")


def _node_prologue(job: SlurmJob) -> str:
    if job.launcher != "torchrun":
        return ""
    return 'export PET_RDZV_CONF=is_host=$([ "${SLURM_NODEID:-0}" = 0 ] && echo 1 || echo 0); '


def _hint_cases() -> str:
    return "\n".join(f"  {code}) echo \"megassm: exit {code}: {hint}\" >&2 ;;" for code, hint in NO_REQUEUE_HINTS.items())

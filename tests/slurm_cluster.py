"""A real SLURM cluster of two compute nodes on this machine, for tests/test_slurm_cluster.py (docs/launch.md,
"Rehearsal on a real SLURM").

    with SlurmCluster(tmp_path / "cluster") as c:      # root, Debian's slurmctld, slurmd, slurm-client, munge
        job = c.sbatch(script, env)                    # real sbatch; the job runs on nodes n1 and n2
        c.wait_job(job, {"FAILED"}, 120)

One munged and slurmctld in this machine's network namespace, the controller at 10.77.0.1 on a bridge; each
slurmd in a network namespace of its own (10.77.0.2, 10.77.0.3, joined to the bridge by a veth pair) and its
own UTS and mount namespaces: its own host name (n1, n2), and /etc/hosts and /etc/resolv.conf bind-mounted from
the cluster's directory. So each node has its own loopback and host name: a job step that rendezvouses on
localhost, or names the wrong host, fails here as on a real cluster. Everything the daemons write (configs,
state, spool, logs, the munge key) is under the cluster's directory; their ports are picked free.

Daemons run in the foreground as children of the test (PR_SET_PDEATHSIG: they die with it). Jobs outlive
slurmd (slurmstepd detaches), so stop() kills every process in each node's network namespace, by PID, then
the controller and munged, then deletes the namespaces, veths and bridge. A reaper process does the same if
the test process dies without stop() (a pytest-timeout kill); a run that finds a stale cluster (a crash, a
killed reaper) under the lock removes it first. `python3 tests/slurm_cluster.py cleanup` does it by hand.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

NODES = ("n1", "n2")
CTL = "ctl"
SUBNET = "10.77.0"
CTL_ADDR = f"{SUBNET}.1"
ADDR = {n: f"{SUBNET}.{i + 2}" for i, n in enumerate(NODES)}
NETNS = {n: f"megassm-slurm-{n}" for n in NODES}
VETH = {n: f"mgsl-{n}" for n in NODES}  # host side; the node side is eth0 in its namespace
BRIDGE = "mgsl-br0"
LOCK = "/run/megassm-slurm-cluster.lock"  # one cluster at a time: the names and the subnet are fixed
STATE = "/run/megassm-slurm-cluster.json"  # what a later run or the reaper needs to remove a stale cluster
CRED_EXPIRE_S = 10  # a requeued job waits this + 1 s before it may start again (SLURM's default: 120 s)

PACKAGES = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
            "squeue": "slurm-client", "scontrol": "slurm-client", "ip": "iproute2", "nsenter": "util-linux",
            "unshare": "util-linux"}


def which(exe: str) -> str | None:
    """The program's path; the daemons are in /usr/sbin, which a non-login PATH may lack."""
    return shutil.which(exe, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def missing() -> str | None:
    """Why the cluster cannot be built here (the test's skip reason), or None."""
    if os.geteuid() != 0:
        return "needs root: network namespaces, a bridge, and slurmd running jobs as any user"
    absent = sorted({pkg for exe, pkg in PACKAGES.items() if which(exe) is None})
    if absent:
        return f"needs the packages {' '.join(absent)} (apt-get install -y {' '.join(absent)}; .ci/run does)"
    return None


def _run(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    cmd = (which(cmd[0]) or cmd[0], *cmd[1:])
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _proc_start(pid: int) -> str | None:
    """Start time in clock ticks since boot (tells a live daemon from a reused PID); None once it has exited
    (a zombie included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else fields[19]


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the test process dies; survives the execs of nsenter/unshare/sh."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def netns_pids(ns: str) -> list[int]:
    r = _run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def _kill_netns(ns: str) -> None:
    """SIGKILL every process in a node's network namespace until none is left (a job step may still fork)."""
    for _ in range(50):
        pids = netns_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"processes left in network namespace {ns}: {netns_pids(ns)}")


def _kill_pid(pid: int, start: str | None, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace`, the process `pid` if it is still the one that started at `start`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        deadline = time.monotonic() + grace
        if start is None or _proc_start(pid) != start:
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        while _proc_start(pid) == start and time.monotonic() < deadline:
            time.sleep(0.05)


def teardown(state: dict | None = None) -> None:
    """Remove a cluster: its nodes' processes, its daemons (by the PIDs in `state`), namespaces, links."""
    for ns in NETNS.values():
        _kill_netns(ns)
    for d in (state or {}).get("daemons", []):
        _kill_pid(d["pid"], d["start"])
    existing = _run("ip", "netns", "list", check=False).stdout
    for ns in NETNS.values():
        if re.search(rf"^{re.escape(ns)}\b", existing, re.M):
            _run("ip", "netns", "delete", ns, check=False)
    links = (*VETH.values(), BRIDGE)
    for link in links:
        if os.path.exists(f"/sys/class/net/{link}"):
            _run("ip", "link", "delete", link, check=False)
    deadline = time.monotonic() + 10  # a namespace's veth goes with it, asynchronously: the names must be free
    while any(os.path.exists(f"/sys/class/net/{link}") for link in links) and time.monotonic() < deadline:
        time.sleep(0.05)


def _reap(owner: int, owner_start: str) -> None:
    """The reaper: once the test process is gone, remove its cluster unless a later run already took over."""
    while _proc_start(owner) == owner_start:
        time.sleep(0.5)
    with open(LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # a later run holds the lock: it removed this stale cluster before building its own
        try:
            with open(STATE) as f:
                state = json.load(f)
        except (OSError, ValueError):
            return
        if state.get("owner") == owner:
            teardown(state)
            os.unlink(STATE)


class SlurmCluster:
    def __init__(self, base):
        self.base = os.path.abspath(str(base))
        self.conf = os.path.join(self.base, "etc", "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self._procs: list[subprocess.Popen] = []
        self._reaper: subprocess.Popen | None = None
        self._lock = None

    # -- building -----------------------------------------------------------------------------------------
    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self) -> None:
        self._lock = open(LOCK, "a")
        deadline = time.monotonic() + 300
        while True:  # another run's cluster (same names, same subnet) must be gone first
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{LOCK} held for 300 s by another run of the cluster test") from None
                time.sleep(1)
        try:
            with open(STATE) as f:
                stale = json.load(f)
        except (OSError, ValueError):
            stale = None
        teardown(stale)  # holding the lock, whatever carries the cluster's names is left from a dead run
        self._check_subnet_free()
        for d in ("etc", "state", "log", "munge", *(f"spool/{n}" for n in NODES)):
            os.makedirs(os.path.join(self.base, d), exist_ok=True)
        self._write_files()
        self._network()
        self._save_state()
        self._start_reaper()
        self._munged()
        self._slurmctld()
        for n in NODES:
            self._slurmd(n)
        self._wait(lambda: self.node_states() == {n: "idle" for n in NODES}, 60, "both nodes idle")

    def _check_subnet_free(self) -> None:
        used = _run("ip", "-4", "-o", "addr", "show").stdout
        if f" {SUBNET}." in used:
            raise RuntimeError(f"{SUBNET}.0/24 is in use on this machine; the rehearsal needs it:\n{used}")

    def _write_files(self) -> None:
        b = self.base
        self.ctl_port, self.slurmd_port = _free_port(), _free_port()
        hosts = ["127.0.0.1 localhost", "::1 localhost", f"{CTL_ADDR} {CTL}", *(f"{ADDR[n]} {n}" for n in NODES)]
        self._write("etc/hosts", "\n".join(hosts) + "\n")
        # no DNS on the private subnet: a lookup /etc/hosts cannot answer fails at once instead of timing out
        # (c10d's TCPStore looks up each client's v4-mapped address and would wait 10 s per connection)
        self._write("etc/resolv.conf", "nameserver 127.0.0.1\n")
        with open(os.path.join(b, "munge", "munge.key"), "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(os.path.join(b, "munge", "munge.key"), 0o400)
        nodes = "\n".join(f"NodeName={n} NodeAddr={ADDR[n]} NodeHostname={n} CPUs=4 State=UNKNOWN" for n in NODES)
        self._write("etc/slurm.conf", f"""\
# the rehearsal cluster of tests/slurm_cluster.py: every path under {b}
ClusterName=rehearsal
SlurmctldHost={CTL}({CTL_ADDR})
SlurmctldPort={self.ctl_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (121 s by default). 11 s
# suffices while no node is lost: after a node failure a retried stop request reaches the requeued job's step
# 60 s later (docs/launch.md, "A whole node lost")
AuthInfo=socket={b}/munge/munge.socket,cred_expire={CRED_EXPIRE_S}
StateSaveLocation={b}/state
SlurmdSpoolDir={b}/spool/%n
SlurmctldPidFile={b}/log/slurmctld.pid
SlurmdPidFile={b}/log/slurmd-%n.pid
SlurmctldLogFile={b}/log/slurmctld.log
SlurmdLogFile={b}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# no cgroups: processes are tracked through /proc; no task binding, no accounting
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# pending jobs are looked at every 2 s (default 60): a requeued job starts once eligible, not a minute later
SchedulerParameters=sched_interval=2
# the nodes are what this file says (4 CPUs each), whatever this machine has: two jobs fit side by side
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
{nodes}
PartitionName=rehearsal Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")

    def _write(self, rel: str, text: str) -> None:
        with open(os.path.join(self.base, rel), "w") as f:
            f.write(text)

    def _network(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{CTL_ADDR}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for n in NODES:
            ns = NETNS[n]
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", VETH[n], "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", VETH[n], "master", BRIDGE, "up")
            _run("ip", "-n", ns, "addr", "add", f"{ADDR[n]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _daemon(self, name: str, cmd: list[str]) -> subprocess.Popen:
        with open(os.path.join(self.base, "log", f"{name}.out"), "ab") as out:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                                 preexec_fn=_die_with_parent)
        self._procs.append(p)
        self._save_state()
        return p

    def _munged(self) -> None:
        m = os.path.join(self.base, "munge")
        # --force: munged refuses a socket whose parent directories are not world-searchable (pytest's tmp
        # directories are 0700); every client here is root
        self._daemon("munged", [which("munged"), "--foreground", "--force", f"--socket={m}/munge.socket",
                                f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid",
                                f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"])
        self._wait(lambda: os.path.exists(f"{m}/munge.socket"), 20, "munged's socket")

    def _slurmctld(self) -> None:
        # slurmctld runs only where the host name is SlurmctldHost's: its own UTS namespace, this machine's network
        self._daemon("slurmctld", ["unshare", "--uts", "sh", "-c", f'hostname {CTL} && exec "$1" -D -f "$0"',
                                   self.conf, which("slurmctld")])
        self._wait(lambda: "is UP" in self.scontrol("ping", check=False).stdout, 30, "slurmctld to answer")

    def _slurmd(self, node: str) -> None:
        etc = os.path.join(self.base, "etc")
        # nsenter, not `ip netns exec`: the latter remounts /sys, hiding /sys/fs/cgroup, and slurmd then stops
        # ("Unable to initialize cgroup plugin") even with proctrack/linuxproc
        script = (f'mount --bind {etc}/hosts /etc/hosts && mount --bind {etc}/resolv.conf /etc/resolv.conf && '
                  f'hostname {node} && exec "$1" -D -N {node} -f "$0"')
        self._daemon(f"slurmd-{node}", ["nsenter", f"--net=/run/netns/{NETNS[node]}", "unshare", "--uts", "--mount",
                                        "sh", "-c", script, self.conf, which("slurmd")])

    def _save_state(self) -> None:
        daemons = [{"pid": p.pid, "start": _proc_start(p.pid)} for p in self._procs]
        tmp = f"{STATE}.tmp"
        with open(tmp, "w") as f:
            json.dump({"owner": os.getpid(), "base": self.base, "daemons": daemons}, f)
        os.replace(tmp, STATE)

    def _start_reaper(self) -> None:
        self._reaper = subprocess.Popen([sys.executable, os.path.abspath(__file__), "reap", str(os.getpid()),
                                         _proc_start(os.getpid())], start_new_session=True,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        try:
            teardown({"daemons": [{"pid": p.pid, "start": _proc_start(p.pid)} for p in self._procs]})
            for p in self._procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            with_reaper = self._reaper is not None
            if with_reaper:
                self._reaper.kill()
                self._reaper.wait()
            if with_reaper and os.path.exists(STATE):
                os.unlink(STATE)
        finally:
            if self._lock is not None:
                self._lock.close()  # releases the flock
                self._lock = None

    # -- using ----------------------------------------------------------------------------------------------
    def _wait(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            dead = [p.args for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"daemon exited: {dead}" if dead else f"not within {timeout} s"
                raise RuntimeError(f"SLURM cluster: waiting for {what}: {why}\n{self.logs_tail()}")
            time.sleep(0.1)

    def client(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(*cmd, check=check, env=self.env, timeout=60)

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.client("scontrol", *args, check=check)

    def node_states(self) -> dict[str, str]:
        r = self.client("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split() for line in r.stdout.splitlines() if line.strip())

    def sbatch(self, script: str, env: dict, cwd: str | None = None) -> int:
        r = _run("sbatch", "--parsable", script, env={**env, "SLURM_CONF": self.conf}, cwd=cwd, timeout=60)
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as {key: value} (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.scontrol("show", "job", "--oneliner", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, states: set[str], timeout: float) -> dict[str, str]:
        """Wait until the job is in one of `states`; fails at once when it ends in another."""
        ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                 "DEADLINE", "PREEMPTED"}
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if info.get("JobState") in ended or time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: {info.get('JobState')} ({info.get('Reason')}, exit "
                                     f"{info.get('ExitCode')}, restarts {info.get('Restarts')}), waiting for "
                                     f"{sorted(states)}\n{self.logs_tail()}")
            time.sleep(0.25)

    def node_of(self, pid: int) -> str | None:
        """The node whose network namespace holds `pid` (None: not in any node)."""
        try:
            ino = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return None
        for n in NODES:
            if os.stat(f"/run/netns/{NETNS[n]}").st_ino == ino:
                return n
        return None

    def logs_tail(self, lines: int = 15) -> str:
        out = []
        for name in sorted(os.listdir(os.path.join(self.base, "log"))):
            if name.endswith((".log", ".out")):
                with open(os.path.join(self.base, "log", name), errors="replace") as f:
                    out.append(f"--- {name}\n" + "".join(f.readlines()[-lines:]))
        return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["reap"]:
        _reap(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1:2] == ["cleanup"]:
        with open(LOCK, "a") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            try:
                with open(STATE) as f:
                    teardown(json.load(f))
                os.unlink(STATE)
            except (OSError, ValueError):
                teardown(None)
    else:
        sys.exit("usage: slurm_cluster.py cleanup | reap PID START")

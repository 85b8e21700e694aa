"""The one launcher of the multi-process tests: N ranks of a function over gloo (or nccl) with a timeout and
every rank's result or traceback (spawn), and training runs as one process or N ranks (launch, run_train,
train_records / train_losses). Importable by name from tests/ (pytest puts tests/ on sys.path, and the
spawned ranks inherit it), so torch.multiprocessing can pickle the workers.

On a host without CUDA every process starts from a forkserver that has imported torch (_start_method), and a
training run's ranks get torchrun's environment without torchrun itself unless the test asks for it
(launch(torchrun=True): the fault tests). MEGASSM_TEST_SPAWN=1 starts every process as a fresh interpreter
and every multi-rank run under torchrun."""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_RNG = random.SystemRandom()  # not the random module's state: tests seed it, and two workers must not pick alike


def free_port() -> int:
    """A port nothing listens on, picked below the kernel's ephemeral range where it can: the ports the kernel
    hands out by itself (gloo's pair sockets, outgoing connections: hundreds per test) then never take it
    between this check and the launcher's bind; only another pick can, which the launch retries."""
    low = _ephemeral_low()
    for _ in range(50):
        port = _RNG.randrange(10000, low) if low > 11000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# free_port() releases the port before the launcher binds it, so a process beside this one (another pytest
# worker's group) can take it first: the rendezvous then fails to listen (EADDRINUSE) before any work starts.
# Such a run is started again on a new port; any other failure is reported as it is.
_PORT_TRIES = 3
_FAIL_GRACE = 10.0  # seconds the other ranks get to exit after one failed (then stopped)


def port_clash(text: str) -> bool:
    return "EADDRINUSE" in text or "address already in use" in text.lower()


class RankError(AssertionError):
    """Ranks of a spawn() failed or ran out of time; `errors`: {rank: traceback text}."""

    def __init__(self, message: str, errors: dict[int, str]):
        super().__init__(message)
        self.errors = errors


# Processes start from a forkserver that has imported torch and torch._dynamo (which the first optimizer step
# imports): ~3 s of CPU less per process, and the suite starts several hundred on CI's two cores. Only on a
# host without CUDA (a child of a process that touched CUDA cannot use it), and only while TRITON_INTERPRET is
# what it was when the server started (torch._dynamo imports Triton, whose builtins read it at import);
# otherwise a fresh interpreter ("spawn"). A child takes the caller's environment of the moment (_adopt): the
# server's is the one it started with.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]
_UNSET = object()
_server_interp = _UNSET


def _start_method() -> str:
    global _server_interp
    if os.environ.get("MEGASSM_TEST_SPAWN") == "1" or torch.cuda.is_available():
        return "spawn"
    interp = os.environ.get("TRITON_INTERPRET")
    if _server_interp is _UNSET:
        multiprocessing.set_forkserver_preload(_PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # OpenMP reads it when the server loads torch, not later
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _server_interp = interp
    return "forkserver" if interp == _server_interp else "spawn"


def _adopt(env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)


def _entry(rank, world, port, backend, payload, out_dir, group, env):
    # the environment first, then the worker and its arguments unpickled (their modules imported) under it
    _adopt(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    try:
        fn, args = pickle.loads(payload)
        if group:
            if backend == "nccl":
                torch.cuda.set_device(rank)
            dist.init_process_group(backend, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"{rank}.result"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        # Record and leave without tearing the group down: the other ranks may sit in a collective this
        # rank will never join (NCCL would hang in destroy); spawn() stops them once this one exits.
        with open(os.path.join(out_dir, f"{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    if group:
        from megassm.parallel.state import destroy

        destroy()


def _wait(procs, deadline: float, grace: float, give_up=lambda: False) -> bool:
    """Poll `procs` (anything with .exitcode) until all have exited or `deadline` (monotonic) passes (then True:
    timed out); after the first failure the others get `grace` seconds, or none once give_up() says so."""
    failed_at = None
    while True:
        codes = [p.exitcode for p in procs]
        now = time.monotonic()
        if all(c is not None for c in codes):
            return False
        if now >= deadline:
            return True
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and (now - failed_at > grace or give_up()):
            return False
        time.sleep(0.05)


def _clashed(out_dir: str, world: int) -> bool:
    for r in range(world):
        path = os.path.join(out_dir, f"{r}.error")
        if os.path.exists(path):
            with open(path) as f:
                if port_clash(f.read()):
                    return True
    return False


def _stop(ctx) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.terminate()
    for p in ctx.processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _run_once(fn, world, args, backend, timeout, group):
    with tempfile.TemporaryDirectory(prefix="megassm-ranks-") as out:
        payload = pickle.dumps((fn, args))
        ctx = mp.start_processes(_entry, args=(world, free_port(), backend, payload, out, group, dict(os.environ)),
                                 nprocs=world, join=False, start_method=_start_method())
        try:
            # not ctx.join(): on the first failed rank it terminates the others at once, and a rank failing a
            # moment later then dies before writing its error (seen in CI under load); a port clash ends the
            # wait at once (the others wait on a rendezvous that will not come)
            timed_out = _wait(ctx.processes, time.monotonic() + timeout, _FAIL_GRACE, lambda: _clashed(out, world))
        finally:
            _stop(ctx)
        errors = {}
        for r in range(world):
            path = os.path.join(out, f"{r}.error")
            if os.path.exists(path):
                with open(path) as f:
                    errors[r] = f.read()
        if timed_out or errors:
            stuck = [r for r in range(world) if r not in errors and not os.path.exists(os.path.join(out, f"{r}.result"))]
            head = (f"{fn.__name__}: ranks {stuck} still running after {timeout} s" if timed_out
                    else f"{fn.__name__}: ranks {sorted(errors)} of {world} failed")
            text = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{head}\n{text}", errors)
        missing = [r for r in range(world) if not os.path.exists(os.path.join(out, f"{r}.result"))]
        if missing:
            raise RankError(f"{fn.__name__}: ranks {missing} exited without a result", {})
        results = []
        for r in range(world):
            with open(os.path.join(out, f"{r}.result"), "rb") as f:
                results.append(pickle.load(f))
        return results


def spawn(fn, world: int, *args, backend: str = "gloo", timeout: float = 600, group: bool = True) -> list:
    """fn(rank, world, *args) on `world` fresh processes (one thread each), inside a process group of
    `backend` (group=False: only the MASTER_ADDR/PORT, RANK, WORLD_SIZE environment). Returns the ranks'
    return values in rank order. Raises RankError naming every failed rank with its traceback, or the ranks
    still running after `timeout` seconds (all are stopped). A rendezvous port taken meanwhile: a new one."""
    for attempt in range(_PORT_TRIES):
        try:
            return _run_once(fn, world, args, backend, timeout, group)
        except RankError as e:
            if attempt == _PORT_TRIES - 1 or not any(port_clash(t) for t in e.errors.values()):
                raise


def stop(proc: subprocess.Popen, group: bool = False) -> tuple[str, str]:
    """Kill `proc` (with group=True its whole process group: it was started with start_new_session=True, as a
    torchrun or a batch script whose ranks must not outlive the test) and return what it wrote. Never waits
    more than 30 s on the pipes, which a surviving grandchild may hold open."""
    with contextlib.suppress(ProcessLookupError):  # already gone
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        elif proc.poll() is None:
            proc.kill()
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        return "", "(output not read: a child of the killed process still holds its pipes)"
    return out or "", err or ""


def wait_until(proc: subprocess.Popen, done, timeout: float, what: str, group: bool = False) -> None:
    """Poll `done()` every 50 ms while `proc` runs. Fails with the process's output when it exits first or
    `timeout` seconds pass; either way it is killed first (stop), so a stalled run fails the test instead of
    hanging it on a read of the pipes."""
    deadline = time.monotonic() + timeout
    while not done():
        exited = proc.poll() is not None
        if exited or time.monotonic() > deadline:
            _, err = stop(proc, group)
            why = f"the process exited with {proc.returncode} first" if exited else f"not within {timeout} s"
            raise AssertionError(f"{what}: {why}\n{err[-3000:]}")
        time.sleep(0.05)


def run_bounded(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw), except that the timeout kills
    the whole process tree (its own session), so no rank of a torchrun outlives it; raises TimeoutExpired."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kw) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = stop(p, group=True)
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def launch(cwd: str, args: list[str], nproc: int = 1, env: dict | None = None, timeout: int = 400,
           torchrun: bool = False) -> subprocess.CompletedProcess:
    """Run `megassm.train` with `args` as one process (nproc 1) or nproc ranks on this host, one thread per
    process, in `cwd`, and return its CompletedProcess whatever the exit code (`.seconds`: the wall time of the
    launch that counted). Past `timeout` every process of the launch is killed (TimeoutExpired).

    The ranks run under torchrun where it counts (torchrun=True: how it stops the others after a failure, its
    summary) or the host has CUDA; otherwise they start from the forkserver (_launch_forked) with the
    environment torchrun gives a rank: ~3 s of CPU less per process, the same trainer."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    forked = (nproc == 1 or not torchrun) and _start_method() == "forkserver"
    for _ in range(_PORT_TRIES if nproc > 1 else 1):
        port = free_port()
        if forked:
            r = _launch_forked(cwd, args, full_env, timeout, nproc, port)
        else:
            launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                              "--master_port", str(port)]
            cmd = [sys.executable, *launcher, "-m", "megassm.train", *args]
            t0 = time.monotonic()
            r = run_bounded(cmd, timeout, cwd=cwd, env=full_env)
            r.seconds = time.monotonic() - t0
        if r.returncode == 0 or not port_clash(r.stderr):
            break
    return r


def _train_child(args, cwd, env, out_path, err_path):
    """`python -m megassm.train ARGS` in a forkserver child: its own session (a timeout kills its tree), the
    caller's environment and directory, stdout / stderr (file descriptors 1 and 2) appended to the launch's
    files, and the exit code the interpreter would give (an uncaught exception: its traceback and 1)."""
    os.setsid()
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    _adopt(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or 1))
    os.chdir(cwd)
    sys.argv = [os.path.join(ROOT, "megassm", "train.py"), *args]
    code = 1
    try:
        import megassm.train

        megassm.train.cli()  # a rank of several leaves through os._exit in there
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


_LAUNCH_GRACE = 5.0  # seconds the other ranks get to exit by themselves after one failed (torchrun: SIGTERM, 30 s)


def _launch_forked(cwd: str, args: list[str], env: dict, timeout: float, nproc: int,
                   port: int) -> subprocess.CompletedProcess:
    """launch() from the forkserver: nproc children with torchrun's rank environment (rank 0 hosts the store at
    `port`). After a failure the others get _LAUNCH_GRACE seconds, then every rank's session is killed."""
    cmd = [sys.executable, "-m", "megassm.train", *args]
    ctx = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory(prefix="megassm-launch-") as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        procs = []
        for r in range(nproc):
            rank_env = env if nproc == 1 else dict(
                env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                GROUP_RANK="0", ROLE_RANK=str(r), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))
            procs.append(ctx.Process(target=_train_child, args=(args, cwd, rank_env, out_path, err_path)))
        t0 = time.monotonic()
        for p in procs:
            p.start()
        timed_out = _wait(procs, t0 + timeout, _LAUNCH_GRACE)
        for p in procs:
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.join()
        seconds = time.monotonic() - t0
        out, err = (_read(path) for path in (out_path, err_path))
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    codes = [p.exitcode for p in procs]
    r = subprocess.CompletedProcess(cmd, next((c for c in codes if c != 0), 0), out, err)
    r.seconds = seconds
    return r


def run_train(cwd: str, args: list[str], nproc: int = 1, env: dict | None = None, timeout: int = 400,
              torchrun: bool = False) -> list[dict]:
    """launch(), assert it succeeded (its stderr's tail as the message) and return the run's metrics.jsonl
    records. `args` must set run.dir."""
    run_dir = next((a.split("=", 1)[1] for a in args if a.startswith("run.dir=")), None)
    assert run_dir is not None, "run_train: args must set run.dir"
    r = launch(cwd, args, nproc, env, timeout, torchrun)
    assert r.returncode == 0, r.stderr[-5000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(records: list[dict], key: str = "loss") -> dict[int, float]:
    """{step: value} of the metrics records that carry `key` (loss, loss_val, ...)."""
    return {d["step"]: d[key] for d in records if key in d}


def train_records(run_dir, nproc: int = 1, extra=(), resume=None, *, base: list[str], env: dict | None = None,
                  timeout: int = 300, config: str = "configs/tiny.yaml") -> list[dict]:
    """A training run from the repository root: `config`, the file's `base` overrides, run.dir, `extra`,
    and --resume when given; its metrics records."""
    args = ["--config", config, *base, f"run.dir={run_dir}", *extra]
    if resume:
        args += ["--resume", str(resume)]
    return run_train(ROOT, args, nproc, env, timeout)


def train_losses(run_dir, nproc: int = 1, extra=(), resume=None, **kw) -> dict[int, float]:
    """train_records() -> {step: loss}. Test files bind their overrides: partial(train_losses, base=TINY)."""
    return losses(train_records(run_dir, nproc, extra, resume, **kw))

"""Process helpers for the benchmarks that start torchrun per case: a case that runs out of time is killed
with every rank it started (a surviving rank would hold its GPU's memory, and its disk writes, through the
cases after it)."""
from __future__ import annotations

import os
import signal
import subprocess
import time


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun starts its workers in sessions of their own)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            kids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(p)], capture_output=True, text=True).stdout
        except OSError:
            kids = ""
        todo += [int(k) for k in kids.split()]
    for p in found:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_or_kill(cmd: list[str], timeout: float, tag: str, env: dict | None = None) -> tuple[int | None, str, str]:
    """Run `cmd`; past `timeout` seconds kill it, its descendants and every process whose command line names
    `tag` (a rank spawned while the tree was walked). Returns (exit code, or None when it was killed; its
    stdout; its stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        time.sleep(1)
        subprocess.run(["pkill", "-9", "-f", tag], check=False)
        out, err = proc.communicate()
        return None, out, err

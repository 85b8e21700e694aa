"""The multi-process test helpers (multiproc.py) start a group again on a new port when the one free_port()
picked was taken before the rendezvous bound it (seen in CI: two pytest workers' groups, EADDRINUSE), report
any other failure at once with every failed rank's traceback, stop ranks that outlive their timeout, and
return every rank's result; a launch past its timeout leaves no process of its tree behind, and a wait on a
running process fails with its output instead of hanging (a stalled run read without a timeout holds the
test, and CI, forever)."""
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import multiproc as testing


def sum_ranks_worker(rank, world, out):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(t.item()))


def failing_worker(rank, world):
    raise ValueError("not a port clash")  # run without a group: a rank still in gloo's rendezvous when the
    # other (the store's host) exits would fail with "Connection reset", not this error (seen in CI)


def result_worker(rank, world):
    return {"rank": rank, "world": world}


def hanging_worker(rank, world):
    if rank == 1:
        time.sleep(600)
    dist.barrier()


def _ports_from(monkeypatch, first):
    """free_port() returns `first`, then real free ports; returns the list of ports handed out."""
    handed = []
    real = testing.free_port

    def pick():
        handed.append(first if not handed else real())
        return handed[-1]

    monkeypatch.setattr(testing, "free_port", pick)
    return handed


def test_spawn_retries_a_taken_port(tmp_path, monkeypatch):
    with socket.socket() as held:  # a listening socket holds the first port for the whole launch
        held.bind(("127.0.0.1", 0))
        held.listen()
        handed = _ports_from(monkeypatch, held.getsockname()[1])
        out = tmp_path / "sum.txt"
        testing.spawn(sum_ranks_worker, 2, str(out))
    assert float(out.read_text()) == 3.0
    assert len(handed) == 2 and handed[0] != handed[1]


def test_spawn_reports_other_failures_without_retry(monkeypatch):
    handed = _ports_from(monkeypatch, testing.free_port())
    with pytest.raises(testing.RankError, match="not a port clash") as e:
        testing.spawn(failing_worker, 2, group=False)
    assert sorted(e.value.errors) == [0, 1] and all("ValueError" in t for t in e.value.errors.values())
    assert len(handed) == 1


def test_spawn_returns_every_rank_result():
    assert testing.spawn(result_worker, 3) == [{"rank": r, "world": 3} for r in range(3)]


def test_spawn_stops_ranks_past_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(testing.RankError, match="still running after 5 s"):
        testing.spawn(hanging_worker, 2, timeout=5)
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("torchrun", [True, False], ids=["torchrun", "forked"])
def test_run_train_retries_a_taken_port_only(tmp_path, monkeypatch, torchrun):
    """run_train's ranks, under torchrun or from the forkserver: a launch whose store could not listen is
    started again on a new port (the launches are faked here: the real clash needs two launchers racing); a
    training failure is not."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    clash = "torch.distributed.DistNetworkError: The server socket has failed to listen ... EADDRINUSE"
    monkeypatch.setattr(testing, "_start_method", lambda: "forkserver")  # both paths on any host
    for results, want_calls, ok in [([clash, ""], 2, True), (["ValueError: bad config", ""], 1, False)]:
        calls = []

        def result(cmd, port, results=results, calls=calls):
            calls.append(port)
            err = results[len(calls) - 1]
            return testing.subprocess.CompletedProcess(cmd, 1 if err else 0, "", err)

        monkeypatch.setattr(testing, "run_bounded",
                            lambda cmd, timeout, **kw: result(cmd, cmd[cmd.index("--master_port") + 1]))
        monkeypatch.setattr(testing, "_launch_forked",
                            lambda cwd, args, env, timeout, nproc, port: result(args, port))
        if ok:
            assert testing.run_train(str(tmp_path), [f"run.dir={tmp_path}"], nproc=2, torchrun=torchrun) == \
                [{"step": 1, "loss": 2.0}]
        else:
            with pytest.raises(AssertionError, match="bad config"):
                testing.run_train(str(tmp_path), [f"run.dir={tmp_path}"], nproc=2, torchrun=torchrun)
        assert len(calls) == want_calls and len(set(calls)) == want_calls


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie left for init to reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_run_bounded_kills_the_whole_tree_past_its_timeout(tmp_path):
    """A launcher's children (torchrun's ranks; here a shell's background sleep) die with it at the timeout,
    and the call returns although they held its pipes."""
    pid_file = tmp_path / "pid"
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        testing.run_bounded(["bash", "-c", f"sleep 300 & echo $! > {pid_file}; wait"], 2)
    assert time.monotonic() - t0 < 30
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)
    r = testing.run_bounded([sys.executable, "-c", "import sys; print('out'); sys.exit('err')"], 60)
    assert (r.returncode, r.stdout, r.stderr) == (1, "out\n", "err\n")


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def test_wait_until_fails_with_the_output_of_a_stalled_or_exited_process(tmp_path):
    stalled = _python("import sys, time; print('started', file=sys.stderr, flush=True); time.sleep(300)")
    with pytest.raises(AssertionError, match="two steps: not within 2 s\nstarted"):
        testing.wait_until(stalled, lambda: False, 2, "two steps", group=True)
    assert stalled.poll() is not None
    exited = _python("import sys; sys.exit('bad config')")
    with pytest.raises(AssertionError, match="two steps: the process exited with 1 first\nbad config"):
        testing.wait_until(exited, lambda: False, 60, "two steps")
    marker = tmp_path / "marker"
    writer = _python(f"import time; open({str(marker)!r}, 'w').close(); time.sleep(300)")
    try:
        testing.wait_until(writer, marker.exists, 60, "the marker")
        assert writer.poll() is None
    finally:
        testing.stop(writer, group=True)
    assert writer.poll() is not None

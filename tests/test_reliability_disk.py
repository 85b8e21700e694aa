"""A full disk or a file-size limit during a save (docs/reliability.md "Full disk and file-size limit"): real ones, a
small tmpfs and RLIMIT_FSIZE, not a raised OSError. Exit 4, the half-written checkpoint removed, the others intact."""
import errno
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from megassm.training import checkpoint as ckpt
from megassm.training.checkpoint import disk
from megassm.training.failures import EXIT_IO, EXIT_OK

from reliability_cases import ROOT, SMALL, base_run, copy_run, last_exit, run_main, small_model_ckpt  # noqa: F401 (base_run: a fixture)


UNEXPECTED_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"  # torch's words for both


@pytest.fixture
def small_fs(tmp_path):
    """mount(size) -> a directory on a tmpfs of `size` bytes of its own, unmounted at the end. Skipped where
    mounting is not allowed (not root, a container without CAP_SYS_ADMIN)."""
    mounted = []

    def mount(size: int):
        if os.geteuid() != 0:
            pytest.skip("a real full file system needs a small tmpfs, and mounting one needs root")
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _fill(fs):
    """Write zeros into fs/filler until the file system is full (another writer took the space)."""
    fd = os.open(fs / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


def _pages(path):
    """Bytes a tmpfs holds for the files under `path` (whole 4 KiB pages)."""
    return sum(-(-os.path.getsize(os.path.join(d, f)) // 4096) * 4096 for d, _, fs in os.walk(path) for f in fs)


def test_file_size_limit_during_a_save_exits_4(base_run, tmp_path):
    """A real RLIMIT_FSIZE (`ulimit -f` in the shell that starts the trainer): the write of model.pt stops at the limit
    and torch raises `RuntimeError: ... unexpected pos`; the trainer (which ignores SIGXFSZ itself) exits 4 naming the
    file and the limit, the temp checkpoint is gone, the earlier ones verify, and the run resumes without the limit."""
    from multiproc import run_bounded

    run = copy_run(base_run, tmp_path)
    limit = 64 << 10  # above every other file a run writes, below model.pt (~150 kB)
    train = [sys.executable, "-m", "megassm.train", "--config", "configs/tiny.yaml", *SMALL, f"run.dir={run}",
             "train.steps=6", "run.save_interval=2", "--resume", "auto"]
    # no .pyc writes in the limited process: a large one would meet the limit before the trainer ignores SIGXFSZ
    r = run_bounded(["sh", "-c", f'ulimit -f {limit // 512} && exec "$@"', "sh", *train], 300, cwd=ROOT,
                    env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert r.returncode == EXIT_IO, r.stderr[-3000:]
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith(f"megassm-train: I/O error: cannot write checkpoint {run}/checkpoints/step_00000006: "
                          f"model.pt: File too large (the process's file-size limit, RLIMIT_FSIZE / ulimit -f, is "
                          f"{limit} bytes); the partial checkpoint was removed"), err
    status = last_exit(run)
    assert status["exit_code"] == EXIT_IO and status["checkpoint"].endswith("step_00000004")
    root = os.path.join(run, "checkpoints")
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000004"]  # no .tmp-step_00000006-*
    assert all(ckpt.verify_checkpoint(os.path.join(root, c)) == [] for c in os.listdir(root))
    assert run_main(run, "train.steps=6", resume="auto") == EXIT_OK


def test_full_disk_during_a_sharded_save_exits_4(tmp_path, small_fs, capsys):
    """A tmpfs with room for half a checkpoint more: the DCP chunk write of the next save fails (torch's
    CheckpointException around `unexpected pos`, the ENOSPC chained); exit 4 naming the cause, the half-written
    checkpoint removed (its space free again), the earlier one intact."""
    base = tmp_path / "base"
    sharded = ("run.checkpoint_format=sharded", "run.save_interval=2")
    assert run_main(base, "train.steps=2", *sharded) == EXIT_OK
    one = _pages(base / "checkpoints" / "step_00000002")
    fs = small_fs(_pages(base) + one // 2 + (64 << 10))  # 64 kB for the lines and records a run adds
    run = fs / "run"
    shutil.copytree(base, run)
    assert run_main(run, "train.steps=4", *sharded, resume="auto") == EXIT_IO
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(rf"megassm-train: I/O error: cannot write checkpoint {run}/checkpoints/step_00000004: "
                    r"dcp(/__0_\d+\.distcp)?: No space left on device \(\d+ bytes free on its file system\); the "
                    r"partial checkpoint was removed", err), err
    assert os.listdir(run / "checkpoints") == ["step_00000002"]
    assert ckpt.verify_checkpoint(run / "checkpoints" / "step_00000002") == []
    assert os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize > one // 2  # the partial chunk's space is free again
    assert last_exit(run)["exit_code"] == EXIT_IO


def test_full_disk_while_meta_json_is_written(tmp_path, small_fs, monkeypatch):
    """Every file of a save counts, meta.json too; and the failure is recognised without its errno (a DCP error
    gathered from another rank arrives without the chain) from the disk itself: no space, or a file at the limit."""
    import resource

    fs = small_fs(8 << 20)
    model, opt, first = small_model_ckpt(fs)
    real = disk.write_json

    def fill_then_write(obj, path):  # the file system fills up (another writer) just before meta.json is written
        _fill(fs)
        real(obj, path)

    monkeypatch.setattr(disk, "write_json", fill_then_write)
    with pytest.raises(ckpt.CheckpointWriteError, match=r"^cannot write checkpoint .*step_00000002: meta.json: No "
                                                        r"space left on device \(\d+ bytes free on its file system\); "
                                                        r"the partial checkpoint was removed"):
        ckpt.save_checkpoint(fs, 2, model=model, optimizer=opt, extra={"rng": ckpt.capture_rng_state()})
    assert os.listdir(fs / "checkpoints") == ["step_00000001"] and ckpt.verify_checkpoint(first) == []

    assert ckpt.disk_failure(RuntimeError(UNEXPECTED_POS), str(fs / "checkpoints")).errno == errno.ENOSPC
    from torch.distributed.checkpoint.api import CheckpointException

    gathered = CheckpointException("write", {1: (RuntimeError(UNEXPECTED_POS), None)})  # pickled from rank 1: no chain
    assert ckpt.disk_failure(gathered, str(fs / "checkpoints")).errno == errno.ENOSPC
    assert ckpt.disk_failure(ValueError("a bug"), str(fs / "checkpoints")) is None  # only torch's write errors
    os.remove(fs / "filler")
    assert ckpt.disk_failure(RuntimeError(UNEXPECTED_POS), str(fs / "checkpoints")) is None  # room: not the disk
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    largest = max((os.path.join(first, f) for f in os.listdir(first)), key=os.path.getsize)
    size = os.path.getsize(largest)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # nothing is written while the limit is this low
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
        found = ckpt.disk_failure(RuntimeError(UNEXPECTED_POS), first)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert found.errno == errno.EFBIG and found.filename == largest
    assert f"RLIMIT_FSIZE / ulimit -f, is {size} bytes" in found.strerror

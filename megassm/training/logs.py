"""Logging for a job of many ranks: the job speaks once.

    setup_logging("INFO")      # megassm.train main(), before anything is logged

- Rank 0 logs at the requested level; every other rank logs WARNING and above only (a rank's own trouble),
  so an INFO line appears once per job, not once per GPU.
- In a multi-process run (WORLD_SIZE > 1) every line carries its rank: `... [rank 3] megassm.train WARNING: ...`.
  A single process logs as it always did: `time name LEVEL: message`.
- Third-party INFO stays quiet: below WARNING only megassm's own loggers pass (megatron-core announces its
  FSDP / Transformer Engine choices at import, on every rank). `--log-level DEBUG` lets everything through
  on rank 0.
- Python warnings (deprecations and the like, raised alike on every rank) go through logging in a
  multi-process run, on rank 0 only.

torch keeps its own handler for the `torch` loggers (rank-prefixed by torch itself) and DeepSpeed its own for
`DeepSpeed` (WARNING by default); both are left alone. torchrun's OMP_NUM_THREADS notice is avoided at its
source: the launchers set OMP_NUM_THREADS (launch/core/cli.py, launch/core/slurm.py).
"""
from __future__ import annotations

import logging
import os
import sys

__all__ = ["setup_logging", "LEVELS", "OWN_LOGGERS"]

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
OWN_LOGGERS = ("megassm", "__main__")  # below WARNING, only these (and their children) pass
_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to the sys.stderr of the moment (tests swap it; a handler bound to a swapped-out stream would
    write to a closed file)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # noqa: ARG002 (StreamHandler.__init__ assigns it)
        pass


class _JobFilter(logging.Filter):
    def __init__(self, rank: int, level: int):
        super().__init__()
        self.rank, self.level = rank, level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "py.warnings" and record.args:  # the formatted warning ends with its own newline
            record.args = (str(record.args[0]).rstrip("\n"),)
        if self.rank != 0:  # warnings and errors of this rank; Python warnings once, from rank 0
            return record.levelno >= logging.WARNING and record.name != "py.warnings"
        if record.levelno >= logging.WARNING or self.level <= logging.DEBUG:
            return True
        return record.name.split(".", 1)[0] in OWN_LOGGERS


def setup_logging(level: str | int = "INFO") -> None:
    """Configure the root logger for this process (rank and world size from the launcher's RANK / WORLD_SIZE).
    Calling it again replaces the previous setup; a root logger that has handlers of its own is left as it
    is. An unknown level name exits 2 (a config error), naming it."""
    if isinstance(level, str):
        name = level.strip().upper()
        if name not in LEVELS:
            print(f"megassm-train: config error: --log-level {level!r}: expected one of {', '.join(LEVELS)}",
                  file=sys.stderr)
            raise SystemExit(2)
        level = getattr(logging, name)
    rank = int(os.environ.get("RANK", "0"))
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    root = logging.getLogger()
    ours = [h for h in root.handlers if isinstance(h, _StderrHandler)]
    if len(ours) < len(root.handlers):  # configured by a program that runs main() (pytest): left alone, as
        return                          # logging.basicConfig would
    for h in ours:
        root.removeHandler(h)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(_FORMAT.replace("%(name)s", f"[rank {rank}] %(name)s") if multi
                                           else _FORMAT))
    handler.addFilter(_JobFilter(rank, level))
    root.addHandler(handler)
    root.setLevel(level if rank == 0 else max(level, logging.WARNING))
    logging.captureWarnings(multi)

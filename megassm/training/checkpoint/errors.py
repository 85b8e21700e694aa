"""The checkpoint errors (exported by the package, where callers name them): in a module of their own, below
every module of the package that raises them (imports run one way; docs/architecture.md, "Layers")."""
from __future__ import annotations

from megassm.config import ConfigError
from megassm.training.failures import RunIOError

__all__ = ["CheckpointError", "CheckpointDamagedError", "CheckpointMismatchError", "CheckpointWriteError"]


class CheckpointError(ConfigError):
    """A checkpoint that is missing, incomplete or unreadable; the message names the path.
    (A ConfigError, so the CLI reports it cleanly: it usually comes from run.resume.)"""


class CheckpointDamagedError(CheckpointError):
    """A complete checkpoint whose files fail verification, cannot be read, or hold non-finite model or
    optimizer values. The message names the checkpoint, the file and what was expected and found."""


class CheckpointMismatchError(CheckpointError):
    """An intact checkpoint that does not fit the model being trained (a changed model config)."""


class CheckpointWriteError(RunIOError):
    """A checkpoint could not be written (unwritable directory, full disk); its temp directory is removed."""

"""run.wandb=online|offline: MetricsLogger's scalars (training/metrics.py) go to a Weights & Biases run as well.

Only rank 0 has a MetricsLogger, so only rank 0 imports wandb, and only when run.wandb is on (run.wandb=off never
imports it; training/checks.py refuses a missing package before any compute). The run's id is kept in
run.dir/wandb_id: a resume (run.resume=auto or a path, or a spike rollback) continues that wandb run
(wandb.init(id=..., resume="allow")); a fresh start writes a new id. Offline runs are written under
run.dir/wandb/ (offline-run-<time>-<id>, one folder per attempt) for `wandb sync`.

wandb's history is append-only: the steps a resumed attempt logs again (those after its checkpoint) are already in
the run where wandb knows its last step (online), so they are not sent twice (metrics.jsonl and TensorBoard replace
theirs); an offline attempt logs them, and `wandb sync` keeps the first values it received.
"""
from __future__ import annotations

import logging
import os
import sys
import uuid
from typing import Any

log = logging.getLogger("megassm.metrics")

ID_FILE = "wandb_id"

__all__ = ["ID_FILE", "WandbSink", "wandb_settings"]


def wandb_settings(cfg) -> dict | None:
    """WandbSink's arguments from the config (None with run.wandb=off). The whole resolved config goes to the
    run's config panel."""
    r = cfg.run
    if r.wandb == "off":
        return None
    from megassm.config import config_to_dict

    return {"mode": r.wandb, "project": r.wandb_project, "name": r.wandb_name, "entity": r.wandb_entity,
            "config": config_to_dict(cfg)}


def _read_id(path: str) -> str | None:
    try:
        with open(path) as f:
            run_id = f.read().strip()
    except FileNotFoundError:
        return None
    return run_id or None


class WandbSink:
    """One wandb run for a MetricsLogger: `log(step, {tag: float})`, `close()`."""

    def __init__(self, run_dir: str, *, mode: str, project: str, name: str, entity: str, config: dict,
                 resuming: bool):
        import wandb

        path = os.path.join(run_dir, ID_FILE)
        run_id = _read_id(path) if resuming else None
        if run_id is None:
            run_id = uuid.uuid4().hex[:16]
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(run_id + "\n")
            os.replace(tmp, path)
        self.run = wandb.init(project=project, entity=entity or None, id=run_id, resume="allow", dir=run_dir,
                              name=name or os.path.basename(os.path.abspath(run_dir)), mode=mode, config=config)
        self._skipped = 0
        log.info("wandb: run %s (%s, project %s)%s", run_id, mode, project, ", continued" if resuming else "")

    def log(self, step: int, scalars: dict[str, Any]) -> None:
        if step < self.run.step:  # wandb already holds this step (an earlier attempt's)
            self._skipped += 1
            return
        self.run.log(scalars, step=step)

    def close(self) -> None:
        if self._skipped:
            log.info("wandb: %d log calls for steps the run already had (an earlier attempt's) were not sent again",
                     self._skipped)
        # a close while an exception unwinds (the trainer's finally) marks the wandb run failed
        self.run.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)

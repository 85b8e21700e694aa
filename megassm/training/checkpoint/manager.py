"""The checkpoint lifecycle of a training run, behind the few calls the trainer makes:

    checkpoints = CheckpointManager(cfg, groups, model=..., optimizer=..., engine=..., scheduler=..., data=...,
                                    guard=..., carrier=..., tokens_per_step=...)
    path, step = checkpoints.restore()     # run.resume: the newest intact checkpoint, loaded on every rank
    checkpoints.after_step(step)           # run.save_interval / save_final: save (sync or async), publish, prune
    checkpoints.save_now(step)             # a preemption: this step's checkpoint unless it exists
    path, problems, step = checkpoints.roll_back()  # train.spike_action=rollback: the last checkpoint back
    checkpoints.wait()                     # the async save in flight completes (end of fit; its error raised)

Saving: the canonical format is gathered to rank 0, written to a temp directory and published only once every rank
has agreed that its step succeeded (consensus.py), then pruned to run.keep_last; the sharded format
(run.checkpoint_format=sharded, sharded.py) has every rank write its pieces, in the background with
run.async_save. Restoring: every rank verifies (its share of) the files and loads, and all agree on the outcome;
a damaged checkpoint is skipped for the next older one where run.resume allows a stand-in. `last` is the checkpoint
this run last saved or loaded: what a spike rolls back to and a failure names.
"""
from __future__ import annotations

import logging
import os

import torch

from megassm.config import ConfigError, dump_config
from megassm.parallel import runtime as prt
from megassm.training import consensus, faults
from megassm.training.checkpoint.choose import resume_candidates
from megassm.training.checkpoint.errors import CheckpointDamagedError, CheckpointError, CheckpointMismatchError
from megassm.training.checkpoint.folder import (CHECKPOINTS, META, checkpoint_name, list_checkpoints,
                                                marked_complete, read_meta)
from megassm.training.checkpoint.load import load_checkpoint, read_model_and_optim, refuse_nonfinite, verify_checkpoint
from megassm.training.checkpoint.save import write_checkpoint
from megassm.training.checkpoint.sharded import SHARDED, ShardedCheckpointer, canonical_param_names, checkpoint_format
from megassm.training.checkpoint.sharded_load import load_sharded
from megassm.training.checkpoint.state import capture_rng_state, restore_rng_state
from megassm.training.failures import RunIOError, one_line
from megassm.training.run_config import config_differences, config_hash, legacy_hash_matches

# the trainer's logger: these lines read as they always have (logs.py prints the logger's name)
log = logging.getLogger("megassm.train")

__all__ = ["CheckpointManager"]


class CheckpointManager:
    """Saves, restores and rolls back the states of one training run (model, optimizer, engine, scheduler, data,
    spike guard, BPTT carrier) under cfg.run's checkpoint settings. Collective: every rank makes every call."""

    def __init__(self, cfg, groups, *, model, optimizer, engine, scheduler, data, guard, carrier,
                 tokens_per_step: int):
        self.cfg, self.run_dir, self.groups = cfg, cfg.run.dir, groups
        self.model, self.optimizer, self.engine, self.scheduler = model, optimizer, engine, scheduler
        self.data, self.guard, self.carrier, self.tokens_per_step = data, guard, carrier, tokens_per_step
        self.last: str | None = None
        self.loaded_step = 0  # the step of the checkpoint last loaded
        self.sharded = None  # run.checkpoint_format=sharded: DCP, every rank writes (sharded.py)
        if cfg.run.checkpoint_format == "sharded":
            self.sharded = ShardedCheckpointer(groups, async_save=cfg.run.async_save, keep_last=cfg.run.keep_last)

    def after_step(self, step: int) -> str | None:
        """The checkpoint of `step` when run.save_interval or run.save_final asks for one (its path), else None."""
        run = self.cfg.run
        if (run.save_interval and step % run.save_interval == 0) or (run.save_final and step == self.cfg.train.steps):
            path = self.save(step)
            self.guard.saved()  # a spike now rolls back to this checkpoint
            return path
        return None

    def save_now(self, step: int) -> str | None:
        """A stop's checkpoint (a preemption): the checkpoint of `step` unless it exists already or nothing was
        trained; returns the run's last checkpoint (None: none)."""
        saved = self.last is not None and os.path.basename(self.last.rstrip(os.sep)) == checkpoint_name(step)
        if step > 0 and not saved:
            self.save(step)
        return self.last

    def roll_back(self) -> tuple[str | None, list[str], int]:
        """The last checkpoint back (model, optimizer, scheduler, RNG, BPTT states, the guard's window) with the data
        position kept: (its path, its problems (empty: loaded), its step)."""
        if self.sharded is not None:  # an async save still being written completes first
            self.sharded.wait()
        path = self.last
        problems = self._try_load(path, data_state=self.data.state_dict())
        return path, problems, self.loaded_step

    def wait(self) -> None:
        """The async save in flight (if any) completes; its error is raised here."""
        if self.sharded is not None:
            self.sharded.wait()

    def last_good_note(self) -> str:
        """Where a run that must stop can resume, in words (the last checkpoint that still verifies)."""
        if self.last is None:
            return "no checkpoint was written yet in this run (set run.save_interval to keep one)"
        self.last = self._last_good()
        return (f"the last good checkpoint is {self.last} (resume with --resume auto, "
                "perhaps with a lower optim.lr)" if self.last else
                "no checkpoint of this run verifies any more (see the warnings above)")

    def _last_good(self) -> str | None:
        """The checkpoint this run last saved or resumed from if it still verifies, else the newest older one in
        run.dir that does. Rank 0 reads them; the other ranks name the one they recorded."""
        if not prt.is_rank0(self.groups):
            return self.last
        last = self.last
        problems = verify_checkpoint(last)
        if not problems:
            return last
        log.warning("checkpoint %s fails verification: %s", last, "; ".join(problems))
        last_step = int(os.path.basename(last.rstrip(os.sep)).rsplit("_", 1)[-1])
        for step, path in reversed(list_checkpoints(self.run_dir)):
            if step >= last_step:
                continue
            problems = verify_checkpoint(path)
            if not problems:
                return path
            log.warning("checkpoint %s fails verification: %s", path, "; ".join(problems))
        return None

    def _extra_state(self, step: int, carried: dict | None = None) -> dict:
        extra = {
            "scheduler": self.scheduler.state_dict(),
            "data": self.data.state_dict(),
            "rng": capture_rng_state(),
            "config_hash": config_hash(self.cfg),
            "config": dump_config(self.cfg),  # names the keys that differ when a resume changes the config
            "consumed_tokens": step * self.tokens_per_step,
            "spike_guard": self.guard.state_dict(),  # the window: a resume judges as the uninterrupted run would
        }
        if self.carrier is not None:
            extra["carried_states"] = carried
        return extra

    def save(self, step: int) -> str:
        """Write the checkpoint of `step` (collective: every rank calls it) and return its path."""
        faults.at_save(step)  # the fault tests' hook: inert unless MEGASSM_FAULT is set
        if self.sharded is not None:  # sharded: every rank writes its pieces (async: in the background)
            carried = self.carrier.state_dict() if self.carrier is not None else None  # collective
            extra = self._extra_state(step, carried) if prt.is_rank0(self.groups) else None
            path = self.sharded.save(self.run_dir, step, model=self.model, optimizer=self.optimizer,
                                     engine=self.engine, extra=extra)
            self.last = path
            log.info("checkpoint %s: %s", path, "snapshot taken, writing in the background"
                     if self.cfg.run.async_save else "saved (sharded)")
            return path
        # canonical single-device layout: TP shards gathered on every rank (collective), rank 0 writes
        if self.engine.handles_states:  # FSDP2 / DeepSpeed shards -> canonical on rank 0 (collective)
            model_state, optim_state = self.engine.gather_states()
        else:
            model_state, optim_state = prt.gather_states(self.model, self.optimizer, self.groups)
        # BPTT: the canonical carried states on rank 0 (collective: every rank's rows / blocks / shards)
        carried = self.carrier.state_dict() if self.carrier is not None else None
        path = os.path.join(self.run_dir, CHECKPOINTS, checkpoint_name(step))
        error, pending = None, None
        try:
            if prt.is_rank0(self.groups):
                extra = self._extra_state(step, carried)
                # the optimizer's parameter names by index: lets megassm-checkpoint convert it without a config
                extra["param_names"] = canonical_param_names(self.model, self.optimizer, self.engine)
                try:
                    pending = write_checkpoint(self.run_dir, step, model=self.model, optimizer=self.optimizer,
                                               extra=extra, model_state=model_state, optim_state=optim_state)
                except RunIOError as e:  # full disk, unwritable directory: the temp directory is gone already
                    error = e
            # Published only once every rank has reached this point: a rank that stalled in this step leaves
            # its peers' collectives to the watchdog, whose abort lets their step finish on garbage; this
            # agreement then fails (or never completes) and nothing of the step appears.
            error = consensus.agree_error(error)
            if pending is not None and error is None:
                try:
                    path = pending.publish(self.cfg.run.keep_last)
                except RunIOError as e:
                    error = e
                pending = None
        finally:
            if pending is not None:
                pending.discard()
        # also the barrier: no rank goes on before the checkpoint is complete, and all fail together
        error = consensus.agree_error(error)
        if error is not None:
            raise error
        self.last = path
        log.info("saved checkpoint %s", path)
        return path

    def restore(self) -> tuple[str | None, int]:
        """Load what run.resume names into the run's states: (its path, the step it was saved at); (None, 0) for a
        fresh start. For "auto" or a run directory, the newest checkpoint that verifies and loads on every rank:
        incomplete and damaged ones are named and skipped. CheckpointDamagedError when checkpoints exist but none
        is intact; CheckpointMismatchError (a config error) when one does not fit this run's model."""
        candidates, fallback = resume_candidates(self.run_dir, self.cfg.run.resume)
        damaged, skipped = [], []
        for path in candidates:
            meta_exists = os.path.exists(os.path.join(path, META))  # unreadable counts as damaged, below
            if not marked_complete(path) and not (meta_exists and read_meta(path) is None):
                if not fallback:
                    load_checkpoint(path, model=None, verify=False)  # raises, naming what is missing
                log.warning("skipping checkpoint %s: incomplete (interrupted while being written)", path)
                skipped.append(path)
                continue
            problems = self._try_load(path)
            if not problems:
                if skipped:
                    log.warning("resumed from %s, the newest intact checkpoint; skipped: %s", path, ", ".join(skipped))
                return path, self.loaded_step
            log.warning("checkpoint %s is damaged and is skipped: %s", path, "; ".join(problems))
            damaged.append(f"{os.path.basename(path)}: {'; '.join(problems)}")
            skipped.append(path)
        if damaged:
            where = "" if fallback else " (a checkpoint named by run.resume has no stand-in; --resume auto takes " \
                                         "the newest intact one)"
            raise CheckpointDamagedError(
                f"run.resume={self.cfg.run.resume}: no intact checkpoint to resume from{where}: {' | '.join(damaged)}. "
                "Restore one, name another with --resume PATH, or start over in a new run.dir")
        if skipped:
            log.warning("run.resume=%s: no complete checkpoint (skipped %s); starting from scratch",
                        self.cfg.run.resume, ", ".join(skipped))
        elif fallback:
            log.info("run.resume=%s: no checkpoint in %s; starting from scratch", self.cfg.run.resume,
                     os.path.join(self.run_dir, CHECKPOINTS))
        return None, 0

    def _try_load(self, path: str, data_state: dict | None = None) -> list[str]:
        """Verify and load one complete checkpoint, agreed by every rank: its problems (empty: loaded). Rank 0
        verifies the canonical files; every rank refuses unreadable files and non-finite values before loading.
        `data_state`: the data position to take instead of the checkpoint's (a spike rollback keeps its own)."""
        mine = None if prt.is_rank0(self.groups) else []
        if checkpoint_format(path) == SHARDED:  # every rank hashes its share of the files (84 GB at 7B)
            files = sorted(((read_meta(path) or {}).get("integrity") or {}).get("files", {}))
            mine = files[self.groups.rank::self.groups.world_size] if files else mine
        problems = [p for ps in consensus.gather(verify_checkpoint(path, relpaths=mine)) for p in ps]
        if problems:
            return problems
        outcome = None  # (kind, message): exceptions themselves may not pickle for the exchange
        try:
            self._load(path, data_state)
        except CheckpointDamagedError as e:
            outcome = ("damaged", str(e))
        except (ConfigError, RuntimeError, ValueError, KeyError, TypeError) as e:  # does not fit the model
            outcome = ("mismatch", str(e) if isinstance(e, CheckpointError) else
                       f"checkpoint {path} does not fit this run: {type(e).__name__}: {one_line(e)}")
        except Exception as e:  # anything else is a bug: every rank stops, this one with its traceback
            consensus.gather(("unexpected", f"{type(e).__name__}: {one_line(e)}"))
            raise
        outcomes = [(rank, o) for rank, o in enumerate(consensus.gather(outcome)) if o is not None]
        for rank, (kind, message) in outcomes:
            if kind == "unexpected":
                raise RuntimeError(f"rank {rank} failed to load checkpoint {path}: {message}")
        mismatch = next((message for _, (kind, message) in outcomes if kind == "mismatch"), None)
        if mismatch is not None:
            raise self._mismatch(path, mismatch)
        return [message for _, (_, message) in outcomes[:1]]

    def _mismatch(self, path: str, error: str) -> ConfigError:
        meta = read_meta(path) or {}
        diffs = config_differences(meta["config"], self.cfg) if isinstance(meta.get("config"), str) else []
        more = f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else ""
        hint = f"; the config differs from the checkpoint's: {'; '.join(diffs[:4])}{more}" if diffs else ""
        return CheckpointMismatchError(f"run.resume: {one_line(error)}{hint}. Resume with the config it was "
                                            "saved with, or start a new run.dir")

    def _warn_config_changes(self, path: str, meta: dict) -> None:
        if isinstance(meta.get("config"), str):
            diffs = config_differences(meta["config"], self.cfg)
            if diffs:
                log.warning("resuming %s with a config that differs from the one it was saved with: %s", path,
                            "; ".join(diffs))
        elif meta.get("config_hash") != config_hash(self.cfg) and not legacy_hash_matches(meta.get("config_hash"),
                                                                                            self.cfg):
            log.warning("resuming %s with a config that differs from the one it was saved with (an older checkpoint "
                        "without its config: the keys cannot be named)", path)

    @torch.no_grad()
    def _refuse_nonfinite_loaded(self, path: str) -> None:
        """A sharded load fills the live tensors in place: refuse non-finite values in this rank's pieces."""
        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        refuse_nonfinite(path, "the model (this rank's pieces)",
                              {n: local(q) for n, q in self.model.named_parameters()})
        state = getattr(self.optimizer, "state", {}) or {}
        refuse_nonfinite(path, "the optimizer (this rank's pieces)",
                              [{k: local(v) for k, v in st.items() if torch.is_tensor(v)} for st in state.values()])

    def _load(self, path: str, data_state: dict | None = None) -> None:
        """Load a verified checkpoint into this rank's model, optimizer, scheduler, data (or `data_state`), carried
        states, RNG and spike-guard window."""
        if checkpoint_format(path) == SHARDED:  # each rank reads the chunks overlapping its own pieces
            extra = load_checkpoint(path, model=None, optimizer=None, verify=False)
            load_sharded(path, self.model, self.optimizer, self.groups, self.engine)
            self._refuse_nonfinite_loaded(path)
        elif self.engine.handles_states:  # canonical checkpoint -> FSDP2 / DeepSpeed shards
            extra = load_checkpoint(path, model=None, optimizer=None, verify=False)
            self.engine.load_states(*read_model_and_optim(path))
        elif self.groups.tp > 1 or self.groups.pp > 1:  # canonical checkpoint -> this rank's shards / stages
            extra = load_checkpoint(path, model=None, optimizer=None, verify=False)
            prt.load_states(self.model, self.optimizer, *read_model_and_optim(path))
        else:
            extra = load_checkpoint(path, model=self.model, optimizer=self.optimizer, verify=False)
        self.loaded_step = int(extra["step"])
        self.scheduler.load_state_dict(extra["scheduler"])
        data_state = extra["data"] if data_state is None else data_state
        self.data.load_state_dict(data_state)
        if self.carrier is not None:  # states of another data window (a rollback's): every row restarts, logged
            self.carrier.load_state_dict(extra.get("carried_states"), data_window=data_state.get("window"))
        restore_rng_state(extra["rng"])
        self.guard.load_state_dict(extra.get("spike_guard"))
        self._warn_config_changes(path, extra)
        self.last = path
        log.info("%s %s at step %d", "resumed from" if data_state is extra["data"] else "rolled back to", path,
                 self.loaded_step)


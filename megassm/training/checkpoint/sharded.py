"""Sharded checkpoints (`run.checkpoint_format=sharded`): every rank writes its own disjoint pieces of the
canonical state in parallel through torch.distributed.checkpoint (DCP), optionally off the training critical
path (`run.async_save=true`); any layout resumes from any other, and `megassm-checkpoint convert` turns one
into the canonical single-file layout and back (docs/parallelism.md, "Checkpoints").

Layout of a sharded checkpoint (same directory names, atomic discipline and meta.json as the canonical one,
save.py):

    step_00000100/
        dcp/.metadata          DCP's index: every tensor's global (single-device) shape, dtype and chunks
        dcp/__<rank>_<i>.distcp  the chunks rank <rank> wrote
        layout.pt              the canonical orders: model state_dict keys, optimizer parameter names (index
                               order of optim.pt) and param_groups (hyperparameters, indices), AdamW state keys
        <key>.pt               the extra states as in the canonical layout (scheduler, data, rng, carried_states)
        meta.json              "format": "sharded", files, "integrity" (sha256 of every other file), "complete"

sharded_chunks.py builds the chunk lists; this module runs DCP over them to write (loading into a live model:
sharded_load.py; the reading part, which load.py's loaders share: sharded_read.py). DCP keys are `model.<canonical name>`
(the single-device state dict) and `optim.<canonical name>.<state key>`
(AdamW exp_avg / exp_avg_sq in the parameter's canonical shape, and the 0-dim step). A rank describes what it
holds as chunks of the canonical tensors (offsets + a view of its local tensor):
  - TP (parallel/tp.py): each ShardSpec piece of the local tensor is one chunk at its canonical offset along the
    spec's dim (the fused [z|x|B|C|dt] rows of in_proj give one chunk per component);
  - FSDP2: a DTensor's local shard is one chunk at its global offset (DCP's own chunk), then TP-mapped;
  - the distributed optimizer (parallel/distopt.py): each flat piece [a, b) of a parameter that this rank owns
    (in its slice of a bucket) is cut into the few boxes (partial row, full rows, partial row, recursively) that
    tile it, each contiguous;
  - PP: each stage writes its tensors under their own names (the last stage's tied embedding copy is not written).
Replicated tensors (DDP / CP replicas, the plain "ignored" parameters of FSDP2) are cut into DP x CP row blocks
and replica r offers block r, so the writing is spread over the replicas; whatever is still offered by several
ranks with the same offsets (TP-replicated pieces, the per-parameter step) is written once by DCP's
de-duplication (the least-loaded rank). Loading builds the same chunk list for the new layout as targets (views
of the live parameters: loaded in place) and DCP reads, per target, only the saved chunks that overlap it.
DeepSpeed has no chunk view here: its states are gathered (rank 0) and loaded full (logged as a fallback).

Async: the chunks are copied to CPU (pinned on CUDA) at the step boundary, then a background thread runs the DCP
save over a dedicated gloo group, hashes this rank's files, gathers the hashes on rank 0, which writes meta.json
last and renames the temp directory (`.tmp-step_XXXXXXXX-<pid>`). The next save, the end of training and a
preemption wait for it; an interrupted write leaves a temp directory without a complete meta.json, never listed.
"""
from __future__ import annotations

import concurrent.futures
import io
import logging
import os
import shutil
import time

import torch
import torch.distributed as dist

from megassm.training.checkpoint.disk import raise_naming, torch_save, write_error
from megassm.training.checkpoint.folder import CHECKPOINTS, checkpoint_name, prune, read_meta
from megassm.training.checkpoint.integrity import file_record
from megassm.training.checkpoint.save import MODEL, OPTIM, completion_meta, publish, split_extra
from megassm.training.checkpoint.sharded_chunks import (canonical_groups, canonical_param_names,
                                                        entries_from_canonical, layout_record, model_context,
                                                        save_entries, state_keys)
from megassm.training.checkpoint.sharded_read import DCP_DIR, LAYOUT

log = logging.getLogger("megassm.checkpoint")

__all__ = ["FORMATS", "checkpoint_format", "canonical_param_names", "ShardedCheckpointer",
           "write_sharded_from_canonical", "write_canonical", "dir_files", "SHARDED", "CANONICAL"]

CANONICAL, SHARDED = "canonical", "sharded"
FORMATS = (CANONICAL, SHARDED)


def checkpoint_format(path: str) -> str:
    """CANONICAL or SHARDED (a checkpoint without a "format" in meta.json is canonical)."""
    meta = read_meta(path) or {}
    return meta.get("format", CANONICAL)


# ----------------------------------------------------------------------------------------------------
# DCP planners over chunk lists
# ----------------------------------------------------------------------------------------------------
def _save_planner(entries: dict):
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    class _ChunkSavePlanner(DefaultSavePlanner):
        """Writes the given chunks (offsets into global shapes) instead of walking a state dict."""

        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._by_index = {(k, tuple(o)): t for k, (_, pcs) in entries.items() for o, t in pcs}

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            self.state_dict = {}
            self.is_coordinator = is_coordinator

        def create_local_plan(self):
            items = []
            for key, (shape, pieces) in entries.items():
                for o, t in pieces:
                    items.append(WriteItem(
                        index=MetadataIndex(key, torch.Size(o)), type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size()),
                                                    properties=TensorProperties.create_from_tensor(t),
                                                    size=torch.Size(shape))))
            self.plan = SavePlan(items)
            return self.plan

        def lookup_object(self, index):
            return self._by_index[(index.fqn, tuple(index.offset))]

    return _ChunkSavePlanner()


def _dcp_save(entries: dict, path: str, group, no_dist: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({}, storage_writer=FileSystemWriter(path, single_file_per_rank=True, sync_files=True),
                 planner=_save_planner(entries), process_group=group, no_dist=no_dist)


# ----------------------------------------------------------------------------------------------------
# one-process readers / writers (megassm-eval, read_model_and_optim, the converter)
# ----------------------------------------------------------------------------------------------------
def dir_files(root: str) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        for f in files:
            out.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return sorted(out)


def write_sharded_from_canonical(out_dir: str, model_state: dict, optim_state: dict | None, param_names: list) -> None:
    """DCP files + layout.pt of canonical states into `out_dir` (one process, full tensors as single chunks)."""
    if optim_state is not None:
        n = sum(len(g["params"]) for g in optim_state["param_groups"])
        if n != len(param_names):
            raise ValueError(f"the optimizer state has {n} parameters, the parameter names {len(param_names)}")
    entries = entries_from_canonical(model_state, optim_state, param_names)
    _dcp_save(entries, os.path.join(out_dir, DCP_DIR), None, no_dist=True)
    keys = []
    if optim_state is not None:
        for st in optim_state["state"].values():
            keys += [k for k in st if k not in keys]
    layout = layout_record(list(model_state), param_names, optim_state["param_groups"] if optim_state else [],
                     keys or ["step", "exp_avg", "exp_avg_sq"])
    torch_save(layout, os.path.join(out_dir, LAYOUT))


def write_canonical(out_dir: str, model_state: dict, optim_state: dict | None) -> list[str]:
    torch_save(model_state, os.path.join(out_dir, MODEL))
    files = [MODEL]
    if optim_state is not None:
        torch_save(optim_state, os.path.join(out_dir, OPTIM))
        files.append(OPTIM)
    return files


# ----------------------------------------------------------------------------------------------------
# saving: the trainer's checkpointer (sync or async)
# ----------------------------------------------------------------------------------------------------
def _write_hook(stage: str) -> None:
    """Called by the background writer at `stage` ("before_write", "before_finalize"); tests patch it to hold or
    break a write at a known point."""


class ShardedCheckpointer:
    """Writes sharded checkpoints for one trainer. `save(...)` takes the snapshot at the step boundary and
    returns; with async_save the files are written by a background thread (`pending` is its future), otherwise
    before save returns. Collective: call save / wait on every rank."""

    def __init__(self, groups, async_save: bool = False, keep_last: int = 0):
        self.groups = groups
        self.async_save = async_save
        self.keep_last = keep_last
        self.world = groups.world_size if groups is not None else 1
        self.rank = groups.rank if groups is not None else 0
        # a group of our own: the background thread's collectives never interleave with the training's
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megassm-ckpt") if async_save else None
        self.pending: concurrent.futures.Future | None = None
        self._staging: dict = {}
        self.last_stats: dict = {}  # of the last finished save (benchmarks): times, bytes

    # -- the snapshot ------------------------------------------------------------------------------------
    def _stage(self, entries: dict) -> dict:
        """CPU copies of every chunk (pinned on CUDA, buffers reused across saves): the consistent snapshot."""
        staged, cuda = {}, False
        for key, (shape, pieces) in entries.items():
            out = []
            for o, t in pieces:
                buf = self._staging.get((key, o))
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    pin = t.is_cuda and torch.cuda.is_available()
                    buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                    self._staging[(key, o)] = buf
                buf.copy_(t.detach(), non_blocking=t.is_cuda)
                cuda = cuda or t.is_cuda
                out.append((o, buf))
            staged[key] = (shape, out)
        if cuda:
            torch.cuda.synchronize()
        return staged

    def wait(self) -> None:
        """Block until the previous save is complete (re-raising its error)."""
        fut, self.pending = self.pending, None
        if fut is not None:
            fut.result()

    def save(self, run_dir: str, step: int, *, model, optimizer, engine, extra: dict) -> str:
        """Write run_dir/checkpoints/step_XXXXXXXX (returns its final path). `extra` on rank 0 only (None
        elsewhere): scalars to meta.json, other values to <key>.pt, as save_checkpoint."""
        self.wait()
        t0 = time.perf_counter()
        root = os.path.join(run_dir, CHECKPOINTS)
        name = checkpoint_name(step)
        final = os.path.join(root, name)
        tmp = None
        if self.rank == 0:
            os.makedirs(root, exist_ok=True)
            tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}")
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(os.path.join(tmp, DCP_DIR))
        if self.group is not None:
            box = [tmp]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
            tmp = box[0]

        deepspeed = getattr(engine, "name", None) == "deepspeed"
        if deepspeed:  # no chunk view of DeepSpeed's partitions: gathered canonical states, written by rank 0
            if self.rank == 0:
                log.warning("run.checkpoint_format=sharded with parallel.engine=deepspeed: fallback: the states are "
                            "gathered to rank 0 (engine.gather_states) and written from there")
            msd, osd = engine.gather_states()
            names = canonical_param_names(model, optimizer, engine)
            entries = entries_from_canonical(msd, osd, names) if self.rank == 0 else {}
            layout = layout_record(list(msd), names, osd["param_groups"], ["step", "exp_avg", "exp_avg_sq"]) \
                if self.rank == 0 else None
        else:
            entries = save_entries(model, optimizer, self.groups)
            layout = self._layout(model, optimizer, engine)
        if self.async_save:
            entries = self._stage(entries)
        payload = None
        if self.rank == 0:  # extras serialized now (the step boundary's values), written with the rest
            payload = self._payload(extra, layout)
        snap_s = time.perf_counter() - t0
        job = (entries, tmp, final, run_dir, step, payload, t0)
        if self.async_save:
            self.pending = self.pool.submit(self._write, *job)
        else:
            self._write(*job)
        self.last_stats = {"snapshot_s": snap_s, "blocked_s": time.perf_counter() - t0}
        return final

    def _layout(self, model, optimizer, engine=None) -> dict | None:
        inner, tplan, pplan = model_context(model)
        names = canonical_param_names(model, optimizer, engine) if optimizer is not None else []
        if pplan is not None:
            model_keys = list(pplan.state_names)
            groups = None
            if optimizer is not None:  # the decay / no-decay hyperparameters of every stage
                from megassm.parallel.pp import param_kinds

                kinds = param_kinds(pplan)
                mine = {}
                for g in optimizer.param_groups:
                    if g["params"]:
                        n = {id(p): n for n, p in inner.named_parameters()}[id(g["params"][0])]
                        mine.setdefault(kinds[n], {k: v for k, v in g.items() if k != "params"})
                allh = [None] * self.world
                dist.all_gather_object(allh, mine, group=self.group)
                hyper = {}
                for h in allh:
                    for k, v in h.items():
                        hyper.setdefault(k, v)
                groups, off = [], 0
                for kind, ns in (("decay", pplan.decay_names), ("no_decay", pplan.no_decay_names)):
                    if ns:
                        groups.append({**hyper[kind], "params": list(range(off, off + len(ns)))})
                        off += len(ns)
        else:
            model_keys = list(inner.state_dict())
            groups = canonical_groups(optimizer, engine) if optimizer is not None else []
        if self.rank != 0:
            return None
        return layout_record(model_keys, names, groups or [], state_keys(optimizer) if optimizer is not None else [])

    @staticmethod
    def _payload(extra: dict, layout: dict) -> dict:
        scalars, states = split_extra(extra, "sharded checkpoint")
        files = {}
        for key, value in {**{f"{k}.pt": v for k, v in states.items()}, LAYOUT: layout}.items():
            buf = io.BytesIO()
            torch.save(value, buf)
            files[key] = buf.getvalue()
        return {"scalars": scalars, "files": files, "extra_files": list(states)}

    # -- the write (background thread with async_save) ---------------------------------------------------
    def _write(self, entries, tmp, final, run_dir, step, payload, t0) -> str:
        """Every rank's chunks, then rank 0's extra files and meta.json, then the rename. A failure to write (a full
        disk, a file-size limit: torch reports them as RuntimeErrors) raises CheckpointWriteError naming the file and
        the cause on the ranks that meet it, and rank 0 removes the temp directory: nothing half-written is left."""
        try:
            return self._write_files(entries, tmp, final, run_dir, step, payload, t0)
        except BaseException as e:
            error = write_error(e, final, tmp)  # before the removal: it may look at the files and free space
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if error is not None and error is not e:
                raise error from e
            raise

    def _write_files(self, entries, tmp, final, run_dir, step, payload, t0) -> str:
        _write_hook("before_write")
        dcp_dir = os.path.join(tmp, DCP_DIR)
        try:
            _dcp_save(entries, dcp_dir, self.group, no_dist=self.group is None)
        except BaseException as e:  # DCP's CheckpointException is a BaseException; it gathers every rank's failure,
            if not isinstance(e, (KeyboardInterrupt, SystemExit)):  # so which rank's file failed is not known here
                raise_naming(e, dcp_dir)
            raise
        mine = [f for f in dir_files(dcp_dir) if f.startswith(f"__{self.rank}_")]
        if self.rank == 0:
            mine.append(".metadata")
        records = {f"{DCP_DIR}/{f}": file_record(os.path.join(dcp_dir, f)) for f in mine}
        if self.group is not None:
            allrec = [None] * self.world if self.rank == 0 else None
            dist.gather_object(records, allrec, dst=dist.get_global_rank(self.group, 0), group=self.group)
        else:
            allrec = [records]
        if self.rank != 0:
            return final
        _write_hook("before_finalize")
        merged = {}
        for r in allrec:
            merged.update(r)
        for fname, data in payload["files"].items():
            try:
                with open(os.path.join(tmp, fname), "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                raise_naming(e, os.path.join(tmp, fname))
                raise
            merged[fname] = file_record(os.path.join(tmp, fname))
        on_disk = set(dir_files(tmp))
        if set(merged) != on_disk:
            raise RuntimeError(f"sharded checkpoint {tmp}: files {sorted(on_disk ^ set(merged))} were not "
                               "accounted for by the ranks")
        meta = completion_meta(step, payload["scalars"], {k: merged[k] for k in sorted(merged)},
                                    payload["extra_files"], format=SHARDED, world_size=self.world)
        publish(tmp, final, meta)
        total = sum(r["bytes"] for r in merged.values())
        self.last_stats = {**self.last_stats, "complete_s": time.perf_counter() - t0, "bytes": total}
        log.info("sharded checkpoint %s complete: %d files, %.3f GB, %.2fs after the step boundary", final,
                 len(merged), total / 1e9, time.perf_counter() - t0)
        prune(run_dir, self.keep_last, final)
        return final

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)

"""BPTT state caching: carry each row's recurrent state from one training window to the next.

    carrier = StateCarrier(model, micro_batch=mb, accumulation=accum, windows=K, device=dev)
    loss = carrier.run_windows(model, m, batches)     # micro-batch m: K consecutive windows, one backward
    extra["carried_states"] = carrier.state_dict()    # checkpoint; carrier.load_state_dict(...) on resume

Semantics (docs/bptt.md):
  * The data pipeline (build_data(..., bptt=True)) makes row b of the global batch follow stream b, and
    micro-batch m of every step hold the same rows m*mb ... (m+1)*mb - 1 of this rank. The carrier keeps
    one state per row of this rank, as one list of per-block states per micro-batch.
  * What is carried, per block: Mamba-2 `MambaState(conv, ssm)` (fp32); sliding-window attention its
    `KVCache` of the last W keys/values (RoPE positions continue); full attention nothing (it sees only the
    current window, positions restart at the window start); MLP nothing.
  * Resets: before a window, rows whose `batch["reset"]` is True (the window begins a new document) are
    cleared (Mamba states zeroed, caches invalidated); documents that start inside a window are cut by
    `seq_idx` in the kernels and in attention. A stream restart (fresh start, or a resume whose checkpoint has
    no carried states for this data position) starts every row from zero states.
  * Truncated BPTT: with train.bptt_windows = K (default 1), one optimizer step consumes K consecutive
    windows of every row. Micro-batch m runs its K windows with the states carried *with* their autograd
    graph, the K window losses are combined into the token-weighted mean (= the loss of one K*L-token
    forward), and one backward runs through all K windows (gradients reach the earlier windows through the
    kernels' initial-state gradients). The states are detached after the backward, so no graph crosses an
    optimizer step. K = 1 is plain truncated BPTT: values carried, history cut at every step.
  * Context parallelism (parallel/cp.py): every CP rank returns the same final states, so every rank's
    carrier holds the same rows; the window losses are weighted by the whole rows' token counts.
  * Tensor parallelism: each rank carries its shard (its heads / conv channels / kv heads), exactly what its
    mixers return; nothing crosses ranks between windows.
  * Pipeline parallelism: each rank carries the states of its own blocks; the stage modules take and return
    them per micro-batch inside the schedule (parallel/pp.py, `bptt_mb` / `bptt_reset`). Truncated BPTT only
    (K = 1): a graph through K windows would span K schedule runs.
  * Data parallelism: rank r carries its rows r*rows ... (the data pipeline's row layout).
  * Checkpoints hold the canonical states (single-device layout: every global row, every block, full heads),
    gathered to global rank 0; every rank takes its rows / blocks / shard back on resume, so a run can
    resume with another TP / PP / DP layout at the same global batch.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from megassm.models.registry import block_kind
from megassm.models.state import KVCache, MambaState, detach_states, reset_states
from megassm.parallel.cp import global_token_count
from megassm.parallel.pp import pp_plan_of
from megassm.parallel.tp import gather_canonical, plan_of, shard_canonical, state_shard_specs

log = logging.getLogger("megassm.bptt")

__all__ = ["StateCarrier", "carried_kinds", "STATE_VERSION"]

STATE_VERSION = 1


def _unwrap(model):
    from megassm.training.checkpoint import unwrap_model

    return unwrap_model(model)


def block_layout(model) -> tuple[list[int], int]:
    """(global index of each of this rank's blocks, number of blocks of the whole model): PP ranks hold a
    subset of the blocks (parallel/pp.py), every other layout all of them."""
    m = _unwrap(model)
    return m.layers.keys(), m.n_layers  # keyed by global index (models/lm.py Layers)


def carried_kinds(model) -> list[str | None]:
    """Per block: "mamba" (conv + ssm carried), "window" (sliding-window KV cache carried), or None
    (full attention, MLP: nothing carried), as each block kind's `bptt` declares (models/registry.py)."""
    kinds = []
    for layer in _unwrap(model).layers:
        carried = block_kind(layer.kind).bptt
        kinds.append(None if carried is None else carried(layer.mixer))
    return kinds


def _cat(states_list: list[list]) -> list:
    """Concatenate per-micro-batch states along the batch dimension."""
    out = []
    for per_block in zip(*states_list):
        first = per_block[0]
        if first is None:
            out.append(None)
        elif isinstance(first, MambaState):
            out.append(MambaState(conv=torch.cat([s.conv for s in per_block]), ssm=torch.cat([s.ssm for s in per_block])))
        else:
            out.append(KVCache(k=torch.cat([s.k for s in per_block]), v=torch.cat([s.v for s in per_block]),
                               valid=torch.cat([s.valid for s in per_block]), pos=torch.cat([s.pos for s in per_block])))
    return out


def _rows(states: list, lo: int, hi: int) -> list:
    out = []
    for s in states:
        if s is None:
            out.append(None)
        elif isinstance(s, MambaState):
            out.append(MambaState(conv=s.conv[lo:hi].clone(), ssm=s.ssm[lo:hi].clone()))
        else:
            out.append(KVCache(k=s.k[lo:hi].clone(), v=s.v[lo:hi].clone(), valid=s.valid[lo:hi].clone(),
                               pos=s.pos[lo:hi].clone()))
    return out


def _to_plain(states: list) -> list:
    """States -> plain dicts of CPU tensors (checkpoint files load with weights_only=True)."""
    out = []
    for s in states:
        if s is None:
            out.append(None)
        elif isinstance(s, MambaState):
            out.append({"kind": "mamba", "conv": s.conv.detach().cpu(), "ssm": s.ssm.detach().cpu()})
        else:
            out.append({"kind": "window", "k": s.k.detach().cpu(), "v": s.v.detach().cpu(),
                        "valid": s.valid.detach().cpu(), "pos": s.pos.detach().cpu()})
    return out


def _names(s) -> tuple:
    return ("conv", "ssm") if isinstance(s, MambaState) else ("k", "v", "valid", "pos")


def _cat_plain(parts: list[dict]) -> dict:
    """One block's plain states of consecutive row ranges -> one plain state of all the rows."""
    return {k: (v if k == "kind" else torch.cat([p[k] for p in parts])) for k, v in parts[0].items()}


def _from_plain(plain: list, device) -> list:
    out = []
    for s in plain:
        if s is None:
            out.append(None)
        elif s["kind"] == "mamba":
            out.append(MambaState(conv=s["conv"].to(device), ssm=s["ssm"].to(device)))
        else:
            out.append(KVCache(k=s["k"].to(device), v=s["v"].to(device), valid=s["valid"].to(device),
                               pos=s["pos"].to(device)))
    return out


class StateCarrier:
    """The recurrent states of every row of this rank, between training windows.

    `micro_batch` rows per micro-batch, `accumulation` micro-batches per step (rows = their product);
    `windows` = train.bptt_windows (K). `window` counts the data windows whose final states are held: the
    states feed data window `window` next (it matches the data pipeline's state_dict()["window"])."""

    def __init__(self, model, micro_batch: int, accumulation: int = 1, windows: int = 1, device=None,
                 groups=None):
        if windows < 1:
            raise ValueError(f"bptt windows must be >= 1, got {windows}")
        self.groups = groups  # ParallelGroups (None: one process)
        if windows > 1 and pp_plan_of(_unwrap(model)) is not None:
            raise ValueError("BPTT through K > 1 windows with pipeline parallelism is not supported: the graph "
                             "would span K pipeline schedule runs (use train.bptt_windows=1)")
        self.blocks, self.n_blocks = block_layout(model)
        self._slot = {b: j for j, b in enumerate(self.blocks)}  # global block index -> position in the states
        self.kinds = carried_kinds(model)
        self._pending: dict = {}  # PP: (micro-batch, block) -> final state of the running schedule
        self.micro_batch, self.accumulation, self.windows = int(micro_batch), int(accumulation), int(windows)
        self.rows = self.micro_batch * self.accumulation
        self.device = torch.device(device) if device is not None else _unwrap(model).embedding.weight.device
        self._model = _unwrap(model)
        self.window = 0
        self.states: list[list] = []
        self.reset_all()
        log.info("BPTT: carrying the states of %d rows (%d micro-batches of %d), %d window(s) per optimizer step; "
                 "per block: %s", self.rows, self.accumulation, self.micro_batch, self.windows,
                 " ".join(k or "-" for k in self.kinds))

    # ------------------------------------------------------------------------------------------------
    def _fresh(self, rows: int) -> list:
        full = self._model.allocate_states(rows, device=self.device)
        return [s if k is not None else None for s, k in zip(full, self.kinds)]

    def reset_all(self) -> None:
        """A stream restart: every row starts from zero states."""
        self.states = [self._fresh(self.micro_batch) for _ in range(self.accumulation)]

    def begin(self, m: int, reset: torch.Tensor | None) -> list:
        """The initial states of micro-batch m for its next window, with the rows flagged in `reset` [mb]
        cleared (those rows start a new document at the window's first token)."""
        states = self.states[m]
        if reset is not None:
            states = reset_states(states, reset.to(self.device))
        return states

    def end(self, m: int, new_states: list, detach: bool = True) -> None:
        """Keep micro-batch m's final states (what the model returned), dropping what is not carried
        (full-attention caches, MLP None). `detach`: cut the graph (the default between steps)."""
        kept = [s if k is not None else None for s, k in zip(new_states, self.kinds)]
        self.states[m] = detach_states(kept) if detach else kept

    def detach(self) -> None:
        self.states = [detach_states(s) for s in self.states]

    # --- pipeline stages (parallel/pp.py StageModule.forward) ----------------------------------------
    def stage_begin(self, m: int, reset: torch.Tensor | None, blocks: list[int]) -> list:
        """Initial states of `blocks` (global indices) for micro-batch m's window, rows flagged in `reset`
        cleared."""
        states = [self.states[m][self._slot[b]] for b in blocks]
        return reset_states(states, reset) if reset is not None else states

    def stage_end(self, m: int, blocks: list[int], new_states: list) -> None:
        """Final states of `blocks` (global indices) for micro-batch m, held until `commit` (the schedule may run a
        stage's forward more than once, e.g. its first-step shape inference: the last run wins and nothing
        is read back before the step ends)."""
        for b, s in zip(blocks, new_states):
            j = self._slot[b]
            self._pending[(m, j)] = None if (self.kinds[j] is None or s is None) else detach_states([s])[0]

    def commit(self) -> None:
        for (m, j), s in self._pending.items():
            self.states[m][j] = s
        self._pending = {}

    # ------------------------------------------------------------------------------------------------
    def run_windows(self, model, m: int, batches: list[dict], autocast=contextlib.nullcontext,
                    scale: float = 1.0, backward: bool = True) -> torch.Tensor:
        """Micro-batch m through its consecutive windows `batches` (each a batch dict on the device:
        tokens, labels, seq_idx, reset) with states carried with their graph; one backward of
        `scale` x the token-weighted mean loss over the windows; then the states are detached.
        Returns the (detached) mean loss."""
        losses, counts = [], []
        for batch in batches:
            states = self.begin(m, batch.get("reset"))
            with autocast():
                out = model(batch["tokens"], seq_idx=batch.get("seq_idx"), labels=batch["labels"],
                            states=states, return_states=True)
            self.end(m, out.states, detach=False)
            losses.append(out.loss)
            counts.append(global_token_count(model, batch["labels"]))  # CP: the whole rows' count
        if len(losses) == 1:
            loss = losses[0]
        else:
            n = torch.stack(counts).to(losses[0].dtype)
            loss = (torch.stack(losses) * n).sum() / n.sum().clamp(min=1)
        if backward:
            (loss * scale).backward() if scale != 1.0 else loss.backward()
        self.states[m] = detach_states(self.states[m])
        return loss.detach()

    def train_step(self, trainer, loss_sum: torch.Tensor) -> float:
        """The forward/backward part of one optimizer step of `trainer` in BPTT mode: fetches the step's
        K x accumulation micro-batches (window-major, as the data pipeline serves them), then runs each
        micro-batch's K windows in order with one backward each. Adds each micro-batch's loss to `loss_sum`
        (so loss_sum / accumulation is the step's loss, as without BPTT). Returns the data time."""
        data_time = 0.0
        accum = self.accumulation
        if pp_plan_of(_unwrap(trainer.model)) is not None:  # K = 1: the schedule runs the micro-batches
            from megassm.parallel.pp import train_step as pipeline_train_step

            td = time.perf_counter()
            batches = [trainer._to_device(trainer.data.next_batch()) for _ in range(accum)]
            data_time = time.perf_counter() - td
            try:
                loss_sum += pipeline_train_step(trainer.model, batches, trainer._autocast, carrier=self)
            finally:
                self._pending = {}
            self.window += 1
            return data_time
        fetched = []
        for _ in range(self.windows * accum):
            td = time.perf_counter()
            fetched.append(trainer._to_device(trainer.data.next_batch()))
            data_time += time.perf_counter() - td
        for m in range(accum):
            batches = [fetched[w * accum + m] for w in range(self.windows)]
            with trainer.engine.micro_batch(last=m == accum - 1):  # FSDP2 / HSDP: gradient syncs once per step
                loss_sum += self.run_windows(trainer.model, m, batches, trainer._autocast, scale=1.0 / accum)
        self.window += self.windows
        return data_time

    # ------------------------------------------------------------------------------------------------
    def _canonical_heads(self, states: list) -> list:
        """TP: every rank's shards -> full heads / channels (collective over the TP group)."""
        plan = plan_of(self._model)
        if plan is None:
            return states
        specs = state_shard_specs(states, self._model)
        return [None if st is None else replace(st, **{n: gather_canonical(getattr(st, n), specs[f"{i}.{n}"], plan)
                                                       for n in _names(st) if f"{i}.{n}" in specs})
                for i, st in enumerate(states)]

    def state_dict(self) -> dict | None:
        """The canonical carried states (plain CPU tensors): every global row (data-parallel ranks' rows in
        rank order), every block of the model, full heads. Collective when distributed: the dict on global
        rank 0, None on the other ranks."""
        mine = _to_plain(self._canonical_heads(_cat(self.states)))
        g = self.groups
        if g is None or g.world_size == 1:
            return {"version": STATE_VERSION, "window": self.window, "rows": self.rows, "kinds": list(self.kinds),
                    "states": mine}
        # one contribution per (dp, pp) rank: TP ranks hold the same canonical states, CP ranks the same rows
        contrib = (g.dp_rank, self.blocks, list(self.kinds), mine) if g.tp_rank == 0 and g.cp_rank == 0 else None
        gathered = [None] * g.world_size if g.rank == 0 else None
        dist.gather_object(contrib, gathered, dst=0)
        if g.rank != 0:
            return None
        kinds: list = [None] * self.n_blocks
        per_block: list = [dict() for _ in range(self.n_blocks)]  # block -> {dp rank: plain state}
        for item in gathered:
            if item is not None:
                dp_rank, blocks, ks, plain = item
                for b, k, st in zip(blocks, ks, plain):
                    kinds[b] = k
                    per_block[b][dp_rank] = st
        states = [None if kinds[b] is None else _cat_plain([per_block[b][r] for r in range(g.dp)])
                  for b in range(self.n_blocks)]
        return {"version": STATE_VERSION, "window": self.window, "rows": self.rows * g.dp, "kinds": kinds,
                "states": states}

    def load_state_dict(self, d: dict | None, data_window: int | None = None) -> bool:
        """Restore the carried states from the canonical dict (every rank takes its rows, blocks and TP
        shard). `data_window`: the data pipeline's window after its own resume; when the saved states do not
        belong to it (or there are none, or the layout differs) every row restarts from zero states, with a
        warning. Returns True when the states were restored."""
        def restart(why: str) -> bool:
            log.warning("BPTT: %s; every stream restarts from zero states", why)
            self.reset_all()
            self.window = int(data_window or 0)
            return False

        dp = self.groups.dp if self.groups is not None else 1
        dp_rank = self.groups.dp_rank if self.groups is not None else 0
        if d is None:
            return restart("the checkpoint has no carried states")
        if d.get("version") != STATE_VERSION:
            return restart(f"carried states of version {d.get('version')} (expected {STATE_VERSION})")
        if d.get("rows") != self.rows * dp:
            return restart(f"carried states of {d.get('rows')} rows, this run has {self.rows * dp} "
                           f"({self.rows} per data-parallel rank x {dp})")
        kinds = list(d.get("kinds", []))
        if len(kinds) != self.n_blocks or [kinds[b] for b in self.blocks] != list(self.kinds):
            return restart("the carried states' layers differ from this model's")
        if data_window is not None and int(d["window"]) != int(data_window):
            return restart(f"carried states are for window {d['window']}, the data resumes at window {data_window}")
        lo = dp_rank * self.rows
        full = _from_plain([d["states"][b] for b in self.blocks], self.device)
        full = _rows(full, lo, lo + self.rows)
        plan = plan_of(self._model)
        if plan is not None:  # this rank's heads / channels
            specs = state_shard_specs(full, self._model)
            full = [None if st is None else replace(st, **{n: shard_canonical(getattr(st, n), specs[f"{i}.{n}"],
                                                                              plan.rank)
                                                           for n in _names(st) if f"{i}.{n}" in specs})
                    for i, st in enumerate(full)]
        mb = self.micro_batch
        self.states = [_rows(full, m * mb, (m + 1) * mb) for m in range(self.accumulation)]
        self.window = int(d["window"])
        return True

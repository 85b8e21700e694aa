"""Process groups for tensor / context / data / pipeline parallelism (order tp-cp-dp-pp).

    init_distributed()                       # torch.distributed from the launcher's env (gloo CPU, nccl CUDA)
    groups = build_groups(tp=2)              # megatron.core.parallel_state underneath (MEGASSM_PROCESS_GROUPS)
    groups.tp_group, groups.tp_rank, groups.cp_group, groups.cp_rank, groups.dp_group, groups.dp_rank, ...

megatron-core's `parallel_state.initialize_model_parallel` only creates `torch.distributed.new_group`s and
works unchanged over gloo on CPU (verified: tests/test_parallel_tp.py runs it on gloo). We wrap it so that
 - the backend of the new groups follows the default group (gloo on CPU, nccl on CUDA), and
 - a single process (world size 1, no process group) gets trivial "groups" (None) without touching
   torch.distributed at all, so the single-device trainer keeps working without a launcher.
Nothing CUDA-only from megatron-core is used here (its tensor_parallel layers are not used: see
docs/parallelism.md).
"""
from __future__ import annotations

import datetime
import gc
import logging
import os
import sys
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ParallelGroups", "init_distributed", "build_groups", "destroy", "single_process_groups", "group_builder",
           "nccl_error_handling", "release_before_destroy", "HSDPGroups", "hsdp_groups"]

log = logging.getLogger("megassm.parallel")


@dataclass
class ParallelGroups:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    rank: int = 0
    world_size: int = 1
    tp_group: object = None  # torch.distributed ProcessGroup or None (single process)
    dp_group: object = None
    cp_rank: int = 0
    cp_group: object = None  # context parallel: ranks holding the slices of the same rows (parallel/cp.py)
    pp_rank: int = 0
    pp_group: object = None  # pipeline parallel: the ranks holding the stages of one model replica (parallel/pp.py)
    emb_group: object = None  # pp > 1, first and last pipeline rank only: the tied-embedding gradient sum
    megatron: bool = False  # built through megatron.core.parallel_state
    # the ranks holding the same parameters across DP and CP (the DP group when cp = 1): the distributed optimizer
    # shards over it, as Megatron's does (parallel/distopt.py)
    dp_cp_group: object = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def single_process_groups() -> ParallelGroups:
    return ParallelGroups()


def init_distributed(device_type: str | None = None, timeout_s: float = 600.0) -> bool:
    """Initialize the default process group from the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT). Backend: nccl when `device_type` is cuda (or None and CUDA is available), else gloo.
    `timeout_s` (parallel.timeout_s) bounds every collective: a peer that stalls longer fails it (gloo raises;
    NCCL's watchdog ends the process, nccl_error_handling). Returns True when a process group is (now)
    initialized with more than one rank."""
    if dist.is_initialized():
        return dist.get_world_size() > 1
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    if ws <= 1:
        return False
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl":
        nccl_error_handling()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout)
    _set_group_timeout(timeout)
    return True


_GROUP_TIMEOUT: dict = {"value": None}  # init_distributed's timeout, for every group created after it


def _set_group_timeout(timeout: datetime.timedelta) -> None:
    """A group created without a timeout gets torch's default (30 min gloo, 10 min NCCL), not the world group's:
    build_groups passes this one explicitly, and it becomes torch's default for the groups other libraries
    create (DeepSpeed clones the world group for its reductions)."""
    _GROUP_TIMEOUT["value"] = timeout
    c10d = dist.distributed_c10d
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout  # read by new_group(timeout=None)


# TORCH_NCCL_ASYNC_ERROR_HANDLING: what NCCL's watchdog thread does with a failed or timed-out collective.
# 3 (torch's default) ends the process without aborting the communicators (an abort can itself hang); 1 (what
# torchrun sets for its workers when unset) aborts them, then ends the process; 2 aborts them and leaves the
# error to the next use of the group; 0 does nothing: the rank waits on.
NCCL_NO_HANDLING = "0"


def nccl_error_handling() -> str:
    """Make a failed or timed-out NCCL collective end this process, so that the launcher stops the job instead
    of it hanging: TORCH_NCCL_ASYNC_ERROR_HANDLING=3 when unset. 0 is kept (it may be wanted for debugging)
    and warned about. Read by each NCCL process group when it is created: call before init_process_group.
    Returns the value in force."""
    value = os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3").strip()
    if value == NCCL_NO_HANDLING:
        log.warning("TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a failed or timed-out collective will not end this rank; "
                    "the job may hang past parallel.timeout_s (unset it, or use 3)")
    return value


GROUP_BUILDERS = ("auto", "megatron", "torch")


def group_builder() -> str:
    """MEGASSM_PROCESS_GROUPS: who creates the groups. `auto` (default): megatron-core's parallel_state when it
    is installed, else plain torch.distributed groups of the same layout; `megatron`: megatron-core, an error
    when it is missing; `torch`: the plain builder (no megatron-core import: ~2 s less per rank, which the CPU
    test suite uses; tests/test_parallel_tp.py checks both builders give the same groups)."""
    v = os.environ.get("MEGASSM_PROCESS_GROUPS", "auto").strip().lower()
    if v not in GROUP_BUILDERS:
        raise ValueError(f"MEGASSM_PROCESS_GROUPS={v!r}: expected one of {', '.join(GROUP_BUILDERS)}")
    return v


def build_groups(tp: int = 1, cp: int = 1, pp: int = 1) -> ParallelGroups:
    """Create the groups (order tp-cp-dp-pp) with megatron.core.parallel_state or the plain builder, as
    MEGASSM_PROCESS_GROUPS says (group_builder). Single process: trivial."""
    builder = group_builder()  # a bad value fails in single-process runs too
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if tp * cp * pp != 1:
            raise ValueError(f"tp={tp} cp={cp} pp={pp} needs a multi-process launch (torchrun)")
        return single_process_groups()
    ws = dist.get_world_size()
    if ws % (tp * cp * pp):
        raise ValueError(f"world size {ws} is not divisible by tp*cp*pp = {tp * cp * pp}")
    if builder == "torch":
        return _log_builder(_build_groups_torch(tp, cp, pp), "torch.distributed (MEGASSM_PROCESS_GROUPS=torch)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" on CPU
            from megatron.core import parallel_state as ps
    except ImportError as e:
        if builder == "megatron":
            raise ImportError(f"MEGASSM_PROCESS_GROUPS=megatron, but megatron-core does not import: {e}") from e
        return _log_builder(_build_groups_torch(tp, cp, pp),
                            "torch.distributed (megatron-core is not installed; the same layout)")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    timeout = _GROUP_TIMEOUT["value"]
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        order="tp-cp-ep-dp-pp",
        create_gloo_process_groups=False,
        distributed_timeout_minutes=timeout.total_seconds() / 60 if timeout else 30,  # 30: megatron-core's default
    )
    return _log_builder(ParallelGroups(
        tp=tp, cp=cp, pp=pp, dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        rank=dist.get_rank(), world_size=ws,
        tp_group=ps.get_tensor_model_parallel_group(), dp_group=ps.get_data_parallel_group(),
        cp_rank=ps.get_context_parallel_rank(), cp_group=ps.get_context_parallel_group(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_group=ps.get_pipeline_model_parallel_group(),
        emb_group=(ps.get_embedding_group(check_initialized=False)
                   if pp > 1 and ps.is_rank_in_embedding_group() else None),
        megatron=True, dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
    ), "megatron-core parallel_state")


def _log_builder(groups: ParallelGroups, how: str) -> ParallelGroups:
    if groups.rank == 0:
        log.info("process groups: %s; tp %d x cp %d x dp %d x pp %d", how, groups.tp, groups.cp, groups.dp, groups.pp)
    return groups


def rank_layout(world: int, tp: int, cp: int = 1, pp: int = 1) -> tuple[list, list]:
    """(tp groups, dp groups) as lists of global ranks for the order tp-cp-dp-pp (tp fastest):
    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)). Megatron's layout for that order."""
    dp = world // (tp * cp * pp)
    tp_groups = [list(range(s, s + tp)) for s in range(0, world, tp)]
    dp_groups = []
    for p_ in range(pp):
        for c in range(cp):
            for t in range(tp):
                dp_groups.append([t + tp * (c + cp * (d + dp * p_)) for d in range(dp)])
    return tp_groups, dp_groups


def cp_layout(world: int, tp: int, cp: int = 1, pp: int = 1) -> list:
    """Context-parallel groups (lists of global ranks) of the layout in rank_layout."""
    dp = world // (tp * cp * pp)
    return [[t + tp * (c + cp * (d + dp * p_)) for c in range(cp)]
            for p_ in range(pp) for d in range(dp) for t in range(tp)]


def dp_cp_layout(world: int, tp: int, cp: int = 1, pp: int = 1) -> list:
    """The DP x CP groups (lists of global ranks, ascending) of the layout in rank_layout: the ranks of one TP
    rank and one pipeline stage, all of whose parameters are the same."""
    dp = world // (tp * cp * pp)
    return [sorted(t + tp * (c + cp * (d + dp * p_)) for d in range(dp) for c in range(cp))
            for p_ in range(pp) for t in range(tp)]


def pp_layout(world: int, tp: int, cp: int = 1, pp: int = 1) -> list:
    """Pipeline groups (lists of global ranks, stage order) of the layout in rank_layout."""
    dp = world // (tp * cp * pp)
    return [[t + tp * (c + cp * (d + dp * p_)) for p_ in range(pp)]
            for d in range(dp) for c in range(cp) for t in range(tp)]


@dataclass
class HSDPGroups:
    """HSDP (parallel.shard_size < DP, parallel/fsdp2.py): this rank's DP group cut into shard groups of
    `shard_size` consecutive DP ranks (inside a node when the layout puts them there) and replicate groups (the
    ranks at the same place of every shard group: one per shard group, across nodes). `mesh`: the global ranks of
    this rank's DP group as [replicas, shard_size], the DeviceMesh FSDP2 takes."""

    shard_group: object
    replicate_group: object
    mesh: list
    shard_size: int
    replicas: int


def hsdp_groups(groups: ParallelGroups, shard_size: int) -> HSDPGroups:
    """Shard and replicate groups inside every DP group of the layout (collective: every rank creates every
    group, in the same order). The DP groups are the builders' own (rank_layout's order, which
    tests/test_parallel_tp.py checks equal to megatron-core's); a mismatch with this rank's live DP group is an
    error, not a silent re-layout."""
    _, dp_groups = rank_layout(groups.world_size, groups.tp, groups.cp, groups.pp)
    timeout = _GROUP_TIMEOUT["value"]
    me = groups.rank
    shard = rep = mine = None
    for ranks in dp_groups:
        if len(ranks) % shard_size:
            raise ValueError(f"parallel.shard_size={shard_size} does not divide the {len(ranks)} data-parallel ranks")
        for k in range(0, len(ranks), shard_size):
            sub = ranks[k:k + shard_size]
            g = dist.new_group(sub, timeout=timeout)
            if me in sub:
                shard = g
        for j in range(shard_size):
            sub = ranks[j::shard_size]
            g = dist.new_group(sub, timeout=timeout)
            if me in sub:
                rep = g
        if me in ranks:
            mine = ranks
    live = dist.get_process_group_ranks(groups.dp_group)
    if live != mine:
        raise RuntimeError(f"HSDP: this rank's data-parallel group {live} is not the layout's {mine}")
    replicas = len(mine) // shard_size
    return HSDPGroups(shard, rep, [mine[k * shard_size:(k + 1) * shard_size] for k in range(replicas)],
                      shard_size, replicas)


def _build_groups_torch(tp: int, cp: int, pp: int) -> ParallelGroups:
    ws, rank = dist.get_world_size(), dist.get_rank()
    timeout = _GROUP_TIMEOUT["value"]  # None (torch's default) when init_distributed did not start the group
    tp_groups, dp_groups = rank_layout(ws, tp, cp, pp)
    my_tp = my_dp = my_cp = None
    for ranks in tp_groups:  # every rank creates every group, in the same order
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            my_tp, tp_ranks = g, ranks
    for ranks in dp_groups:
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            my_dp, dp_ranks = g, ranks
    for ranks in cp_layout(ws, tp, cp, pp):
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            my_cp, cp_ranks = g, ranks
    my_dp_cp = my_dp
    if cp > 1:
        for ranks in dp_cp_layout(ws, tp, cp, pp):
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                my_dp_cp = g
    my_pp = my_emb = None
    for ranks in pp_layout(ws, tp, cp, pp):
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            my_pp, pp_ranks = g, ranks
    if pp > 1:  # the first and last stage of every pipeline (Megatron's embedding groups)
        for ranks in pp_layout(ws, tp, cp, pp):
            g = dist.new_group([ranks[0], ranks[-1]], timeout=timeout)
            if rank in (ranks[0], ranks[-1]):
                my_emb = g
    return ParallelGroups(tp=tp, cp=cp, pp=pp, dp=len(dp_ranks), tp_rank=tp_ranks.index(rank),
                          dp_rank=dp_ranks.index(rank), rank=rank, world_size=ws, tp_group=my_tp,
                          dp_group=my_dp, cp_rank=cp_ranks.index(rank), cp_group=my_cp,
                          pp_rank=pp_ranks.index(rank), pp_group=my_pp, emb_group=my_emb, megatron=False,
                          dp_cp_group=my_dp_cp)


# objects whose release() must run before the process groups are destroyed: CUDA graphs holding captured NCCL
# collectives (training/cuda_graph.py), since NCCL >= 2.26 waits in a communicator's destruction until no graph
# references it; weakly held, so a graph released with its trainer is simply gone
_RELEASE_FIRST: weakref.WeakSet = weakref.WeakSet()


def release_before_destroy(obj) -> None:
    """Have destroy() call obj.release() before it tears the process groups down (while obj lives)."""
    _RELEASE_FIRST.add(obj)


def destroy(barrier: bool = False) -> None:
    """Tear down the process groups. With `barrier` (a run that finished normally on every rank) the ranks
    first wait for each other, so none tears down its groups while a peer's last pipeline sends and
    collectives are still in flight: a 4-rank TP x PP run on CPU now and then lost a rank to an abort at
    exit ("terminate called without an active exception") after it had finished. Never on an error path,
    where a peer may not arrive. Callers release what holds groups (the trainer) first: a garbage collection
    here frees it before the groups go."""
    if barrier and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    for obj in list(_RELEASE_FIRST):  # CUDA graphs with captured collectives go before their communicators
        try:
            obj.release()
        except Exception as e:  # an error path (a broken CUDA context): the teardown goes on
            log.warning("releasing %s before the process groups: %s", type(obj).__name__, e)
    # objects that still hold a group (a released model's pipeline stages, DDP reducer, ... in reference
    # cycles) are freed now, while the groups and the interpreter are intact, not by the collector at exit
    gc.collect()
    # megatron-core's groups exist only if build_groups imported it (importing it here costs seconds)
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

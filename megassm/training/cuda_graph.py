"""One micro-batch's forward + backward captured in a CUDA graph and replayed (`train.cuda_graph=true`).

A Mamba-2 step launches thousands of small kernels (13 Triton launches and ~30 torch glue ops per SSD call,
per layer, forward and backward); at 1.3B and micro-batch 4 the host spends ~10% of the step launching them
(docs/benchmarks.md). Captured once, the whole micro-batch is one `graph.replay()`.

    graphed = GraphedMicroBatch(params, fwd_bwd)     # fwd_bwd(batch) -> detached loss; runs forward + backward
    graphed.begin_step()                             # before each optimizer step's first micro-batch
    loss = graphed(batch)                            # the first call warms up and captures, every call replays

How the gradients stay right (two graphs, as the eager loop has two cases):
- a step's first micro-batch replays a graph captured with no gradient present: autograd's AccumulateGrad
  hands the backward's output tensors to the parameters, so a replay writes fresh gradients into them;
- the later micro-batches replay a second graph captured with those gradients present: AccumulateGrad then
  does `grad += new` in place, so replays accumulate exactly like the eager loop (captured on first need,
  sharing the first graph's memory pool);
- the optimizer's `zero_grad(set_to_none=True)` detaches the gradients after each step; begin_step()
  attaches the same tensors again, so the graphs always write where the optimizer reads;
- where the engine keeps the gradients in its own buffers for the run, zeroed in place after each step
  (`kept_grads`: the distributed optimizer, parallel/distopt.py), there is one graph, captured with those
  gradients present: every micro-batch's replay adds into them, the first included;
- the batch is copied into static tensors the graph reads (shapes must not change: the trainer's batches
  never do).
The warm-up forward/backward passes before the capture run the kernels' autotuning (a capture cannot time
configs) on a side stream, as torch's CUDA-graph notes ask; their gradients are discarded.

Host syncs: the model runs with `capture_safe` set (models/lm.py; the trainer sets it with train.cuda_graph),
so attention does not test each batch on the host for the single-document fast path (`is_causal`): it builds
the causal same-document mask and the in-document RoPE positions on the device for every batch, the path the
eager loop takes for batches with document resets. A captured graph replays that one path whatever the batch
holds; single-document batches go through the masked kernel too (its cost against the causal kernel is not
measured yet). Hybrid patterns (`M*M-`, configs/hybrid-1.3b.yaml) are therefore captured.

Tensor parallelism (`parallel.tp > 1`, with or without SP, over NCCL): the TP collectives of the forward and
backward (comm.py: all-reduce, all-gather, reduce-scatter called with async_op=False inside the autograd
Functions of layers.py / sp.py) are captured with the rest: NCCL >= 2.9.6 takes collectives into a graph,
and torch's ProcessGroupNCCL records a captured collective in the graph (async_op=False makes the current
stream wait for it, a stream dependency the capture records, never the host). Every replay is then a
collective launch over the TP group, so every TP rank captures and replays the same graphs in the same order
(they do: the same micro-batches per step, the same steps). What is done for it:
- the warm-up passes run the same collectives eagerly first, so the TP group's NCCL communicator exists
  before any capture (a capture must not create one); they run on the side stream, which ProcessGroupNCCL
  treats like any current stream;
- the capture uses `capture_error_mode="thread_local"` (`collectives=True`): the NCCL watchdog thread queries
  events of earlier, eager collectives while this thread captures, which the default "global" mode may
  turn into a failed capture (recent torch makes the watchdog's own queries thread-local; this covers the
  others);
- the watchdog does not see captured collectives (ProcessGroupNCCL leaves them out of its queue), so
  parallel.timeout_s cannot time out a stall inside a replay: the eager collectives the trainer issues
  after the replays (sync_tp_grads, the gradient norm's all-reduce) are the ones that time out and end the
  job (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, parallel/state.py);
- TORCH_NCCL_BLOCKING_WAIT is refused with TP (checks.py): it makes every collective wait on the host;
- release() resets the graphs; the process groups' teardown (parallel/state.py destroy) calls it first,
  because NCCL >= 2.26 waits in a communicator's destruction until no graph references it (a hang at exit
  otherwise).
Context parallelism (`parallel.cp > 1`) is captured the same way: its exchanges (the document boundaries, each
Mamba-2 layer's halo and states, attention's K/V, the loss's all-reduce, and their backward reduce-scatters) are
collectives on the CP communicator with async_op=False, and nothing in the CP forward reads a value on the host
(every boundary test is a torch.where on the device). TP's sum of the replicated components' partial gradients
(sync_tp_grads: SP norms, replicated B/C, K/V), CP's gradient sum and the data-parallel average (engine ddp:
bucketed all-reduces, or the distributed optimizer's reduce-scatters) run eagerly after the step's replays, like
clipping and the optimizer step. Activation checkpointing is captured too: the blocks draw no random numbers (the
checkpoint keeps no RNG state), and the recomputation is part of the captured backward. The TP graph tests ran on
4 x H100 (`pytest -m gpu -k tensor_parallelism`); the CP ones (`-k cp2`) were written without a multi-GPU machine;
on CPU the refusals are tested, and that the TP and CP forward + backward, collectives included, read no value on
the host (gloo). docs/parallelism.md has the caveats in full (TP x CP puts two communicators in one graph).

What cannot be captured is refused by the config check (trainer.check_supported): host syncs inside the
forward (COFFEE's DEER solver tests values on the host, and B'MOJO counts its memory groups on the host when
a batch has document resets); pipeline parallelism (the schedule runs the micro-batches' forward and backward
itself, with point-to-point sends between stages); DDP's backward hooks (data parallelism instead averages the
accumulated gradients after the replays with bucketed all-reduces) and FSDP2 / DeepSpeed at DP > 1, which hook
the backward; BPTT's carried state. A CUDA graph needs a CUDA device, so NCCL: the gloo backend never meets it
(the trainer refuses it should a process group of another backend hold TP or CP).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from megassm.models.registry import block_kinds
from megassm.parallel.state import release_before_destroy

log = logging.getLogger("megassm.training.cuda_graph")

__all__ = ["GraphedMicroBatch", "GRAPH_SAFE_LETTERS", "GRAPH_SAFE_WITHOUT_RESETS"]

# pattern letters whose forward and backward run no host sync and no collective (at tp = cp = 1, attention
# under the model's capture_safe): the block kinds declaring cuda_graph="yes" (models/registry.py)
GRAPH_SAFE_LETTERS = {k.letter: k.name for k in block_kinds() if k.cuda_graph == "yes"}
# and these only when batches carry no document resets (seq_idx None), as the synthetic runner's do: e.g.
# B'MOJO's number of memory groups is static without resets and read on the host with them (the trainer's
# packed batches always have them)
GRAPH_SAFE_WITHOUT_RESETS = {k.letter: f"{k.name} (without document resets)" for k in block_kinds()
                             if k.cuda_graph == "without_resets"}


class GraphedMicroBatch:
    def __init__(self, params: list[torch.nn.Parameter], fwd_bwd: Callable[[dict], torch.Tensor],
                 warmup: int = 2, collectives: bool = False, kept_grads: bool = False):
        """`collectives`: fwd_bwd runs NCCL collectives (tensor or context parallelism): the capture then takes
        capture_error_mode="thread_local", and release() runs before the process groups are destroyed.
        `kept_grads`: the gradients are the engine's, present (zero) before every step and zeroed in place after
        it: one accumulating graph for every micro-batch."""
        self.params = [p for p in params if p.requires_grad]
        self.fwd_bwd = fwd_bwd
        self.warmup = warmup
        self.collectives = collectives
        self.kept_grads = kept_grads
        if collectives:  # the graphs must go before the NCCL communicators they reference
            release_before_destroy(self)
        self.graph: torch.cuda.CUDAGraph | None = None  # a step's first micro-batch: writes the gradients
        self.acc_graph: torch.cuda.CUDAGraph | None = None  # the others: add into them
        self.static: dict[str, torch.Tensor] = {}
        self.loss = self.acc_loss = None
        self.grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self._first_of_step = True

    def _capturing(self, graph: torch.cuda.CUDAGraph, pool=None):
        if self.collectives:  # the NCCL watchdog thread's event queries must not invalidate the capture
            return torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")
        return torch.cuda.graph(graph, pool=pool)

    def release(self) -> None:
        """Drop the graphs (a later step's first micro-batch captures again). With collectives in them this
        must happen before the NCCL communicators are destroyed: NCCL >= 2.26 waits in the destruction until no
        graph references the communicator. The gradient tensors stay the parameters' until the optimizer
        detaches them."""
        for g in (self.graph, self.acc_graph if self.acc_graph is not self.graph else None):  # kept_grads: one
            if g is not None:
                g.reset()
        self.graph = self.acc_graph = None
        self.loss = self.acc_loss = None
        self.static = {}
        self.grads = []
        self._first_of_step = True

    def begin_step(self) -> None:
        """Start an optimizer step: the next micro-batch writes the gradients afresh. Attaches the graphs'
        gradient tensors to the parameters again (the optimizer's zero_grad(set_to_none=True) detached them)."""
        self._first_of_step = True
        for p, g in self.grads:
            p.grad = g

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.graph is None:
            self._capture(batch)
        self._load(batch)
        if self._first_of_step:
            self._first_of_step = False
            self.graph.replay()
            return self.loss
        if self.acc_graph is None:
            self._capture_accumulating()
        self.acc_graph.replay()
        return self.acc_loss

    def _load(self, batch: dict[str, torch.Tensor]) -> None:
        if batch.keys() != self.static.keys():
            raise RuntimeError(f"train.cuda_graph: the batch's fields {sorted(batch)} differ from the captured "
                               f"ones {sorted(self.static)}")
        for k, v in batch.items():
            s = self.static[k]
            if v.shape != s.shape or v.dtype != s.dtype:
                raise RuntimeError(f"train.cuda_graph: batch field '{k}' has shape {tuple(v.shape)} {v.dtype}, the "
                                   f"captured graph was built for {tuple(s.shape)} {s.dtype}")
            s.copy_(v, non_blocking=True)

    def _capture(self, batch: dict[str, torch.Tensor]) -> None:
        """Warm up (autotuning; with collectives, also the NCCL communicator's creation) on a side stream, then
        capture the first-micro-batch graph: with no gradient present, the captured backward hands its own
        output tensors to the parameters as their .grad, so each replay writes fresh gradients there (no
        zeroing, no add: the eager loop's first micro-batch). Every rank of a TP or CP group gets here at the same
        micro-batch, so the collectives pair up in the warm-up and in the capture."""
        if self.kept_grads:
            return self._capture_kept(batch)
        if any(p.grad is not None for p in self.params):
            raise RuntimeError("train.cuda_graph: gradients must be empty at the capture (a step's first micro-batch)")
        self._warm_up(batch)
        for p in self.params:
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up's cached activations: the graph's pool holds its own
        graph = torch.cuda.CUDAGraph()
        with self._capturing(graph):
            self.loss = self.fwd_bwd(self.static)
        self.graph = graph
        # a parameter the forward never reaches keeps no gradient, as in the eager loop
        self.grads = [(p, p.grad) for p in self.params if p.grad is not None]
        log.info("train.cuda_graph: forward + backward of one micro-batch captured (%d gradient tensors%s)",
                 len(self.grads), ", with its TP / CP collectives" if self.collectives else "")

    def _warm_up(self, batch: dict[str, torch.Tensor]) -> None:
        """The batch copied into the graph's static inputs, then the eager passes before a capture on a side stream
        (communicators and library handles created, the collectives' sizes run once)."""
        self.static = {k: v.clone() for k, v in batch.items()}
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # blocks cached by earlier eager steps: the side stream would not reuse them
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fwd_bwd(self.static)
        torch.cuda.current_stream().wait_stream(side)

    def _capture_kept(self, batch: dict[str, torch.Tensor]) -> None:
        """kept_grads: warm up as _capture does (its gradients, added into the engine's buffers, are zeroed after
        it), then capture one graph with the gradients present, so its backward adds into them in place; every
        micro-batch replays it (the engine zeroed them after the last step)."""
        grads = [(p, p.grad) for p in self.params]
        if any(g is None for _, g in grads):
            raise RuntimeError("train.cuda_graph: kept_grads, but a parameter has no gradient tensor at the capture")
        self._warm_up(batch)
        with torch.no_grad():
            torch._foreach_zero_([g for _, g in grads])
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        with self._capturing(graph):
            self.loss = self.fwd_bwd(self.static)
        if any(p.grad is not g for p, g in grads):
            raise RuntimeError("train.cuda_graph: the captured backward replaced a kept gradient tensor instead of "
                               "adding into it; the engine's buffers would not see the gradients")
        self.graph = self.acc_graph = graph
        self.acc_loss = self.loss
        self.grads = grads
        log.info("train.cuda_graph: forward + backward of one micro-batch captured, adding into the engine's "
                 "gradient buffers (%d gradient tensors%s)", len(grads),
                 ", with its TP / CP collectives" if self.collectives else "")

    def _capture_accumulating(self) -> None:
        """The graph of the step's later micro-batches: captured with the gradients present, so its backward adds
        into them in place. It shares the first graph's memory pool (they never run at the same time)."""
        graph = torch.cuda.CUDAGraph()
        with self._capturing(graph, pool=self.graph.pool()):
            self.acc_loss = self.fwd_bwd(self.static)
        for p, g in self.grads:
            if p.grad is not g:
                raise RuntimeError("train.cuda_graph: the captured backward replaced a gradient tensor instead of "
                                   "adding into it; gradients would not accumulate")
        self.acc_graph = graph
        log.info("train.cuda_graph: the accumulating micro-batch graph captured")

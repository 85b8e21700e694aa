"""Block kinds: one entry per pattern letter, declaring everything the rest of the system asks of a block.

    kind = block_kind("M")                 # the BlockKind of a letter (ValueError naming the known ones)
    for kind in block_kinds(): ...          # every registered kind, in registration order
    kind.mixer(cfg, n_layer)                # the mixer module

Each mixer file registers its kind at its end (`register(BlockKind(...))`), next to the module it builds, so
adding a block kind is one file (plus its kernel) and one line in `_BUILTIN` below; docs/architecture.md
"Adding a block kind" lists the fields. The readers:

    models/blocks.py      mixer, single_doc_hint, state
    config/checks.py      name, check, check_layout, cp / bptt (refused when None)
    training/flops.py     flop_keys, flops
    training/memory.py    activation_bytes
    training/cuda_graph   cuda_graph
    training/bptt.py      bptt
    parallel/tp.py        tp_layout (data: which parameter pieces shard how, see TPLayout)
    parallel/cp.py        cp (the name of the context-parallel treatment parallel/cp.py applies)
    parallel/fsdp2.py     fsdp_bf16_gather

The TP plan is declared here as data, and parallel/tp.py interprets it: a mixer knows which of its tensors
are concatenations of which components and how each component divides (the model-side knowledge), while the
collectives and the parallel module variants stay in parallel/ (imports flow models <- parallel, never back).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["BlockKind", "ActivationContext", "Split", "Replicate", "Cut", "TPLayout", "register", "block_kind",
           "block_kinds", "letters", "causal_pairs", "ssd_flops"]


# ----------------------------------------------------------------------------------------------------
# tensor-parallel layout, as data
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """A component cut into tp equal slices: rank q holds slice q."""

    size: int  # canonical size along the Cut's dim


@dataclass(frozen=True)
class Replicate:
    """A component cut into `groups` slices, each held whole by tp // groups consecutive ranks (groups=1:
    every rank holds all of it). `partial`: the replicas hold partial gradients, summed by the TP plan."""

    size: int
    groups: int = 1
    partial: bool = True


@dataclass(frozen=True)
class Cut:
    """One parameter's layout: along `dim` the canonical tensor is the concatenation of `pieces`."""

    dim: int
    pieces: tuple


@dataclass
class TPLayout:
    """What tensor parallelism does to one mixer (names relative to the mixer, dotted for submodules):

    params          parameter -> Cut (every parameter of the mixer must be named)
    sizes           attribute -> its per-rank value (the local sizes the forward reads)
    row_parallel    Linear submodule -> sp: its output is reduced over the TP group (reduce-scattered along
                    the sequence when sp); the layer's one collective
    replicated_row  Linear submodules whose (small) output every rank needs whole: all-reduced forward and
                    backward, whatever SP says
    variants        submodule ("" = the mixer) -> (variant name, its arguments): a parallel-layer subclass
                    parallel/tp.py substitutes for it (e.g. a norm whose statistics span ranks)
    entry           the column-parallel Linear that is the only reader of the mixer's input, if there is one:
                    with parallel.tp_overlap it enters the TP region itself (no region hook on the mixer) and
                    overlaps the region's backward collective with its weight gradient
    fan_out         or: the variant (name, arguments) that, with parallel.tp_overlap, computes the mixer's
                    column projections (several Linears, the only readers of its input) in one such node
    aligned_out     column-parallel Linears whose readers take strided rows: where their rank-local width is
                    not a multiple of 8 features, their output rows are padded in memory (parallel/layers.py
                    AlignedLinear: Hopper's matmul kernels need 16-byte-aligned rows)
    """

    params: dict = field(default_factory=dict)
    sizes: dict = field(default_factory=dict)
    row_parallel: dict = field(default_factory=dict)
    replicated_row: tuple = ()
    variants: dict = field(default_factory=dict)
    entry: str | None = None
    fan_out: tuple | None = None
    aligned_out: tuple = ()

    def merge(self, other: "TPLayout", prefix: str) -> "TPLayout":
        """Add a submodule's layout (names under `prefix`, e.g. "ssm."); not its `entry` / `fan_out`, which
        read the submodule's input, not the mixer's."""
        self.params.update({prefix + k: v for k, v in other.params.items()})
        self.sizes.update({prefix + k: v for k, v in other.sizes.items()})
        self.row_parallel.update({prefix + k: v for k, v in other.row_parallel.items()})
        self.replicated_row += tuple(prefix + k for k in other.replicated_row)
        self.variants.update({(prefix + k).rstrip("."): v for k, v in other.variants.items()})
        return self


# ----------------------------------------------------------------------------------------------------
# the entry
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActivationContext:
    """What the memory estimate tells a kind's `activation_bytes` about the layout."""

    cfg: Any  # the ModelConfig
    sp_tp: int = 1  # ranks the residual stream's sequence is split over (SP), 1 without
    cp: int = 1
    seq_len: int = 0
    doc_mask: bool = True  # batches pack several documents per row


@dataclass(frozen=True)
class BlockKind:
    """One block kind. Callables take the ModelConfig (`m`) or the full Config (`cfg`) as named."""

    letter: str  # the pattern letter
    name: str  # for messages ("Mamba-2")
    mixer: Callable  # (ModelConfig, n_layer) -> nn.Module; stateful mixers set `stateful = True`
    sections: tuple = ()  # the model config sections it reads (model.<section>.*)
    state: type | None = None  # its recurrent state class (models/state.py); None: stateless
    # config: check(cfg, need) with the pattern checks; check_layout(cfg, need) with the layout checks after
    # the batch / sequence divisibility ones (need(cond, message) raises ConfigError)
    check: Callable | None = None
    check_layout: Callable | None = None
    # FLOPs of one layer over one sequence of L tokens: flops(m, L) -> {key: int}, keys from flop_keys
    flop_keys: tuple = ()
    flops: Callable | None = None
    # bytes per token saved for the backward: activation_bytes(mixer, a, ActivationContext) -> (local,
    # stream): `local` the mixer's own tensors (already its TP shard), `stream` extra residual-stream-sized ones
    activation_bytes: Callable | None = None
    tp_layout: Callable | None = None  # (mixer, ranks, sp) -> TPLayout over `ranks` TP ranks; None: no TP plan
    cp: str | None = None  # parallel/cp.py treatment ("local": position-wise, nothing to exchange); None: refused
    bptt: Callable | None = None  # (mixer) -> what the BPTT carrier keeps ("mamba", "window", None); None: refused
    # "yes" (no host sync and no collective in its forward and backward at tp = cp = 1, under the model's
    # capture_safe), "without_resets" (only when batches have no document resets), "no"
    cuda_graph: str = "no"
    sp: bool = True  # runs under sequence parallelism (its TP layout's entry gathers the sequence)
    fsdp_bf16_gather: bool = False  # its matmul weights are read by F.linear only (FSDP2 may gather them in bf16)
    single_doc_hint: bool = False  # its forward takes the batch's single-document hint (attention)


_KINDS: dict[str, BlockKind] = {}

# the mixer modules that register the built-in kinds, in the order the letters are listed in messages
_BUILTIN = ("mamba2", "attention", "mlp", "coffee", "bmojo", "mamba1", "longhorn")
_BUILTIN_LETTERS = "M*-CBSL"  # their letters, in that order (whichever module is imported first)
_loaded = False


def register(kind: BlockKind) -> BlockKind:
    """Add a block kind (a mixer file calls this at import). The letter must be new and not `|`."""
    if len(kind.letter) != 1 or kind.letter == "|":
        raise ValueError(f"block kind letter must be one character other than '|', got {kind.letter!r}")
    old = _KINDS.get(kind.letter)
    if old is not None and old is not kind and old.mixer is not kind.mixer:
        raise ValueError(f"block kind letter {kind.letter!r} is already registered ({old.name})")
    _KINDS[kind.letter] = kind
    return kind


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in _BUILTIN:
            importlib.import_module(f"megassm.models.{mod}")


def block_kinds() -> list[BlockKind]:
    """Every registered kind: the built-in ones in `_BUILTIN` order, then the others as registered."""
    _load()
    builtin = [_KINDS[c] for c in _BUILTIN_LETTERS if c in _KINDS]
    return builtin + [k for c, k in _KINDS.items() if c not in _BUILTIN_LETTERS]


def letters() -> dict[str, str]:
    """{letter: name} of every registered kind."""
    return {k.letter: k.name for k in block_kinds()}


def block_kind(letter: str) -> BlockKind:
    _load()
    kind = _KINDS.get(letter)
    if kind is None:
        raise ValueError(f"unknown block letter {letter!r} (known: {', '.join(_KINDS)})")
    return kind


# ----------------------------------------------------------------------------------------------------
# FLOP terms shared by several kinds (docs/flops.md)
# ----------------------------------------------------------------------------------------------------
def causal_pairs(length: int, window: int = 0) -> int:
    """Number of (query, key) pairs with key <= query over `length` positions; with a sliding window W > 0
    each query sees at most its W most recent keys (itself included): sum over t = 1..L of min(t, W)."""
    if length <= 0:
        return 0
    if window <= 0 or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def ssd_flops(seq_len: int, chunk_size: int, nheads: int, headdim: int, ngroups: int, d_state: int) -> dict:
    """Forward FLOPs of one chunked SSD call over one sequence of `seq_len` tokens (chunk size Q, H heads
    of dim P, G groups of B/C, state size N). The last chunk may be partial.

    scores         C_t . B_s within a chunk, per group, for s <= t:        2 N G * pairs
    intra          (scores * decay) @ x within a chunk, per head:          2 P H * pairs
    chunk_state    sum_s decay_s B_s x_s^T at the end of each chunk:       2 P N H * L
    state_passing  h_c = exp(sum dA over chunk c) h_(c-1) + state_c:       2 P N H * n_chunks
    state_output   C_t . h_(c-1) (times the decay up to t), per head:      2 P N H * L
    with pairs = sum over chunks of q(q+1)/2 (q = that chunk's length).
    """
    L, Q, H, P, G, N = seq_len, chunk_size, nheads, headdim, ngroups, d_state
    n_full, rem = divmod(L, Q)
    n_chunks = n_full + (1 if rem else 0)
    pairs = n_full * causal_pairs(Q) + causal_pairs(rem)
    return {
        "scores": 2 * N * G * pairs,
        "intra": 2 * P * H * pairs,
        "chunk_state": 2 * P * N * H * L,
        "state_passing": 2 * P * N * H * n_chunks,
        "state_output": 2 * P * N * H * L,
    }

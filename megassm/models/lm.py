"""The language model: embedding -> blocks from the pattern -> final norm -> LM head.

    model = build_model(cfg.model, vocab_size=V, device=None)   # device may be "meta"
    model.init_weights(seed)                                     # canonical: a function of the seed only
    out = model(tokens, seq_idx=None, labels=None, states=None, return_states=False)
    out.loss, out.logits, out.states
    logits, states = model.step(tokens, states, reset=None)     # decode one token

Precision policy: parameters are fp32 master weights (the trainer runs the forward under bf16 autocast);
the residual stream is fp32 in every block (fused add + norm), recurrent states are fp32, and the SSD,
conv and norm kernels compute in fp32 internally. A_log, dt_bias, D and the norm weights are created fp32
and are never decayed. Casting the whole model with `.to(torch.bfloat16)` is not a supported training
mode (it would cast those too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megassm import kernels
from megassm.config import PATTERN_SEPARATORS, ModelConfig, blocks_of

from .attention import single_document
from .blocks import Block
from .init import InitRule, canonical_init, make_linear, rule_of
from .norm import RMSNorm
from .registry import block_kind
from .state import reset_states

__all__ = ["LanguageModel", "LMOutput", "Layers", "build_model", "padded_vocab_size"]

IGNORE_INDEX = -100


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


def _stages(pattern: str) -> list[list[int]]:
    """Block indices of each pipeline stage, cut at `|`."""
    stages, cur, i = [], [], 0
    for c in pattern:
        if c in PATTERN_SEPARATORS:
            stages.append(cur)
            cur = []
        else:
            cur.append(i)
            i += 1
    stages.append(cur)
    return stages


class Layers(nn.ModuleDict):
    """The blocks, keyed by their global index: "0", "1", ... give the parameter names of an nn.ModuleList
    ("layers.7.mixer..."), and a pipeline stage can drop the blocks it does not hold while the others keep
    their names (parallel/pp.py). Used like a list: `layers[i]` is block i (a global index), iteration yields
    the held blocks in order, `keys()` / `items()` give global indices as ints."""

    def __getitem__(self, i) -> nn.Module:
        return self._modules[str(i)]

    def __setitem__(self, i, module: nn.Module) -> None:
        self.add_module(str(i), module)

    def __delitem__(self, i) -> None:
        del self._modules[str(i)]

    def __contains__(self, i) -> bool:
        return str(i) in self._modules

    def __iter__(self):
        return iter(self._modules.values())

    def keys(self) -> list[int]:
        return [int(k) for k in self._modules]

    def items(self) -> list[tuple[int, nn.Module]]:
        return [(int(k), m) for k, m in self._modules.items()]


@dataclass
class LMOutput:
    loss: torch.Tensor | None = None  # fp32 scalar: mean cross-entropy over labels != -100
    logits: torch.Tensor | None = None  # [B, L, vocab_size_padded], only when no labels were given
    states: list | None = None  # per block (None for MLP blocks), after the last token


class LanguageModel(nn.Module):
    # Extension points, None for the single-device computation; plans applied from outside set them:
    #   head_override   computes the head and the loss terms in place of the model's own: .head(model, h) ->
    #                   logits, .loss_terms(logits, labels) -> (sum, count), .sp_ways (ranks the final hidden's
    #                   sequence is split over). parallel/tp.py sets a vocabulary-sharded head.
    #   loss_reduction  (sum, count) -> the loss, in place of sum / count. parallel/cp.py sets the mean over the
    #                   tokens of every context-parallel rank.
    # What a plan needs per forward it computes in a forward pre-hook on the model and keeps itself
    # (parallel/cp.py: every rank's document boundaries, found by the seq_idx the hook hands on): the blocks
    # and mixers take only the arguments of the single-device computation.
    head_override = None
    loss_reduction = None
    # capture_safe: the forward reads no tensor value on the host, as a CUDA graph capture needs
    # (training/cuda_graph.py; the trainer sets it under train.cuda_graph). Attention then never tests a batch
    # for the single-document fast path (`single_document`, a device -> host sync): with seq_idx it always
    # builds the causal same-document mask and the in-document positions on the device (the same mask the
    # eager path takes for batches with document resets), without seq_idx it is the causal kernel as always.
    capture_safe = False

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.config = cfg
        self.pattern = cfg.pattern
        self.block_kinds = blocks_of(cfg.pattern)
        if not self.block_kinds:
            raise ValueError(f"model.pattern '{cfg.pattern}' has no blocks")
        self.n_layers = len(self.block_kinds)
        self.stages = _stages(cfg.pattern)
        self.vocab_size = vocab_size
        self.vocab_size_padded = padded_vocab_size(vocab_size, cfg.pad_vocab_multiple)
        self.tie_embeddings = cfg.tie_embeddings

        self.embedding = nn.Embedding(self.vocab_size_padded, cfg.d_model)
        self.embedding.init_rules = {"weight": InitRule("normal", std=cfg.init_std)}
        self.layers = Layers(enumerate(Block(k, cfg, self.n_layers) for k in self.block_kinds))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = (
            None if cfg.tie_embeddings else make_linear(cfg.d_model, self.vocab_size_padded, False, cfg.init_std)
        )
        # a block that takes the single-document hint (attention) skips its document mask when a batch has one
        self._attn_doc_mask = any(block_kind(k).single_doc_hint for k in self.block_kinds) and cfg.attn.doc_mask

    # ------------------------------------------------------------------------------------------------
    # parameters
    def init_weights(self, seed: int) -> None:
        """Canonical init (see init.py): identical weights for a seed at any device, dtype or layout."""
        canonical_init(self, seed)

    def num_parameters(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once
        if non_embedding:
            n -= self.embedding.weight.numel()
            if self.lm_head is not None:
                n -= self.lm_head.weight.numel()
        return n

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: matrices (projections, conv weights, embeddings, head) decay; biases, norm weights,
        A_log, dt_bias and D do not."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if rule_of(self, name).no_wd else decay).append(p)
        groups = [{"params": decay, "weight_decay": weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        return groups

    def no_weight_decay_names(self) -> set[str]:
        return {name for name, _ in self.named_parameters() if rule_of(self, name).no_wd}

    # ------------------------------------------------------------------------------------------------
    # states
    def allocate_states(self, batch_size: int, device=None) -> list:
        """Zero states, one entry per block (None for MLP blocks)."""
        if device is None:
            device = self.embedding.weight.device
        return [layer.allocate_state(batch_size, device=device) for layer in self.layers]

    @staticmethod
    def reset_states(states: list, reset: torch.Tensor | None) -> list:
        """Clear the rows where reset [B] is True (those rows start a new document)."""
        return reset_states(states, reset)

    # ------------------------------------------------------------------------------------------------
    def _check_whole(self) -> None:
        if getattr(self, "pp_plan", None) is not None:
            raise RuntimeError("this model holds pipeline stages only (megassm.parallel.pp.split_model): run it "
                               "through megassm.parallel.pp.train_step / eval_losses")

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        if self.head_override is not None:
            return self.head_override.head(self, h)
        if self.lm_head is None:
            return F.linear(h, self.embedding.weight)
        return self.lm_head(h)

    def forward(
        self,
        tokens: torch.Tensor,
        seq_idx: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        states: list | None = None,
        return_states: bool = False,
    ) -> LMOutput:
        """tokens [B, L] int64; seq_idx [B, L] document ids (nondecreasing per row; no state crosses a
        change); labels [B, L] (-100 = ignored); states: per-block initial states, applied to the first
        document of each row (zero a row's state first if that row starts a new document)."""
        self._check_whole()
        if states is not None and len(states) != self.n_layers:
            raise ValueError(f"states has {len(states)} entries, the model has {self.n_layers} blocks")
        if seq_idx is not None and seq_idx.shape != tokens.shape:
            raise ValueError(f"seq_idx {tuple(seq_idx.shape)} must match tokens {tuple(tokens.shape)}")
        hidden, residual, new_states = self.forward_blocks(self.embedding(tokens), None, seq_idx=seq_idx, states=states,
                                                           return_states=return_states)
        normed, _ = self.norm_f.add_forward(hidden, residual)
        if labels is None:
            return LMOutput(loss=None, logits=self._head(normed), states=new_states)
        return LMOutput(loss=self.head_loss(normed, labels), logits=None, states=new_states)

    def forward_blocks(self, hidden: torch.Tensor, residual: torch.Tensor | None, seq_idx: torch.Tensor | None = None,
                       blocks: list[int] | None = None, states: list | None = None,
                       return_states: bool = False) -> tuple[torch.Tensor, torch.Tensor, list | None]:
        """The block pair (hidden, fp32 residual) through `blocks` (global indices, in order; default: every
        block held), as the model's forward and a pipeline stage (parallel/pp.py) run them. `states`: one
        initial state per block of `blocks`; returns (hidden, residual, their final states or None)."""
        blocks = self.layers.keys() if blocks is None else blocks
        if seq_idx is not None and seq_idx.dtype != torch.int32:
            seq_idx = seq_idx.to(torch.int32)
        # the hint costs a host sync: only when a block here takes it, and never under capture_safe, where
        # False sends attention down its document-mask path without looking at seq_idx on the host
        hint = self._attn_doc_mask and seq_idx is not None and any(
            block_kind(self.layers[b].kind).single_doc_hint for b in blocks)
        single_doc = None
        if hint:
            single_doc = False if self.capture_safe else single_document(seq_idx)
        new_states = [] if return_states else None
        for i, b in enumerate(blocks):
            hidden, residual, st = self.layers[b](
                hidden,
                residual,
                seq_idx=seq_idx,
                state=None if states is None else states[i],
                return_state=return_states,
                single_doc=single_doc,
            )
            if return_states:
                new_states.append(st)
        return hidden, residual, new_states

    # ------------------------------------------------------------------------------------------------
    # loss: loss_terms (sum, count) -> finish_loss (the mean, or loss_reduction's); head_loss chunks
    loss_chunk_tokens = 0  # > 0: head + loss over chunks of about this many tokens (train.loss_chunk_tokens)

    def loss_terms(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the fp32 cross-entropy over labels != -100, their count); no host sync."""
        if self.head_override is not None:
            return self.head_override.loss_terms(logits, labels)
        flat = labels.reshape(-1)
        # per-row fp32 losses summed; the Triton path reads the logits without an fp32 copy (kernels/loss/triton_ce.py)
        total = kernels.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat, IGNORE_INDEX).sum()
        return total, (flat != IGNORE_INDEX).sum()

    def finish_loss(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """Mean over the labelled tokens (0 when every label is ignored), or the `loss_reduction` set."""
        if self.loss_reduction is not None:
            return self.loss_reduction(total, count)
        return total / count.clamp(min=1)

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over labels != -100 in fp32 (0 when every label is ignored); no host sync."""
        return self.finish_loss(*self.loss_terms(logits, labels))

    def _sp_ways(self) -> int:
        """Ranks the final hidden's sequence is split over (sequence parallelism), 1 without it."""
        return 1 if self.head_override is None else self.head_override.sp_ways

    def head_loss(self, normed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The head and the loss of the final-norm output. With `loss_chunk_tokens` > 0 the tokens go
        through the head in chunks along the sequence, each under activation checkpointing: only one
        chunk's logits (and their gradient) exist at a time, for one extra head matmul in the backward.
        [B, L, vocab] bf16 logits and their gradient are 26 GB at 128K tokens x 50K vocab (docs/config.md)."""
        chunk = self.loss_chunk_tokens
        B, L = normed.shape[:2]
        if chunk <= 0 or B * L <= chunk:
            return self.loss_fn(self._head(normed), labels)
        step = max(1, chunk // B)
        sp = self._sp_ways()
        # under SP rank r holds the r-th 1/sp of the B * sp * L tokens as B rows of L (parallel/sp.py), and the head
        # all-gathers columns c0:c1 of those rows rank after rank: the same columns of the tokens' rows of L, in order
        lab = labels.reshape(B * sp, L)
        total = normed.new_zeros((), dtype=torch.float32)
        for c0, h in zip(range(0, L, step), torch.split(normed, step, dim=1)):
            lc = lab[:, c0:c0 + h.shape[1]].reshape(B, -1)
            total = total + checkpoint(self._chunk_loss_sum, h, lc, use_reentrant=False)
        return self.finish_loss(total, (labels.reshape(-1) != IGNORE_INDEX).sum())

    def _chunk_loss_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_terms(self._head(h), labels)[0]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, states: list, reset: torch.Tensor | None = None):
        """Decode one token per row (no autograd). tokens [B]; reset [B] bool: this token starts a new
        document (that row's states are cleared first). Returns (logits [B, vocab_size_padded], new states);
        the states passed in are not modified. Padded vocabulary entries are not masked: sample from
        logits[:, :model.vocab_size]."""
        self._check_whole()
        if len(states) != self.n_layers:
            raise ValueError(f"states has {len(states)} entries, the model has {self.n_layers} blocks")
        if reset is not None:
            states = reset_states(states, reset)
        hidden = self.embedding(tokens)
        residual = None
        new_states = []
        for layer, st in zip(self.layers, states):
            hidden, residual, st = layer.step(hidden, residual, st)
            new_states.append(st)
        normed, _ = self.norm_f.add_forward(hidden, residual)
        return self._head(normed), new_states


def build_model(model_cfg: ModelConfig, vocab_size: int | None = None, device=None) -> LanguageModel:
    """Build the model of `model_cfg`. `vocab_size` is the tokenizer's (unpadded) vocabulary, used when
    model_cfg.vocab_size is None; model_cfg.vocab_size wins when set but must not be smaller. The
    embedding is padded to a multiple of model_cfg.pad_vocab_multiple. Parameters are created on `device`
    ("meta" builds a shape-only model: materialize with .to_empty(device=...), then init_weights(seed)).
    Weights are not canonical until init_weights(seed) is called."""
    cfg_v = model_cfg.vocab_size
    if cfg_v is None and vocab_size is None:
        raise ValueError("build_model: no vocabulary size: set model.vocab_size or pass vocab_size=")
    if cfg_v is not None and vocab_size is not None and vocab_size > cfg_v:
        raise ValueError(
            f"build_model: the tokenizer's vocabulary ({vocab_size}) is larger than model.vocab_size ({cfg_v}); "
            "token ids would fall outside the embedding"
        )
    v = cfg_v if cfg_v is not None else vocab_size
    if v <= 0:
        raise ValueError(f"build_model: vocabulary size must be positive, got {v}")
    if device is None:
        return LanguageModel(model_cfg, v)
    with torch.device(device):
        return LanguageModel(model_cfg, v)

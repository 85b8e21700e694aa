"""Text generation with the recurrent decode step.

    gen = generate(model, [prompt_ids, ...], max_new_tokens=64, temperature=0.8, top_k=50, top_p=0.95, seed=0)
    gen.tokens[i]   # the new token ids of prompt i (EOS and stop text included when they ended it)

Each prompt is consumed by the parallel (chunked) forward, which returns every block's final recurrent state
(Mamba conv + SSM states, attention KV caches, ...); prompts of one length share a forward. The states of all
prompts are then stacked into one batch (models/state.py cat_states: shorter attention caches are padded
with masked columns) and the batch decodes one token per step through `LanguageModel.step`. Finished rows
leave the batch, so a long completion never waits on short ones.

temperature 0 is greedy (argmax); otherwise logits / temperature, then top-k, then top-p (nucleus), sampled
from a torch.Generator seeded with `seed`, so a seed reproduces its output on the same device. Only the real
vocabulary is sampled (the padded embedding rows are never chosen).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch

from megassm.config import block_letters
from megassm.models.state import cat_states, select_states

__all__ = ["check_decodable", "prefill", "next_token", "filter_logits", "generate", "Generation"]


def check_decodable(model) -> None:
    """Raise ValueError naming the blocks whose mixer cannot decode token by token (no step /
    allocate_state), or whose forward cannot return its final state (needed to consume the prompt)."""
    bad = []
    for i, layer in model.layers.items():
        if not layer.has_state:
            continue
        mixer = layer.mixer
        missing = [m for m in ("step", "allocate_state") if not callable(getattr(mixer, m, None))]
        if "return_state" not in inspect.signature(mixer.forward).parameters:
            missing.append("forward(return_state=True)")
        if missing:
            bad.append(f"block {i} `{layer.kind}` ({block_letters().get(layer.kind, type(mixer).__name__)}): "
                       f"no {', '.join(missing)}")
    if bad:
        raise ValueError("this model cannot generate with the recurrent decode step: " + "; ".join(bad))


@torch.no_grad()
def prefill(model, tokens: torch.Tensor, autocast=contextlib.nullcontext) -> tuple[torch.Tensor, list]:
    """Consume prompts of one length, tokens [B, L] (L >= 1), by the parallel forward. Returns (logits of
    the last position [B, vocab_size_padded] fp32, every block's state after it)."""
    with autocast():
        out = model(tokens, return_states=True)
    return out.logits[:, -1].float(), out.states


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits [B, V] with everything outside the top-k and outside the nucleus (the smallest set of most
    likely tokens whose probability reaches top_p; the most likely token always stays) set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability mass of the more likely tokens
        drop_sorted = before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(logits: torch.Tensor, vocab_size: int, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token [B] from logits [B, >= vocab_size]: greedy at temperature 0, else sampled."""
    logits = logits[:, :vocab_size].float()
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt
    stopped: list[str] = field(default_factory=list)  # per prompt: "eos", "stop" (the stop callback) or "length"


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, eos_id: int | None = None,
             stop: Callable[[int, list[int]], bool] | None = None, autocast=contextlib.nullcontext,
             batch_size: int = 0) -> Generation:
    """Continue each prompt (a non-empty list of token ids) by up to `max_new_tokens` tokens. A row ends at
    `eos_id` (kept in its output) or when `stop(prompt_index, new_tokens)` returns True. `batch_size` > 0
    decodes at most that many prompts at a time (0: all at once)."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_new_tokens < 0:
        raise ValueError(f"generate: need temperature >= 0, 0 < top_p <= 1, top_k >= 0, max_new_tokens >= 0; got "
                         f"temperature={temperature}, top_p={top_p}, top_k={top_k}, max_new_tokens={max_new_tokens}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: a prompt has no tokens (an empty prompt needs a start token, e.g. the EOS)")
    check_decodable(model)
    dev = next(model.parameters()).device
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=dev)
        gen.manual_seed(int(seed) if seed is not None else int(torch.seed()))
    out = Generation(tokens=[[] for _ in prompts], stopped=["length"] * len(prompts))
    step = batch_size if batch_size > 0 else max(1, len(prompts))
    for lo in range(0, len(prompts), step):
        _generate_batch(model, prompts, list(range(lo, min(lo + step, len(prompts)))), out, max_new_tokens,
                        (temperature, top_k, top_p, gen), eos_id, stop, autocast, dev)
    return out


def _generate_batch(model, prompts, rows, out, max_new, sampling, eos_id, stop, autocast, dev) -> None:
    if max_new == 0:
        return
    temperature, top_k, top_p, gen = sampling
    # prefill: one forward per prompt length, then the rows' states in `rows` order
    by_len: dict[int, list[int]] = {}
    for r in rows:
        by_len.setdefault(len(prompts[r]), []).append(r)
    logits_of, states_of = {}, {}
    for n, group in by_len.items():
        toks = torch.tensor([prompts[r] for r in group], dtype=torch.long, device=dev)
        logits, states = prefill(model, toks, autocast)
        for j, r in enumerate(group):
            logits_of[r] = logits[j : j + 1]
            states_of[r] = select_states(states, torch.tensor([j], device=dev))
    logits = torch.cat([logits_of[r] for r in rows])
    states = cat_states([states_of[r] for r in rows])
    active = list(rows)  # prompt index of each batch row
    for t in range(max_new):
        tok = next_token(logits, model.vocab_size, temperature, top_k, top_p, gen)
        keep = []
        for j, (r, v) in enumerate(zip(active, tok.tolist())):
            out.tokens[r].append(v)
            if eos_id is not None and v == eos_id:
                out.stopped[r] = "eos"
            elif stop is not None and stop(r, out.tokens[r]):
                out.stopped[r] = "stop"
            else:
                keep.append(j)
        if not keep or t == max_new - 1:
            return
        if len(keep) < len(active):
            idx = torch.tensor(keep, device=dev)
            states, tok = select_states(states, idx), tok.index_select(0, idx)
            active = [active[j] for j in keep]
        with autocast():
            logits, states = model.step(tok, states)
        logits = logits.float()

"""lm-evaluation-harness on a megassm checkpoint, through its Python API (no Hugging Face model needed).

    results = run_harness(trained, tasks=["hellaswag"], limit=100, batch_size=8, num_fewshot=0)

`MegassmLM` implements the harness's three request types on our model:
  loglikelihood          one full forward over context + continuation per request (rows of a batch are
                         right-padded: the model is causal, so padding after a row's tokens cannot change
                         them); the continuation's summed log-probability and whether greedy decoding
                         would produce it;
  loglikelihood_rolling  the whole document after one EOS prefix token, fed in chunks of `chunk` tokens with
                         the recurrent states carried from chunk to chunk (exact: no window restarts);
  generate_until         the recurrent decode step (generation.py), stopping at the stop strings, EOS or
                         max_gen_toks.
Text is tokenized by the run's tokenizer; as the harness's own models do, spaces ending a context are moved to
the start of its continuation, and an empty context becomes the EOS token.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.model import LM
except ImportError as e:  # megassm-eval harness reports this with the install command
    raise ImportError("megassm-eval harness needs lm-evaluation-harness: pip install lm_eval (in megassm's dev "
                      "extra)") from e

from .generation import generate

log = logging.getLogger("megassm.eval")

__all__ = ["MegassmLM", "run_harness"]


class MegassmLM(LM):
    def __init__(self, trained, batch_size: int = 8, max_length: int | None = None, chunk: int | None = None,
                 max_gen_toks: int = 256):
        """`trained`: loading.TrainedModel. `max_length`: contexts longer than this are cut on the left
        (None: never; a recurrent model has no context limit). `chunk`: tokens per forward of a rolling
        loglikelihood (default train.seq_len)."""
        super().__init__()
        self.tm = trained
        self.model = trained.model
        self.tok = trained.tokenizer
        self.batch_size = max(1, int(batch_size))
        self.max_length = max_length
        self.chunk = int(chunk or trained.cfg.train.seq_len)
        self.max_gen_toks = max_gen_toks
        self.vocab = self.model.vocab_size
        self._device = trained.device

    # --- tokens ------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        if self.tok.eos_id is None:
            raise ValueError(f"tokenizer {self.tok.name} has no end-of-text token: empty contexts and rolling "
                             "loglikelihoods need one")
        return self.tok.eos_id

    def _context(self, text: str) -> list[int]:
        ids = self.tok.encode(text) if text else [self.eot_token_id]
        if self.max_length is not None and len(ids) > self.max_length:
            ids = ids[-self.max_length:]
        return ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        if not context:
            return [self.eot_token_id], self.tok.encode(continuation)
        whole = self.tok.encode(context + continuation)
        ctx = self.tok.encode(context)
        return ctx, whole[len(ctx):]

    # --- scoring -----------------------------------------------------------------------------------
    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(summed log-probability of each continuation, is it the greedy continuation) by full forwards."""
        out: list = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        for lo in range(0, len(order), self.batch_size):
            idx = order[lo : lo + self.batch_size]
            seqs = []
            for i in idx:
                ctx, cont = pairs[i]
                if not cont:
                    raise ValueError("loglikelihood: the continuation has no tokens")
                seq = (ctx + cont)[:-1]
                if self.max_length is not None and len(seq) > self.max_length:
                    seq = seq[-self.max_length:]
                seqs.append(seq)
            T = max(len(s) for s in seqs)
            toks = torch.zeros(len(seqs), T, dtype=torch.long)
            for b, s in enumerate(seqs):
                toks[b, : len(s)] = torch.tensor(s)
            with self.tm.autocast():
                logits = self.model(toks.to(self._device)).logits
            logp = F.log_softmax(logits[..., : self.vocab].float(), dim=-1)
            for b, i in enumerate(idx):
                cont = pairs[i][1]
                n = len(seqs[b])
                lp = logp[b, n - len(cont) : n]
                target = torch.tensor(cont, device=lp.device)
                out[i] = (float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*r.args) for r in requests]
        res = self._score(pairs)
        for r, v in zip(requests, res):
            self.cache_hook.add_partial("loglikelihood", r.args, v)
        return res

    @torch.no_grad()
    def _rolling(self, ids: list[int]) -> float:
        seq = [self.eot_token_id] + ids
        total, states = 0.0, None
        for lo in range(0, len(seq) - 1, self.chunk):
            inp = torch.tensor(seq[lo : lo + self.chunk], device=self._device)[None]
            tgt = torch.tensor(seq[lo + 1 : lo + 1 + self.chunk], device=self._device)
            with self.tm.autocast():
                out = self.model(inp[:, : len(tgt)], states=states, return_states=True)
            states = out.states
            lp = F.log_softmax(out.logits[0, :, : self.vocab].float(), dim=-1)
            total += float(lp.gather(-1, tgt[:, None]).sum())
        return total

    def loglikelihood_rolling(self, requests) -> list[float]:
        res = []
        for r in requests:
            (text,) = r.args[:1]
            v = self._rolling(self.tok.encode(text)) if text else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), v)
            res.append(v)
        return res

    # --- generation --------------------------------------------------------------------------------
    def generate_until(self, requests) -> list[str]:
        res: list = [None] * len(requests)
        groups: dict = {}  # requests with the same generation settings decode together
        for i, r in enumerate(requests):
            context, kwargs = r.args
            groups.setdefault(repr(sorted((kwargs or {}).items())), []).append(i)
        for idxs in groups.values():
            kwargs = dict(requests[idxs[0]].args[1] or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 1.0 if sample else 0.0)) if sample else 0.0
            top_k = int(kwargs.pop("top_k", 0) or 0)
            top_p = float(kwargs.pop("top_p", 1.0) or 1.0)
            seed = kwargs.pop("seed", 0)
            if kwargs:
                log.warning("generate_until: generation settings %s are not used", sorted(kwargs))
            prompts = [self._context(requests[i].args[0]) for i in idxs]

            def stop(j: int, new: list[int]) -> bool:
                text = self.tok.decode(new)
                return any(s and s in text for s in until)

            gen = generate(self.model, prompts, max_new, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=seed, eos_id=self.tok.eos_id, stop=stop if until else None,
                           autocast=self.tm.autocast, batch_size=self.batch_size)
            for i, new, why in zip(idxs, gen.tokens, gen.stopped):
                text = self.tok.decode(new[:-1] if why == "eos" else new)
                for s in until:  # the text before the first stop string
                    if s:
                        text = text.split(s, 1)[0]
                res[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return res


def run_harness(trained, tasks: list[str], limit: int | float | None = None, batch_size: int = 8,
                num_fewshot: int | None = None, include_path: str | None = None, include_defaults: bool = True,
                max_length: int | None = None, seed: int = 0, log_samples: bool = False,
                bootstrap_iters: int = 100000) -> dict:
    """lm_eval.simple_evaluate on `trained` (loading.TrainedModel); returns the harness's results dict."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    lm = MegassmLM(trained, batch_size=batch_size, max_length=max_length)
    manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    return simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                           task_manager=manager, log_samples=log_samples, random_seed=seed,
                           numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                           bootstrap_iters=bootstrap_iters)

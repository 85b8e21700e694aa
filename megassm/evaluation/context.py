"""Perplexity as a function of context length (length extrapolation), by streaming with carried state.

    res = context_length_eval(cfg, checkpoint_path, window=2048, max_tokens=32768, num_docs=64)

Held-out documents (data.split's valid split, or test) are read whole, up to `max_tokens` tokens each, and
run through the model in windows of `window` tokens. Each window starts from the recurrent states the
previous window left (training/bptt.py's StateCarrier: Mamba-2 conv + SSM states, sliding-window attention
caches; full attention sees only its window), so the prediction of token t has seen all t earlier tokens
through the states. The per-token losses are bucketed by position in the document (0-512, 512-1K, 1K-2K,
...). The same documents are also run with the states reset at every window start ("window-reset"): the
context a model without carried state would get, for comparison.
"""
from __future__ import annotations

import contextlib
import logging
import math

import numpy as np
import torch
import torch.nn.functional as F

from megassm.training.bptt import StateCarrier

log = logging.getLogger("megassm.eval")

IGNORE = -100


def default_edges(max_len: int, window: int, first: int | None = None) -> list[int]:
    """Bucket edges 0, first, 2*first, 4*first, ... covering max_len. `first` defaults to 512 or, for
    short windows, the largest power of two <= window / 2 (at least 1)."""
    if first is None:
        first = 512 if window >= 1024 else max(1, 1 << max(0, (max(window, 2) // 2).bit_length() - 1))
    edges = [0, first]
    while edges[-1] < max_len:
        edges.append(edges[-1] * 2)
    return edges


@torch.no_grad()
def position_losses(model, docs: list[np.ndarray], window: int, carry: bool = True, batch_size: int = 8,
                    device=None, autocast=contextlib.nullcontext) -> tuple[np.ndarray, np.ndarray]:
    """Per-position summed loss and token count over `docs` (token arrays): position i is the prediction of
    token i+1 from tokens 0..i. `carry`: states flow from window to window (else reset at every window)."""
    device = device or next(model.parameters()).device
    max_len = max(len(d) for d in docs) - 1
    loss_sum = np.zeros(max_len, dtype=np.float64)
    count = np.zeros(max_len, dtype=np.int64)
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i]))  # similar lengths share a batch
    for lo in range(0, len(order), batch_size):
        group = [docs[i] for i in order[lo : lo + batch_size]]
        B = len(group)
        n = max(len(d) for d in group) - 1
        T = -(-n // window) * window
        toks = torch.zeros(B, T + 1, dtype=torch.long)
        labels = torch.full((B, T), IGNORE, dtype=torch.long)
        for b, d in enumerate(group):
            t = torch.from_numpy(np.asarray(d, dtype=np.int64))
            toks[b, : len(t)] = t
            labels[b, : len(t) - 1] = t[1:]
        toks, labels = toks.to(device), labels.to(device)
        carrier = StateCarrier(model, micro_batch=B, device=device)
        reset_all = torch.ones(B, dtype=torch.bool, device=device)
        for k in range(T // window):
            sl = slice(k * window, (k + 1) * window)
            states = carrier.begin(0, reset_all if (k == 0 or not carry) else None)
            with autocast():
                out = model(toks[:, sl], states=states, return_states=True)
            carrier.end(0, out.states)
            lab = labels[:, sl]
            ce = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), lab.reshape(-1),
                                 ignore_index=IGNORE, reduction="none").view(B, window)
            valid = lab != IGNORE
            hi = min((k + 1) * window, max_len)
            if hi <= k * window:
                continue
            width = hi - k * window
            loss_sum[k * window : hi] += (ce * valid).sum(0)[:width].double().cpu().numpy()
            count[k * window : hi] += valid.sum(0)[:width].cpu().numpy()
    return loss_sum, count


def bucketize(loss_sum: np.ndarray, count: np.ndarray, edges: list[int]) -> list[dict]:
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        if a >= len(count):
            break
        n = int(count[a:b].sum())
        loss = float(loss_sum[a:b].sum() / n) if n else float("nan")
        out.append({"start": a, "end": min(b, len(count)), "tokens": n, "loss": loss,
                    "ppl": math.exp(min(loss, 50.0)) if n else float("nan")})
    return out


def held_out_documents(cfg, split: str = "valid", num_docs: int = 64, max_tokens: int = 32768,
                       min_tokens: int = 0):
    """The longest `num_docs` documents (at least `min_tokens` tokens, when there are enough) of the held-out
    split of the run's data, each cut to `max_tokens`. Returns (docs, vocab_size, description, skipped):
    `skipped` counts the split's documents left out, by reason."""
    from megassm.data_tools.dataset import TokenDataset
    from megassm.data_tools.loader import manifest_vocab, resolve_paths
    from megassm.data_tools.sampler import split_documents

    which = {"train": 0, "valid": 1, "test": 2}[split]
    datasets = [TokenDataset(p) for p in resolve_paths(cfg.data)]
    vocab, _ = manifest_vocab(datasets)
    cands = []
    for di, d in enumerate(datasets):
        ids = split_documents(d.num_docs, cfg.data.split)[which]
        for i in ids:
            cands.append((int(d.doc_lengths[i]), di, int(i)))
    if not cands:
        raise ValueError(f"the {split} split of the data has no documents (data.split={cfg.data.split})")
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    long_enough = [c for c in cands if c[0] >= min_tokens]
    pool = long_enough if len(long_enough) >= 1 else cands
    chosen = [c for c in pool[:num_docs] if c[0] >= 2]  # a document needs 2 tokens to predict one
    skipped = {
        f"shorter than {min_tokens} tokens (2 windows)": len(cands) - len(long_enough) if pool is long_enough else 0,
        f"beyond --docs {num_docs} (shorter ones)": max(0, len(pool) - num_docs),
        "fewer than 2 tokens": len(pool[:num_docs]) - len(chosen),
    }
    skipped = {k: v for k, v in skipped.items() if v}
    if not chosen:
        raise ValueError(f"the {split} split has no document of 2 tokens or more")
    docs = [np.asarray(datasets[di].read(i, 0, min(n, max_tokens)), dtype=np.int64) for n, di, i in chosen]
    desc = (f"{len(docs)} longest documents of the {split} split ({len(cands)} in it), lengths "
            f"{min(c[0] for c in chosen)}..{max(c[0] for c in chosen)} tokens, cut to {max_tokens}")
    return docs, vocab, desc, skipped


def context_length_eval(cfg, checkpoint: str | None, window: int | None = None, max_tokens: int = 32768,
                        num_docs: int = 64, batch_size: int = 8, split: str = "valid", device: str = "auto",
                        edges: list[int] | None = None, baseline: bool = True, verify: bool = True) -> dict:
    """Load the model of `cfg` (weights from `checkpoint`, a checkpoint directory; None = the init weights),
    stream held-out documents, and return the bucketed results (see the module docstring). `verify`: check the
    weights' files against the checkpoint's integrity record first (False: the caller picked it with
    checkpoint.checkpoint_to_read, which verified them)."""
    from megassm.models import build_model
    from megassm.training import checkpoint as ckpt
    from megassm.training.checks import autocast_dtype as _autocast_dtype

    window = window or cfg.train.seq_len
    docs, vocab, desc, skipped = held_out_documents(cfg, split, num_docs, max_tokens, min_tokens=2 * window)
    if skipped:
        log.info("held-out documents skipped: %s", "; ".join(f"{n} {why}" for why, n in skipped.items()))
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    model = build_model(cfg.model, vocab_size=vocab, device="cpu")
    step = None
    if checkpoint is not None:
        meta = ckpt.load_model(checkpoint, model, verify=verify)
        step = int(meta["step"])
    else:
        model.init_weights(cfg.train.seed)
    model = model.to(dev).eval()
    amp = _autocast_dtype(cfg, dev)

    def autocast():
        return torch.autocast(dev.type, dtype=amp) if amp is not None else contextlib.nullcontext()

    curves = {"carried": position_losses(model, docs, window, True, batch_size, dev, autocast)}
    if baseline:
        curves["window_reset"] = position_losses(model, docs, window, False, batch_size, dev, autocast)
    max_len = len(curves["carried"][1])
    edges = edges or default_edges(max_len, window)
    buckets = bucketize(*curves["carried"], edges)
    if baseline:
        for row, base in zip(buckets, bucketize(*curves["window_reset"], edges)):
            row["loss_window_reset"], row["ppl_window_reset"] = base["loss"], base["ppl"]
    total = curves["carried"]
    return {
        "checkpoint": checkpoint,
        "step": step,
        "window": window,
        "documents": desc,
        "num_docs": len(docs),
        "skipped_docs": skipped,  # reason -> number of documents of the split left out
        "tokens": int(total[1].sum()),
        "loss": float(total[0].sum() / max(total[1].sum(), 1)),
        "carried": [k for k in StateCarrier(model, 1).kinds],
        "device": str(dev),
        "precision": "fp32" if amp is None else str(amp).replace("torch.", ""),
        "buckets": buckets,
    }


def markdown_table(res: dict) -> str:
    base = "loss_window_reset" in (res["buckets"][0] if res["buckets"] else {})
    lines = [
        f"# Perplexity by context length (step {res['step']}, window {res['window']})",
        "",
        f"{res['documents']}; {res['tokens']} predicted tokens on {res['device']} ({res['precision']}).",
        "Skipped: " + ("; ".join(f"{n} {why}" for why, n in res.get("skipped_docs", {}).items()) or "none") + ".",
        "`carried`: recurrent state streamed across windows"
        + ("; `window-reset`: states reset at every window start." if base else "."),
        "",
        "| positions | tokens | loss (carried) | ppl (carried) |" + (" loss (window-reset) | ppl (window-reset) |" if base else ""),
        "|---|---:|---:|---:|" + ("---:|---:|" if base else ""),
    ]
    for r in res["buckets"]:
        row = f"| {r['start']}-{r['end']} | {r['tokens']} | {r['loss']:.4f} | {r['ppl']:.3f} |"
        if base:
            row += f" {r['loss_window_reset']:.4f} | {r['ppl_window_reset']:.3f} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> bool:
    """PNG of ppl per bucket (x: bucket end, log2 scale). False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot written (pip install matplotlib); the table is")
        return False
    rows = [r for r in res["buckets"] if r["tokens"]]
    x = [r["end"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ax.plot(x, [r["ppl"] for r in rows], "o-", label="carried state")
    if rows and "ppl_window_reset" in rows[0]:
        ax.plot(x, [r["ppl_window_reset"] for r in rows], "s--", label="reset every window")
    ax.axvline(res["window"], color="gray", lw=0.8, ls=":", label=f"window {res['window']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token position in document (bucket end)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"Perplexity vs context length (step {res['step']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True

"""megassm beside the models a user would pick instead, in one process on one GPU. Prints one JSON line per row.

    python benchmarks/peers.py                                   # every row, whole-model training steps
    PYTHONPATH=.peers python benchmarks/peers.py --rows mamba_ssm megassm
    python benchmarks/peers.py --rows llama megassm --cuda-graph --steps 8 --warmup 3

Rows (`--rows`, default all):
  megassm    our model from `--config` (default configs/mamba2-1.3b.yaml) through the same step as
             benchmarks/train_step.py: fp32 master weights, bf16 autocast, fused AdamW, clipping at 1.0.
  mamba_ssm  mamba_ssm's Mamba-2 language model (MambaLMHeadModel, its Triton path) at the shape of our config
             (d_model, blocks, d_state, headdim, vocabulary), same step. mamba_ssm is peer code: it is imported
             from PYTHONPATH when present and never copied here. Absent (or without CUDA) its row is printed
             with "skipped" and the reason, and the other rows still run; `--require-peers` makes that exit 2.
  llama      a Llama-style Transformer in plain PyTorch (this file): pre-norm RMSNorm blocks, causal SDPA
             attention, SwiGLU MLP, tied embeddings; 1.3B at the defaults (24 x 2048, 16 heads, FFN 5504,
             vocabulary 50288), micro-batch `--llama-micro-batch` (8). `--llama-rope` adds rotary embeddings.
  ssd        the SSD kernel alone, ours against mamba_ssm's, at one Mamba-2 1.3B layer's shape (H 64, P 64,
             N 128, G 1, chunk 256, 32K tokens per call): runs benchmarks/kernels_ssd.py's `--only ssd` rows.

Tokens are random (data loading has its own benchmark). MFU is 6 x params x tokens/s over the GPU's bf16 dense
peak (megassm.training.flops, `MEGASSM_PEAK_FLOPS` overrides). On a machine without CUDA the GPU rows are
skipped with that reason; `--device cpu` runs megassm and llama on the CPU (fp32, a smoke test of the script).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = ("megassm", "mamba_ssm", "llama", "ssd")


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


# --------------------------------------------------------------------------------------------------------
# One training step, timed the same way for every model


def time_steps(model: nn.Module, loss_of, vocab: int, micro_batch: int, seq_len: int, steps: int, warmup: int,
               device: torch.device) -> dict:
    """fp32 master weights, bf16 autocast on CUDA, AdamW (fused on CUDA), gradient clipping at 1.0."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)

    def step():
        toks = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_of(toks[:, :-1], toks[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss = float(loss)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    return {"micro_batch": micro_batch, "seq_len": seq_len, "step_ms": round(dt * 1e3, 2),
            "tokens_per_s": round(micro_batch * seq_len / dt, 1), "loss": round(loss, 4)}


def add_mfu(row: dict, params: int, device: torch.device) -> dict:
    from megassm.training.flops import peak_flops_for

    row["params"] = params
    peak = peak_flops_for(device)
    if peak and "tokens_per_s" in row:
        row["mfu_6p"] = round(6 * params * row["tokens_per_s"] / peak, 4)
    if device.type == "cuda":
        row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row


# --------------------------------------------------------------------------------------------------------
# The Llama-style Transformer (plain PyTorch)


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate pairs of channels (first half against second half) by position-dependent angles. x: [B, h, L, d]."""
    d, L = x.shape[-1], x.shape[-2]
    inv = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(L, device=x.device, dtype=torch.float32), inv)  # [L, d/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class DecoderBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ffn: int, rope: bool):
        super().__init__()
        self.n_heads, self.rope = n_heads, rope
        self.attn_norm = nn.RMSNorm(d_model)
        self.mlp_norm = nn.RMSNorm(d_model)
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        self.gate = nn.Linear(d_model, ffn, bias=False)
        self.up = nn.Linear(d_model, ffn, bias=False)
        self.down = nn.Linear(ffn, d_model, bias=False)

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.n_heads, -1).transpose(1, 2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        u = self.attn_norm(h)
        q, k, v = self.heads(self.wq(u)), self.heads(self.wk(u)), self.heads(self.wv(u))
        if self.rope:
            q, k = rotary(q), rotary(k)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.wo(att.transpose(1, 2).flatten(2))
        u = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(u)) * self.up(u))


class LlamaStyle(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, ffn: int, rope: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = nn.ModuleList(DecoderBlock(d_model, n_heads, ffn, rope) for _ in range(n_layers))
        self.final_norm = nn.RMSNorm(d_model)

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        logits = self.final_norm(h) @ self.embed.weight.t()  # tied head
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


# --------------------------------------------------------------------------------------------------------
# Rows


def row_megassm(args, device) -> dict:
    sys.path.insert(0, HERE)
    from train_step import run_one  # the one-GPU step benchmark: the same step as the trainer

    from megassm.config import load_config

    cfg = load_config(args.config, ["data.builtin=stdlib"])
    if cfg.model.vocab_size is None:  # a config that takes its vocabulary from the data (configs/tiny.yaml)
        cfg.model.vocab_size = args.vocab
    out = []
    for graphed in ((False, True) if args.cuda_graph and device.type == "cuda" else (False,)):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        r = run_one(cfg, args.micro_batch, args.seq_len, args.steps, args.warmup, device, graphed)
        out.append({"row": "megassm", "config": args.config, **r})
    return out


def row_mamba_ssm(args, device) -> list[dict]:
    try:
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to name
        return [{"row": "mamba_ssm", "skipped": f"mamba_ssm not importable ({type(e).__name__}: {str(e)[:160]}); "
                 "put its Python package on PYTHONPATH"}]
    if device.type != "cuda":
        return [{"row": "mamba_ssm", "skipped": "needs CUDA (mamba_ssm's Triton kernels)"}]
    from megassm.config import blocks_of, load_config

    m = load_config(args.config, ["data.builtin=stdlib"]).model
    n_layers = len(blocks_of(m.pattern))
    vocab = m.vocab_size or args.vocab
    peer_cfg = MambaConfig(
        d_model=m.d_model, n_layer=n_layers, vocab_size=vocab, rms_norm=True, residual_in_fp32=True,
        fused_add_norm=True, pad_vocab_size_multiple=16,
        # use_mem_eff_path=False: the path that needs no causal-conv1d CUDA extension
        ssm_cfg={"layer": "Mamba2", "d_state": m.mamba.d_state, "headdim": m.mamba.headdim, "use_mem_eff_path": False},
    )
    torch.cuda.reset_peak_memory_stats()
    model = MambaLMHeadModel(peer_cfg, device="cuda", dtype=torch.float32)

    def loss_of(tokens, labels):
        logits = model(tokens).logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    r = time_steps(model, loss_of, vocab, args.micro_batch, args.seq_len, args.steps, args.warmup, device)
    row = add_mfu({"row": "mamba_ssm", "shape_of": args.config, "n_layers": n_layers, **r},
                  sum(p.numel() for p in model.parameters()), device)
    del model
    return [row]


def row_llama(args, device) -> list[dict]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = LlamaStyle(args.llama_vocab, args.llama_d_model, args.llama_layers, args.llama_heads, args.llama_ffn,
                       rope=args.llama_rope).to(device)
    r = time_steps(model, model.loss, args.llama_vocab, args.llama_micro_batch, args.seq_len, args.steps,
                   args.warmup, device)
    shape = {"d_model": args.llama_d_model, "n_layers": args.llama_layers, "n_heads": args.llama_heads,
             "ffn": args.llama_ffn, "vocab": args.llama_vocab, "rope": args.llama_rope}
    row = add_mfu({"row": "llama", **shape, **r}, sum(p.numel() for p in model.parameters()), device)
    del model
    return [row]


def row_ssd(args, device) -> list[dict]:
    if device.type != "cuda":
        return [{"row": "ssd", "skipped": "needs CUDA (Triton kernels)"}]
    import subprocess

    cmd = [sys.executable, os.path.join(HERE, "kernels_ssd.py"), "--only", "ssd", "--lens", args.ssd_lens,
           "--impls", "megassm,mamba_ssm"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    rows = []
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            rows.append({"row": "ssd", **json.loads(line)})
    if out.returncode != 0 or not rows:
        rows.append({"row": "ssd", "error": f"kernels_ssd.py exited {out.returncode}: {out.stderr[-400:]}"})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="See the module docstring (and docs/benchmarks.md) for what each row is.")
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="which rows to measure")
    ap.add_argument("--config", default="configs/mamba2-1.3b.yaml",
                    help="our model; the mamba_ssm row takes its shape from it")
    ap.add_argument("--vocab", type=int, default=50277,
                    help="vocabulary of megassm and mamba_ssm where the config leaves it to the data")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per step, megassm and mamba_ssm")
    ap.add_argument("--steps", type=int, default=6, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (Triton compiles and tunes)")
    ap.add_argument("--cuda-graph", action="store_true", help="megassm: also a row with train.cuda_graph's capture")
    ap.add_argument("--llama-micro-batch", type=int, default=8)
    ap.add_argument("--llama-d-model", type=int, default=2048)
    ap.add_argument("--llama-layers", type=int, default=24)
    ap.add_argument("--llama-heads", type=int, default=16)
    ap.add_argument("--llama-ffn", type=int, default=5504)
    ap.add_argument("--llama-vocab", type=int, default=50288)
    ap.add_argument("--llama-rope", action="store_true", help="rotary position embeddings on q and k")
    ap.add_argument("--ssd-lens", default="2048,8192,32768", help="ssd row: sequence lengths (B = 32K / L)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--require-peers", action="store_true",
                    help="exit 2 when a peer row (mamba_ssm) was skipped, instead of 0")
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    emit({"row": "machine", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
          "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")})
    skipped_peer = False
    failed = False
    for name in args.rows:
        try:
            rows = {"megassm": row_megassm, "mamba_ssm": row_mamba_ssm, "llama": row_llama, "ssd": row_ssd}[name](
                args, device)
        except torch.OutOfMemoryError:
            rows = [{"row": name, "error": "out of memory"}]
        except Exception as e:  # noqa: BLE001 - one failed row must not hide the others
            traceback.print_exc()
            rows = [{"row": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}]
            failed = True
        for r in rows:
            emit(r)
            skipped_peer |= r.get("row") == "mamba_ssm" and "skipped" in r
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if failed:
        return 1
    return 2 if (skipped_peer and args.require_peers) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Train a small model on a synthetic task and measure accuracy against sequence length.

    python -m megassm.synthetic.run --config configs/synthetic/induction_mamba2.yaml --out runs/ih
    python -m megassm.synthetic.run --task induction_heads --train-len 256 --eval-lens 256,4096,16384 \\
        --steps 2000 model.pattern=MM model.d_model=64 --out runs/ih-m2
    megassm-synthetic ...                       (the same, as a console script)

A run config (YAML) has four sections; command-line flags override them, and trailing `model.KEY=VALUE`
/ `task.KEY=VALUE` arguments override the model and the task's parameters:

    task:  {name: induction_heads, params: {vocab: 16}}
    model: {pattern: MM, d_model: 64, ...}         # megassm.config model keys (docs/config.md); or
           {core: coffee, n: 8, d: 16}             # the COFFEE paper's bare one-layer model (CoffeeCore)
    train: {steps: 2000, batch: 8, lr: 1e-3, weight_decay: 0, train_len: 256, seed: 0, warmup: 0,
            grad_clip: 1.0,                     # gradient-norm clip (--grad-clip; 0: none)
            cuda_graph: false, time_limit: 0,   # cuda_graph (or --cuda-graph): each step's forward +
            precision: bf16}                    # backward replayed as one CUDA graph (GPU, M/S/L/B/- only);
                                                # time_limit (--time-limit) s > 0: stop training after the
                                                # step that passes it, evaluate, record steps_done;
                                                # precision (--precision) bf16 | fp32: autocast on the GPU
                                                # for training and evaluation, or none (the CPU: always fp32)
    eval:  {lens: [256, 1024, 16384], batches: 4, batch: 8, every: 0,   # batches: --eval-batches
            also_fp32: false}                   # also_fp32 (--eval-fp32): the final evaluation once more
                                                # without autocast (accuracy_fp32 in results.json)

Batches are fresh every step (the task generators, megassm/synthetic/tasks.py); evaluation uses fixed
seeded batches per length, disjoint from training (another seed stream). Writes OUT/results.json (config,
per-length accuracy, loss curve, timings), OUT/results.md (a table) and OUT/accuracy.png (with matplotlib).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import numpy as np
import torch
import yaml

from .tasks import IGNORE, TASKS, make_batch, task_vocab

DEFAULTS = {
    "task": {"name": None, "params": {}},
    "model": {},
    "train": {"steps": 1000, "batch": 8, "lr": 1e-3, "weight_decay": 0.0, "train_len": 256, "seed": 0,
              "warmup": 0, "grad_clip": 1.0, "log_every": 100, "cuda_graph": False, "time_limit": 0,
              "precision": "bf16"},
    "eval": {"lens": None, "batches": 4, "batch": 8, "every": 0, "also_fp32": False},
}


def _merge(base: dict, over: dict, where: str, free: bool = False) -> dict:
    """`over` applied onto `base`; unknown keys are errors except in free-form parts (model, task.params)."""
    if not isinstance(over, dict):
        raise ValueError(f"{where}: expected a mapping, got {over!r}")
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for k, v in over.items():
        if k not in out and not free:
            raise ValueError(f"{where}: unknown key '{k}' (known: {', '.join(out)})")
        sub_free = free or k == "params"
        out[k] = _merge(out.get(k, {}), v, f"{where}.{k}", sub_free) if isinstance(v, dict) else v
    return out


def load_run_config(path: str | None, args) -> dict:
    cfg = copy.deepcopy(DEFAULTS)
    if path:
        if not os.path.exists(path):
            raise ValueError(f"{path}: config file not found")
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        for section, body in data.items():
            if section not in cfg:
                raise ValueError(f"{path}: unknown section '{section}' (task, model, train, eval)")
            cfg[section] = _merge(cfg[section], body, f"{path}: {section}", free=section == "model")
    t, tr, ev = cfg["task"], cfg["train"], cfg["eval"]
    if args.task:
        t["name"] = args.task
    for key in ("steps", "batch", "lr", "train_len", "seed", "grad_clip"):
        if getattr(args, key, None) is not None:
            tr[key] = getattr(args, key)
    if getattr(args, "eval_batches", None) is not None:
        ev["batches"] = args.eval_batches
    if args.eval_lens:
        ev["lens"] = [int(x) for x in args.eval_lens.split(",")]
    for text in args.overrides:
        section = text.split(".", 1)[0]
        if section not in ("model", "task") or "=" not in text:
            raise ValueError(f"override '{text}': expected model.KEY=VALUE or task.KEY=VALUE (a task parameter)")
        key, value = text[len(section) + 1:].split("=", 1)
        node = cfg["model"] if section == "model" else cfg["task"]["params"]
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = _override_value(value)
    if t["name"] not in TASKS:
        raise ValueError(f"task.name must be one of {', '.join(TASKS)}, got {t['name']!r}")
    if not ev["lens"]:
        ev["lens"] = [tr["train_len"]]
    for k in ("steps", "batch", "train_len"):
        if int(tr[k]) < 1:
            raise ValueError(f"train.{k} must be >= 1, got {tr[k]}")
    if not float(tr["grad_clip"]) >= 0:
        raise ValueError(f"train.grad_clip must be >= 0 (0: no clipping), got {tr['grad_clip']}")
    if int(ev["batches"]) < 1:
        raise ValueError(f"eval.batches must be >= 1, got {ev['batches']}")
    if getattr(args, "cuda_graph", False):
        tr["cuda_graph"] = True
    if getattr(args, "time_limit", None) is not None:
        tr["time_limit"] = args.time_limit
    if getattr(args, "precision", None) is not None:
        tr["precision"] = args.precision
    if getattr(args, "eval_fp32", False):
        ev["also_fp32"] = True
    if tr["precision"] not in ("bf16", "fp32"):
        raise ValueError(f"train.precision must be bf16 or fp32, got {tr['precision']!r}")
    if float(tr["time_limit"]) < 0:
        raise ValueError(f"train.time_limit must be >= 0 seconds (0: none), got {tr['time_limit']}")
    if tr["cuda_graph"]:
        _check_cuda_graph(cfg["model"])
    return cfg


def _override_value(text: str):
    """A KEY=VALUE override's value as YAML (numbers, booleans, lists), else the text itself: a pattern such
    as `**` or `*M` is not valid YAML (an alias) but is meant as a string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _check_cuda_graph(model_cfg: dict) -> None:
    """train.cuda_graph: only models whose forward and backward never read values on the host can be captured
    (the same set as the trainer's, megassm/training/cuda_graph.py)."""
    from megassm.config import ModelConfig, blocks_of
    from megassm.training.cuda_graph import GRAPH_SAFE_LETTERS, GRAPH_SAFE_WITHOUT_RESETS

    if "core" in model_cfg:
        raise ValueError("train.cuda_graph: the COFFEE core (model.core) runs its solver with host-side tests; "
                         "run it without --cuda-graph")
    pattern = str(model_cfg.get("pattern", ModelConfig().pattern))
    safe = {**GRAPH_SAFE_LETTERS, **GRAPH_SAFE_WITHOUT_RESETS}  # synthetic batches have no document resets
    bad = sorted(set(blocks_of(pattern)) - set(safe))
    if bad:
        raise ValueError(f"train.cuda_graph: model.pattern='{pattern}' has block(s) {', '.join(map(repr, bad))}, "
                         "whose forward reads values on the host; graph-safe blocks: "
                         + ", ".join(f"{k} {v}" for k, v in safe.items()))


# ----------------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------------
class _LM(torch.nn.Module):
    """A megassm LanguageModel over the task vocabulary: tokens -> logits [B, L, V]."""

    def __init__(self, model_cfg: dict, vocab: int, seed: int):
        super().__init__()
        from megassm.config import load_config
        from megassm.models import build_model

        over = [f"model.{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in _flat(model_cfg)]
        # the data section is required by the config's validation, not used here
        cfg = load_config(None, ["data.builtin=stdlib", f"model.vocab_size={vocab}", "model.pad_vocab_multiple=8",
                                 *over])
        self.lm = build_model(cfg.model, vocab_size=vocab)
        self.lm.init_weights(seed)
        self.vocab = vocab

    def forward(self, tokens):
        return self.lm(tokens).logits[..., : self.vocab]


class _Coffee(torch.nn.Module):
    def __init__(self, model_cfg: dict, vocab: int, seed: int):
        super().__init__()
        from megassm.models.coffee import CoffeeCore

        self.core = CoffeeCore(vocab, int(model_cfg.get("d", 16)), int(model_cfg.get("n", 8)),
                               output_filter=bool(model_cfg.get("output_filter", False)),
                               solver=model_cfg.get("solver", "sequential"), seed=seed)

    def forward(self, tokens):
        return self.core(tokens)


def _flat(d: dict, pre: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{pre}{k}.")
        else:
            yield pre + k, v


def build(cfg: dict, device) -> torch.nn.Module:
    vocab = task_vocab(cfg["task"]["name"], cfg["task"]["params"])
    m = cfg["model"]
    seed = int(cfg["train"]["seed"])
    torch.manual_seed(seed)
    if m.get("core") == "coffee":
        model = _Coffee(m, vocab, seed)
    elif "core" in m:
        raise ValueError(f"model.core must be 'coffee' (the COFFEE paper's model) or absent, got {m['core']!r}")
    else:
        model = _LM(m, vocab, seed)
    return model.to(device)


# ----------------------------------------------------------------------------------------------------
# training and evaluation
# ----------------------------------------------------------------------------------------------------
def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(correct, scored) over positions whose label is not IGNORE."""
    mask = labels != IGNORE
    pred = logits.argmax(-1)
    return int(((pred == labels) & mask).sum()), int(mask.sum())


def _tensors(batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.from_numpy(batch["tokens"]).to(device), torch.from_numpy(batch["labels"]).to(device))


@torch.no_grad()
def evaluate(model, cfg: dict, device, autocast) -> dict:
    """Accuracy per eval length on fixed batches (seed stream 1, never used in training)."""
    t, ev = cfg["task"], cfg["eval"]
    model.eval()
    out = {}
    for L in ev["lens"]:
        rng = np.random.default_rng([int(cfg["train"]["seed"]), 1, int(L)])
        correct = scored = 0
        for _ in range(int(ev["batches"])):
            tokens, labels = _tensors(make_batch(t["name"], rng, int(ev["batch"]), int(L), t["params"]), device)
            with autocast():
                logits = model(tokens)
            c, n = accuracy(logits.float(), labels)
            correct, scored = correct + c, scored + n
        out[int(L)] = correct / max(scored, 1)
    model.train()
    return out


def train(cfg: dict, device: torch.device, log=print) -> dict:
    t, tr = cfg["task"], cfg["train"]
    model = build(cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=float(tr["lr"]), weight_decay=float(tr["weight_decay"]))
    warm = int(tr["warmup"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    use_bf16 = device.type == "cuda" and cfg["model"].get("core") != "coffee" and tr["precision"] == "bf16"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else torch.autocast("cpu", enabled=False)

    def no_autocast():
        return torch.autocast("cpu", enabled=False)

    def fwd_bwd(batch: dict) -> torch.Tensor:
        with autocast():
            logits = model(batch["tokens"])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 batch["labels"].reshape(-1), ignore_index=IGNORE)
        loss.backward()
        return loss.detach()

    run = fwd_bwd
    graphed = None
    if tr["cuda_graph"]:  # the step's forward + backward as one replay: these models are launch-bound
        from megassm.training.cuda_graph import GraphedMicroBatch

        graphed = run = GraphedMicroBatch(params, fwd_bwd)

    rng = np.random.default_rng([int(tr["seed"]), 0])
    curve, evals = [], []
    t0 = time.perf_counter()
    run_loss, run_n = torch.zeros((), device=device), 0  # summed on the device: no host sync per step
    limit = float(tr["time_limit"])
    steps_done = 0
    for step in range(1, int(tr["steps"]) + 1):
        tokens, labels = _tensors(make_batch(t["name"], rng, int(tr["batch"]), int(tr["train_len"]), t["params"]),
                                  device)
        if graphed is not None:
            graphed.begin_step()
        run_loss += run({"tokens": tokens, "labels": labels})
        run_n += 1
        if tr["grad_clip"]:
            torch.nn.utils.clip_grad_norm_(params, float(tr["grad_clip"]))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        steps_done = step
        out_of_time = limit > 0 and time.perf_counter() - t0 > limit
        if step % int(tr["log_every"]) == 0 or step == int(tr["steps"]) or out_of_time:
            mean = run_loss.item() / run_n
            curve.append({"step": step, "loss": mean, "seconds": round(time.perf_counter() - t0, 2)})
            log(f"step {step}: loss {mean:.4f} ({time.perf_counter() - t0:.1f} s)")
            run_loss.zero_()
            run_n = 0
            if not math.isfinite(mean):
                raise FloatingPointError(f"non-finite loss at step {step}")
        if cfg["eval"]["every"] and step % int(cfg["eval"]["every"]) == 0 and step < int(tr["steps"]):
            evals.append({"step": step, "accuracy": evaluate(model, cfg, device, autocast)})
        if out_of_time:
            log(f"train.time_limit={limit:g} s reached after step {step} of {tr['steps']}")
            break
    train_s = time.perf_counter() - t0
    acc = evaluate(model, cfg, device, autocast)
    n_params = sum(p.numel() for p in params)
    res = {"config": cfg, "device": str(device), "params": n_params, "train_seconds": round(train_s, 2),
           "steps_done": steps_done, "time_limited": steps_done < int(tr["steps"]),
           "accuracy": {str(k): v for k, v in acc.items()}, "evals": evals, "curve": curve}
    if cfg["eval"]["also_fp32"]:  # the same weights evaluated without bf16 autocast
        res["accuracy_fp32"] = {str(k): v for k, v in evaluate(model, cfg, device, no_autocast).items()}
    return res


def write_results(res: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, f".results.json.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, os.path.join(out, "results.json"))
    c = res["config"]
    lines = [f"# {c['task']['name']} ({c['task']['params'] or 'defaults'})", "",
             f"model {c['model']}, {res['params']} parameters; {res['steps_done']} steps"
             + (f" (of {c['train']['steps']}, stopped by train.time_limit)" if res["time_limited"] else "")
             + " at length "
             f"{c['train']['train_len']}, batch {c['train']['batch']}, lr {c['train']['lr']}; "
             f"{res['train_seconds']} s on {res['device']}", "",
             "| eval length | accuracy |", "|---|---|"]
    if "accuracy_fp32" in res:
        lines[-2:] = ["| eval length | accuracy | accuracy, fp32 evaluation |", "|---|---|---|"]
        lines += [f"| {k} | {v:.4f} | {res['accuracy_fp32'][k]:.4f} |" for k, v in res["accuracy"].items()]
    else:
        lines += [f"| {k} | {v:.4f} |" for k, v in res["accuracy"].items()]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    xs = [int(k) for k in res["accuracy"]]
    ax.plot(xs, list(res["accuracy"].values()), marker="o")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("accuracy")
    ax.axvline(int(c["train"]["train_len"]), color="gray", ls="--", lw=0.8)
    ax.set_title(f"{c['task']['name']}: {c['model'].get('pattern', c['model'].get('core', ''))}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "accuracy.png"), dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megassm-synthetic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="run config YAML (task / model / train / eval)")
    ap.add_argument("--task", choices=sorted(TASKS))
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--train-len", dest="train_len", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--grad-clip", dest="grad_clip", type=float,
                    help="gradient-norm clipping threshold (train.grad_clip, default 1.0; 0: no clipping)")
    ap.add_argument("--eval-batches", dest="eval_batches", type=int,
                    help="evaluation batches per length (eval.batches; samples = batches x eval.batch)")
    ap.add_argument("--eval-lens", help="comma-separated evaluation lengths")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--time-limit", dest="time_limit", type=float,
                    help="seconds of training after which the run stops, evaluates and records steps_done")
    ap.add_argument("--cuda-graph", dest="cuda_graph", action="store_true",
                    help="replay each step's forward + backward as one CUDA graph (sets train.cuda_graph)")
    ap.add_argument("--precision", choices=["bf16", "fp32"],
                    help="GPU training and evaluation under bf16 autocast (default) or in fp32 (train.precision)")
    ap.add_argument("--eval-fp32", dest="eval_fp32", action="store_true",
                    help="also evaluate the final model without autocast (eval.also_fp32; accuracy_fp32)")
    ap.add_argument("--out", required=True, help="output directory (results.json, results.md, accuracy.png)")
    ap.add_argument("overrides", nargs="*", help="model.KEY=VALUE (model keys) or task.KEY=VALUE (task parameters)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from megassm.kernels import env as kernel_env

        kernel_env.check()  # the kernels' environment switches, before any work
        cfg = load_run_config(args.config, args)
    except (ValueError, yaml.YAMLError) as e:
        print(f"megassm-synthetic: {e}", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if args.device == "auto" else args.device))
    if cfg["train"]["cuda_graph"] and dev.type != "cuda":
        print(f"megassm-synthetic: train.cuda_graph needs a CUDA device; this run uses {dev}", file=sys.stderr)
        return 2
    res = train(cfg, dev)
    write_results(res, args.out)
    print(json.dumps({"task": cfg["task"]["name"], "model": cfg["model"], "params": res["params"],
                      "steps_done": res["steps_done"], "train_seconds": res["train_seconds"],
                      "accuracy": res["accuracy"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

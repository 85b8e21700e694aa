"""The deepspeed engine (`parallel.engine=deepspeed`): DeepSpeed ZeRO 0-3 with our AdamW as its client
optimizer, its JSON config derived from ours (deepspeed_config), the canonical states through DeepSpeed's
fp32-fragment API (docs/parallelism.md "Data-parallel engines")."""
from __future__ import annotations

import copy
import json
import logging
import os

import torch

from megassm.config import Config, ConfigError, data_parallel_size

from .engine_base import Engine

log = logging.getLogger("megassm.parallel.engines")

__all__ = ["deepspeed_config", "load_partial", "DeepSpeedEngine", "DERIVED_DEEPSPEED_KEYS"]

# keys of the DeepSpeed config that come from the megassm config only (a partial may not set them)
DERIVED_DEEPSPEED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                          "gradient_clipping", "bf16", "fp16", "zero_optimization.stage", "optimizer",
                          "scheduler")



def load_partial(path: str) -> dict:
    try:
        with open(path) as f:
            partial = json.load(f)
    except OSError as e:
        raise ConfigError(f"parallel.deepspeed_config: cannot read {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"parallel.deepspeed_config: {path}:{e.lineno}:{e.colno}: {e.msg}") from e
    if not isinstance(partial, dict):
        raise ConfigError(f"parallel.deepspeed_config: {path} must hold a JSON object, not {type(partial).__name__}")
    for key in DERIVED_DEEPSPEED_KEYS:
        head, _, tail = key.partition(".")
        node = partial.get(head)
        if (tail and isinstance(node, dict) and tail in node) or (not tail and head in partial):
            raise ConfigError(
                f"parallel.deepspeed_config: {path} sets '{key}', which megassm derives from its own config "
                "(train.global_batch / micro_batch, train.grad_clip, train.precision, parallel.zero_stage, optim.*); "
                "remove it there and set the megassm key instead")
    return partial


def _write_json_atomic(obj: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def deepspeed_config(cfg: Config, bf16: bool) -> dict:
    """The DeepSpeed JSON for this run, derived from the megassm config (never kept by hand): the batch
    triad, bf16, clipping, the ZeRO stage, plus the keys of the optional partial parallel.deepspeed_config."""
    t, p = cfg.train, cfg.parallel
    dp = data_parallel_size(cfg)
    zero = {"stage": p.zero_stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8)}
    if p.zero_stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(5e8), stage3_param_persistence_threshold=int(1e5))
    out = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.global_batch // (t.micro_batch * dp),
        "gradient_clipping": float(t.grad_clip),
        "bf16": {"enabled": bool(bf16)},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "steps_per_print": 2 ** 31 - 1,  # megassm logs the metrics
        "wall_clock_breakdown": False,
    }
    if p.deepspeed_config:
        out = _merge(out, load_partial(p.deepspeed_config))
    return out


class DeepSpeedEngine(Engine):
    name = "deepspeed"
    handles_states = True

    def __init__(self, model, groups, cfg, device, bf16: bool):
        super().__init__(model, groups, cfg)
        self.ds_config = deepspeed_config(cfg, bf16)
        self.stage = cfg.parallel.zero_stage
        self.bf16 = bf16
        self.ds = None
        if groups.rank == 0:  # the derived JSON beside the resolved config, for the record
            _write_json_atomic(self.ds_config, os.path.join(cfg.run.dir, "deepspeed_config.json"))

    def make_optimizer(self, build):
        import deepspeed

        base = build()
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        self._names = [[name_of[id(p)] for p in g["params"]] for g in base.param_groups]
        self._group_options = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
        # DeepSpeed's engine starts each backward (`_backward_prologue`: the optimizer learns whether this micro-batch
        # is the accumulation boundary) from hooks it puts on the tensors its module returns; it cannot see into our
        # LMOutput dataclass, so the root (_LossOnly) returns the loss tensor, in every stage. Without it ZeRO-1 kept
        # the boundary flag of the backward before: the first micro-batch of a step reduced every bucket as if at the
        # boundary, the others only the bucket it left unfilled, so most of their gradients were never averaged over
        # DP, and the non-partition parameters' gradients, left as views of the reused IPG buckets, summed into that
        # bucket's (wrong losses at DP 2 once a backward fills more than one reduce bucket; docs/history/parallel.md)
        root = _LossOnly(self.model)
        if self.stage == 3:
            self._register_zero3_units(deepspeed.zero.register_external_parameter, root)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(model=root, optimizer=base,
                                                             config=self.ds_config, dist_init_required=False)
        self.module = self.ds
        log.info("engine deepspeed: ZeRO stage %d over %d DP ranks, bf16 %s; config %s", self.stage,
                 self.groups.dp, self.bf16, json.dumps(self.ds_config, sort_keys=True))
        return self.optimizer

    def _register_zero3_units(self, register, root) -> None:
        """ZeRO-3 gathers a module's own parameters around that module's forward and backward. Our blocks
        use parameters of their children outside the children's forward (norm.add_forward, conv1d.weight,
        dt_proj.weight in the mixers), and the language model uses embedding.weight (tied head) and norm_f
        in its own forward; so every block gathers all its parameters as one unit (like fully_shard per
        block), and the model its embedding, final norm and head. DeepSpeed hooks the backward of a module
        through its outputs and cannot see into our LMOutput dataclass: the `root` (_LossOnly) returns the
        loss tensor, so its backward hook gathers those parameters again for the head's backward."""
        for layer in self.model.layers:
            for p in layer.parameters():
                register(layer, p)
        head = [self.model.embedding, self.model.norm_f] + ([self.model.lm_head] if self.model.lm_head else [])
        for p in [p for mod in head for p in mod.parameters()]:
            register(self.model, p)  # the forward (evaluation calls the model directly)
            register(root, p)  # the backward

    def forward(self, *args, **kwargs):
        from megassm.models.lm import LMOutput

        return LMOutput(loss=self.ds(*args, **kwargs), logits=None, states=None)

    def backward(self, loss: torch.Tensor, accum: int) -> None:
        self.ds.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
        if not self.ds.is_gradient_accumulation_boundary():
            self.ds.step()  # a micro step: DeepSpeed counts it; the optimizer steps at the boundary only

    def reduce_grads(self) -> None:
        pass  # ZeRO reduces (or reduce-scatters) in its backward / step

    def clip_and_step(self, max_norm: float, check) -> float:
        # DeepSpeed clips (gradient_clipping) and steps at the accumulation boundary; the norm is known only
        # then, so a non-finite one stops training after this step (the checkpoints hold the earlier steps)
        if not self.ds.is_gradient_accumulation_boundary():
            raise RuntimeError("deepspeed engine: clip_and_step called off the accumulation boundary")
        pre = None
        if self.stage == 0 and not self.bf16:  # plain fp32 DeepSpeed keeps no norm: the grads are whole here
            from .clipping import clip_grad_norm

            pre = clip_grad_norm(self.model.parameters(), 0.0)  # the norm only
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else (pre if pre is not None else float("nan"))
        if check(norm) is False:  # train.spike_action=skip is refused with this engine (training/checks.py)
            raise RuntimeError("deepspeed engine: check() declined a step DeepSpeed has already taken")
        return norm

    declines_steps = False  # the norm exists only once ds.step() has clipped and stepped

    # canonical states through DeepSpeed's fp32 fragment API (works for ZeRO 0-3, collective for ZeRO-3)
    def _fp32(self, p):
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(p)
        return (p.detach() if full is None else full).float().cpu().clone()

    def _opt_state(self, p, key: str):
        from deepspeed.utils import safe_get_full_optimizer_state

        full = safe_get_full_optimizer_state(p, key)
        if full is None:  # no fragment mapping (stage 0, fp32): the client optimizer holds the parameter
            st = self.optimizer.state.get(p, {})
            full = st.get(key)
        return None if full is None else full.float().cpu().clone()

    def _hp_flat(self) -> list:
        """The fp32 tensors the client AdamW steps under DeepSpeed: the flat fp32 partitions of ZeRO 1/2
        (single_partition_of_fp32_groups), of ZeRO-3 (fp32_partitioned_groups_flat) or of the bf16 optimizer
        (fp32_groups_flat_partition); the model's own parameters without any (stage 0, fp32)."""
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
            flat = getattr(self.optimizer, attr, None)
            if flat:
                return list(flat)
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _base(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _sync_lp_from_hp(self) -> None:
        """After writing the fp32 masters: copy them into the model's (bf16 or fp32) parameters."""
        opt = self.optimizer
        if hasattr(opt, "update_lp_params"):  # ZeRO 1/2, bf16 optimizer (all-gathers over DP)
            opt.update_lp_params()
        elif hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3: each rank its partition
            for i in range(len(opt.fp32_partitioned_groups_flat)):
                opt._reassign_or_swap_out_partitioned_parameters(i)

    def _relink_fragments(self) -> None:
        """DeepSpeed (0.19, ZeRO 1/2 and its bf16 optimizer) links each parameter to its optimizer-state
        fragment once, right after the first parameter group steps, so the later groups (ours: the no-decay
        group) are linked to an empty state; link again now that every group's state exists."""
        opt = self.optimizer
        if hasattr(opt, "_hp_optimizer_states_linked") and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def gather_states(self):
        self._relink_fragments()
        params = dict(self.model.named_parameters())
        msd = {}
        for k, v in self.model.state_dict().items():
            msd[k] = self._fp32(params[k]) if k in params else v.detach().cpu().clone()
        base = self._base()
        steps = [float(base.state[p]["step"]) for p in self._hp_flat() if "step" in base.state.get(p, {})]
        step = max(steps, default=0.0)
        state, index = {}, 0
        for names in self._names:
            for n in names:
                avg, sq = self._opt_state(params[n], "exp_avg"), self._opt_state(params[n], "exp_avg_sq")
                if avg is not None:
                    state[index] = {"step": torch.tensor(step), "exp_avg": avg, "exp_avg_sq": sq}
                index += 1
        groups, index = [], 0
        for names, opts in zip(self._names, self._group_options):
            groups.append({**opts, "params": list(range(index, index + len(names)))})
            index += len(names)
        if self.groups.rank != 0:
            return None, None
        return msd, {"state": state, "param_groups": groups}

    def load_states(self, model_state: dict, optim_state: dict | None) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        params = dict(self.model.named_parameters())
        missing = sorted(set(params) - set(model_state))
        if missing:
            raise ConfigError(f"checkpoint model state lacks {missing[:5]} (of {len(missing)})")
        mapped = any(hasattr(p, "_hp_mapping") or hasattr(p, "ds_id") for p in params.values())
        if not mapped:  # stage 0, fp32: the model's parameters are the masters, the client AdamW holds them
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(model_state[n])
            if optim_state is not None:
                self.optimizer.load_state_dict(optim_state)  # canonical = this optimizer's own layout
            return
        self._init_base_state()  # AdamW's state is created lazily; the fragments need it now
        self._relink_fragments()
        for n, p in params.items():
            safe_set_full_fp32_param(p, model_state[n].to(p.device))
        self._sync_lp_from_hp()
        if optim_state is None or not optim_state.get("state"):
            return
        flat = [n for names in self._names for n in names]
        step = 0.0
        for i, st in optim_state["state"].items():
            p = params[flat[int(i)]]
            step = float(st["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, st[key].to(p.device), key)
        base = self._base()
        for p in self._hp_flat():
            base.state[p]["step"].fill_(step)

    def _init_base_state(self) -> None:
        """Zero AdamW state for every flat fp32 partition that has none yet, in the layout torch's AdamW
        creates at its first step (fp32 step on the device for fused / capturable, else on the CPU)."""
        base = self._base()
        on_dev = any(g.get("fused") or g.get("capturable") for g in base.param_groups)
        for p in self._hp_flat():
            if "exp_avg" in base.state.get(p, {}):
                continue
            base.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device if on_dev else "cpu"),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


class _LossOnly(torch.nn.Module):
    """DeepSpeed's root in every stage: the language model's loss as a plain tensor, so that DeepSpeed's hooks on
    its module's outputs run (make_optimizer; ZeRO-3 also gathers through it: _register_zero3_units)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, *args, **kwargs):
        return self.lm(*args, **kwargs).loss



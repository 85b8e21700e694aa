"""Run configuration: YAML file -> typed dataclasses, dotted overrides, validation before any compute.

    cfg = load_config("configs/tiny.yaml", ["model.d_model=256", "train.steps=50"])

Unknown keys are errors that name the key, the file (or "command line") and the closest valid key.
`validate(cfg)` runs the cross-checks (heads and groups divide, batch triad, pattern letters) and is
called by `load_config`, so a mistake fails before a model is built or a GPU is touched.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

log = logging.getLogger("megassm.config")


class ConfigError(ValueError):
    """A configuration mistake, with the key and where it came from."""


# ----------------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------------


@dataclass
class MambaConfig:
    """Mamba-2 mixer (`M`)."""

    d_state: int = 128  # N
    d_conv: int = 4
    expand: int = 2  # d_inner = expand * d_model
    headdim: int = 64  # P; heads H = d_inner / P
    ngroups: int = 1  # G groups of B/C and of the gated norm
    chunk_size: int = 256
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    dt_init_floor: float = 1e-4
    dt_limit: list[float] | None = None  # clamp of dt after softplus, [lo, hi]
    A_init_min: float = 1.0
    A_init_max: float = 16.0
    conv_bias: bool = True
    proj_bias: bool = False
    D_has_hdim: bool = False  # D per channel [H, P] instead of per head [H]
    norm_before_gate: bool = False


@dataclass
class AttentionConfig:
    """Attention (`*`): causal, GQA, optional RoPE and sliding window, SDPA."""

    n_heads: int = 8
    n_kv_heads: int | None = None  # None = n_heads (MHA)
    head_dim: int | None = None  # None = d_model / n_heads
    rope: bool = True
    rope_theta: float = 10000.0
    sliding_window: int = 0  # 0 = full causal attention
    bias: bool = False
    doc_mask: bool = True  # with seq_idx, attend only within the token's own document (positions restart)


@dataclass
class MLPConfig:
    """MLP (`-`): SwiGLU (gated, the default) or squared ReLU (Nemotron-H's, no gate)."""

    ffn_hidden: int | None = None  # None = 8/3 * d_model rounded up to a multiple of 256
    bias: bool = False
    activation: str = "swiglu"  # swiglu: w2(silu(w1 u) * w3 u) | relu2: w2(relu(w1 u)^2), no w3


@dataclass
class CoffeeConfig:
    """COFFEE mixer (`C`): per-channel state-feedback recurrence x = x + sigmoid(w*x) * (lam*x + u), solved in
    parallel by DEER Newton iterations (or sequentially). docs/seeds.md."""

    d_state: int = 8  # n, states per channel
    expand: int = 1  # channels D = expand x d_model (proj: true)
    proj: bool = True  # in_proj d_model -> D, out_proj D -> d_model; false = the paper's bare layer (D = d_model)
    output_filter: bool = False  # "+OF": y_i *= sigmoid(w_out_i . x_i)
    lam_param: str = "bounded"  # bounded: lam = -2 sigmoid(raw) in (-2, 0) | free: lam = raw (the paper)
    lam_init: list[float] = field(default_factory=lambda: [-1.0, -0.01])  # lam uniform in [lo, hi] at init
    c_init_std: float = 1.0  # C ~ N(0, std) (paper: 1)
    w_init_std: float = 1.0  # w (and w_out) ~ N(0, std) (paper: 1)
    # auto: sequential on CUDA tensors (the fused Triton token loop: exact and the fastest there), deer elsewhere
    # | deer (parallel Newton iterations, PyTorch) | sequential (the token loop; the plain PyTorch loop on CPU)
    solver: str = "auto"
    deer_tol: float = 1e-6  # converged when every |x_k - f(x_(k-1))| <= tol * (1 + |x_k|)
    deer_max_iters: int = 100  # cap on Newton solves (L solves are always exact)
    deer_jac_clip: float = 0.0  # clamp the Newton slopes to |J| <= clip (0 = full Newton, safeguarded); same fixed point
    deer_fallback: bool = True  # at the cap, finish the unconverged suffix with the sequential loop (exact)


@dataclass
class BMojoConfig:
    """B'MOJO layer (`B`): Mamba-2 SSM (model.mamba.*) -> innovation selection -> sliding-window attention
    (heads from model.attn.*, no positional encoding) over window + fading + eidetic memory tokens."""

    window: int = 512  # w: raw tokens each query sees (itself included); memory refreshes every w tokens
    n_fading: int = 1  # m_f: SSM outputs just before each chunk, as memory tokens
    n_eidetic: int = 16  # m_e: running top-m_e most unpredictable tokens of the document, as memory tokens
    predictor_width: int = 4  # k: innovation = |y_t - mean(y_(t-1..t-k))|^2
    # the SSM output y joins the layer output (out = y + attention): the Mamba layer and the memory attention
    # side by side, as in the paper's stack of Mamba and SWA that B'MOJO-F extends; false: attention only
    # (Alg. 1's out_t), where the SSM reaches the output only through the fading tokens
    ssm_residual: bool = True


@dataclass
class Mamba1Config:
    """Mamba-1 / S6 mixer (`S`): in_proj -> x, z; conv + SiLU; x_proj -> (dt_low, B, C); dt_proj; selective scan
    with A = -exp(A_log) [d_inner, N] (S4D-real init), D skip, silu(z) gate; out_proj. docs/seeds.md."""

    d_state: int = 16  # N, states per channel
    expand: int = 2  # d_inner = expand x d_model
    d_conv: int = 4
    dt_rank: int | None = None  # R of dt_proj(x_proj(x)[:R]); None = ceil(d_model / 16)
    dt_min: float = 1e-3  # dt init: log-uniform in [dt_min, dt_max], floored, stored as softplus^-1 in dt_proj.bias
    dt_max: float = 1e-1
    dt_init_floor: float = 1e-4
    conv_bias: bool = True
    proj_bias: bool = False  # bias in in_proj / out_proj
    init: str = "paper"  # paper: mamba_ssm's (U(+-1/sqrt(fan_in)), out_proj / sqrt(blocks)) | normal: N(0, init_std)
    lti: bool = False  # ablation (Mamba paper Table 1): dt, B, C learned constants, not functions of x (no x_proj)


@dataclass
class LonghornConfig:
    """Longhorn mixer (`L`): the Mamba-1 block with the SSM replaced by the online-regression update (eq. 7):
    S = (1 - eps k^2) S + (eps x) k, eps = beta / (1 + beta |k|^2), beta = sigmoid(beta_proj(dt_low)). docs/seeds.md."""

    d_state: int = 16  # m, key/query size (state [d_inner, m] per layer)
    expand: int = 2  # d_inner = expand x d_model
    d_conv: int = 4
    dt_rank: int | None = None  # R of the low-rank beta projection; None = ceil(d_model / 16)
    conv_bias: bool = True
    proj_bias: bool = False
    init: str = "paper"  # paper: the official code's (U(+-1/sqrt(fan_in)), out_proj / sqrt(blocks)) | normal


@dataclass
class ModelConfig:
    pattern: str = "M*M-"
    d_model: int = 256
    vocab_size: int | None = None  # None = from the data (tokenizer); padded to pad_vocab_multiple
    pad_vocab_multiple: int = 128
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # initial weights from a directory (transformers Mamba2 / Nemotron-H / GraniteMoeHybrid export, mamba_ssm
    # checkpoint, megassm checkpoint or run) instead of the seeded init; step 0 and a fresh optimizer all the same
    # (docs/interop.md)
    init_from: str | None = None
    mamba: MambaConfig = field(default_factory=MambaConfig)
    attn: AttentionConfig = field(default_factory=AttentionConfig)
    mlp: MLPConfig = field(default_factory=MLPConfig)
    coffee: CoffeeConfig = field(default_factory=CoffeeConfig)
    bmojo: BMojoConfig = field(default_factory=BMojoConfig)
    mamba1: Mamba1Config = field(default_factory=Mamba1Config)
    longhorn: LonghornConfig = field(default_factory=LonghornConfig)


@dataclass
class TrainConfig:
    steps: int = 100
    seq_len: int = 512
    micro_batch: int = 4
    global_batch: int = 4  # = micro_batch x accumulation x data-parallel ranks
    bptt: bool = False
    bptt_windows: int = 1
    activation_checkpointing: bool = False  # recompute each block's activations in the backward
    activation_checkpointing_blocks: int = 0  # > 0: recompute only the first N blocks (of each pipeline stage); 0: all
    activation_checkpointing_keep: str = "pair"  # pair: a block keeps (hidden, fp32 residual); sum: their fp32 sum
    cuda_graph: bool = False  # capture each micro-batch's forward + backward in a CUDA graph (training/cuda_graph.py)
    compile: bool = False  # torch.compile over each block's forward: the glue between the kernels (training/compile.py)
    cast_weights_once: bool = False  # bf16: Linears compute with bf16 weight copies cast once per step (training/weight_cache.py)
    fp8: bool = False  # the blocks' Linears compute in FP8, per-tensor dynamic scales (training/fp8.py, kernels/fp8/op.py)
    loss_chunk_tokens: int = 0  # > 0: LM head + loss in checkpointed chunks of about this many tokens (models/lm.py)
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | bf16 | fp32
    grad_clip: float = 1.0  # 0 disables clipping
    device: str = "auto"  # auto | cpu | cuda
    eval_interval: int = 100  # 0 disables periodic eval
    eval_tokens: int = 8192  # held-out tokens per validation pass, rounded up to whole samples of seq_len; the
    #                         same set for every layout (docs/evaluation.md "Validation")
    log_interval: int = 10
    # long-run guards (training/guards.py; docs/reliability.md "Loss spikes", "Stragglers")
    spike_action: str = "off"  # off | skip (discard a spiking step's update) | rollback (to the last checkpoint,
    #                            the data position kept past the spiking batches)
    spike_window: int = 128  # accepted steps whose loss / grad norm give the mean and std (OLMo-core's 128)
    spike_sigma: float = 6.0  # spike: loss or grad norm > mean + sigma x std of the window (OLMo-core's 6)
    spike_min_steps: int | None = None  # accepted steps in the window before it judges; None = spike_window // 2
    spike_max_rollbacks: int = 3  # rollbacks to one checkpoint; a spike past them stops the run (exit 7)
    straggler_interval: int | None = None  # steps between per-rank work reports; None = train.log_interval; 0 = off
    straggler_fraction: float = 0.2  # name the slowest rank when its work exceeds the median by this fraction


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 100
    decay: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    fused: str = "auto"  # auto (fused AdamW on GPU) | true | false


@dataclass
class DataConfig:
    builtin: str | None = None  # "stdlib": the Python standard library's sources, built on first use
    paths: list[str] = field(default_factory=list)  # shard prefixes (PREFIX.bin/.idx or PREFIX-00000...)
    weights: list[float] | None = None  # blend weights, one per path
    tokenizer: str = "byte"  # tokenizer for the builtin corpus
    split: list[float] = field(default_factory=lambda: [98.0, 1.0, 1.0])  # train/valid/test by document
    prefetch: int = 2  # batches prepared ahead in a background thread; 0 = synchronous
    cache_dir: str | None = None  # default ~/.cache/megassm/data or $MEGASSM_CACHE


@dataclass
class ParallelConfig:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"  # 1f1b | gpipe (torch.distributed.pipelining schedules; docs/parallelism.md)
    pp_virtual: int = 1  # stages per pipeline rank (> 1: interleaved 1F1B)
    sp: bool = False
    tp_overlap: bool = False  # tp > 1: the input region's backward collective beside the weight gradients of the
    #                           Mamba-2 in_proj / MLP w1, w3 (parallel/layers.py column_parallel; docs/parallelism.md)
    engine: str = "ddp"  # ddp | fsdp2 | deepspeed (parallel/engines.py, docs/parallelism.md "Engines")
    zero_stage: int = 0  # engine=deepspeed: ZeRO stage 0-3; engine=ddp: 1 = the distributed optimizer (distopt.py)
    deepspeed_config: str | None = None  # engine=deepspeed: JSON partial merged into the derived config
    bucket_mb: float = 25.0  # engine=ddp: gradient bucket size (MB) of DDP / of the distributed optimizer
    # engine=fsdp2 (parallel/fsdp2.py FSDP2Engine, docs/parallelism.md "Engines")
    fsdp_param_dtype: str = "auto"  # auto | bf16 | fp32: dtype the matmul weights are all-gathered in (auto: bf16
    #                                 under bf16 training, no autocast weight casts)
    fsdp_reduce_dtype: str = "fp32"  # fp32 | bf16: dtype of the gradient reduce-scatter
    fsdp_reshard: str = "step"  # when gathered weights are freed: block (after each block's forward and backward:
    #                             ZeRO-3, least memory) | micro_batch (after its backward) | step (after the step's
    #                             last backward: one all-gather per optimizer step)
    fsdp_prefetch: int = 1  # blocks all-gathered ahead in forward and backward (0: FSDP2's implicit prefetch)
    # engine=fsdp2 across nodes (docs/across-nodes.md): HSDP shards inside groups of shard_size consecutive DP ranks
    # (a node's GPUs) and replicates across the groups; gradients cross the replicas once per optimizer step
    shard_size: int = 0  # DP ranks per FSDP2 shard group; 0 = all of them (plain FSDP2); < DP: HSDP
    fsdp_grad_sync: str = "micro_batch"  # micro_batch: reduce-scatter after every micro-batch's backward | step:
    #                                      accumulate unsharded fp32 gradients, one reduce-scatter per step (memory:
    #                                      the (TP-local) matmul weights' fp32 gradients, whole, on every rank)
    gpus_per_node: int = 0  # ranks per node: 0 = the launcher's LOCAL_WORLD_SIZE (torchrun), else all on one node;
    #                          the dry run's bytes inside / across nodes and the HSDP placement checks read it
    world_size: int | None = None  # None = from the launcher's environment (WORLD_SIZE), else 1
    timeout_s: float = 600.0  # collective timeout: a rank stalled this long ends the job (docs/launch.md "Faults")


@dataclass
class RunConfig:
    dir: str = "runs/default"
    save_interval: int = 0  # steps between checkpoints; 0 = only at the end
    save_final: bool = True  # checkpoint after the last step (benchmarks turn it off)
    keep_last: int = 3
    resume: str = "none"  # none | auto | path of a checkpoint directory
    # a fresh start (run.resume=none) in a run.dir that holds an earlier run: move that run aside into
    # run.dir/previous-<UTC time>/ instead of refusing (training/checkpoint/folder.py earlier_run, move_aside)
    overwrite: bool = False
    checkpoint_format: str = "canonical"  # canonical (rank 0 gathers single files) | sharded (DCP, every rank writes)
    async_save: bool = False  # sharded only: write in a background thread after a CPU snapshot at the step boundary
    tensorboard: bool = True
    # Weights & Biases beside TensorBoard (training/wandb_sink.py): off | online | offline (written under
    # run.dir/wandb/, `wandb sync` later); needs `pip install wandb`. Rank 0 logs; a resume continues the same
    # wandb run (its id kept in run.dir/wandb_id)
    wandb: str = "off"
    wandb_project: str = "megassm"
    wandb_name: str = ""  # "" = run.dir's last folder name
    wandb_entity: str = ""  # "" = the logged-in user's default entity
    progress: bool = True
    profile_step: int = 0  # > 0: profile that step (GPU runs): RUN_DIR/profile/*.json (training/profiling.py)
    profile_trace: bool = False  # with profile_step: also write the Chrome trace
    lock_stale_s: int = 300  # run.dir's trainer.lock from another host counts as stale after this long without a heartbeat


@dataclass
class KernelsConfig:
    """The kernels' switches (kernels/core/env.py SWITCHES: each key's variable, values and checks): the trainer
    sets each variable from here at start-up unless it is set already, then the environment wins and config.yaml
    records the value in effect (training/run_config.py apply_settings). Checked there, before any file is
    written: the config cannot import the kernels."""

    backend: str = "auto"  # MEGASSM_KERNELS: auto (Triton on CUDA tensors) | triton | torch (the reference)
    ssd_precision: str = "bf16"  # MEGASSM_SSD_PRECISION: bf16 | split (fp32-class products)
    ssd_state_segments: str = "auto"  # MEGASSM_SSD_STATE_SEGMENTS: auto | k, the chunk walks in k segments
    ssd_save_states: bool = False  # MEGASSM_SSD_SAVE_STATES: keep the forward's chunk states for the backward
    ssd_dbc_split: int = 1  # MEGASSM_SSD_DBC_SPLIT: 1 | 2 | 4 | 8 programs per dB / dC tile of the SSD backward
    ssd_streams: bool = True  # MEGASSM_SSD_STREAMS: the SSD's walk-independent kernels on a second CUDA stream
    conv_bwd: str = "two_pass_defer"  # MEGASSM_CONV_BWD: two_pass_defer | two_pass | fused
    autotune: bool = True  # MEGASSM_TRITON_AUTOTUNE: tune the Triton SSD kernels' launch configs per shape
    tune_log: bool = False  # MEGASSM_TRITON_TUNE_LOG: one JSON line on stderr per tuning decision
    ssd_tiles: str = ""  # MEGASSM_SSD_TILES: "NAME=VALUE,..." overrides of the Triton SSD's tile table


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    # written by the trainer: every MEGASSM_* variable set when the run started, NAME=value (the kernels' among
    # them override kernels.*). A record, never applied: a run started from a config.yaml records its own
    environment: list[str] = field(default_factory=list)


# Pattern letters are the block kinds of megassm/models/registry.py (`block_letters()`); `|` is a
# pipeline-stage boundary (no block of its own).
PATTERN_SEPARATORS = {"|"}
MLP_ACTIVATIONS = ("swiglu", "relu2")


def block_letters() -> dict[str, str]:
    """{letter: name} of the registered block kinds (imported on first use: the mixers import this module)."""
    from megassm.models.registry import letters

    return letters()


# ----------------------------------------------------------------------------------------------------
# Building dataclasses from nested dicts, with typed values and helpful errors
# ----------------------------------------------------------------------------------------------------


def _all_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else _resolve(cls, f)):
            keys.extend(_all_keys(_resolve(cls, f), name + "."))
        else:
            keys.append(name)
    return keys


def _resolve(cls, f) -> Any:
    hints = typing.get_type_hints(cls)
    return hints[f.name]


def _closest(key: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.0)
    return match[0] if match else "?"


_NONE_WORDS = ("none", "null", "~")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Convert `value` to type `tp` (from the dataclass annotation) or raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in _NONE_WORDS)):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: {key}: cannot be {value!r}")
    if origin is list:
        if isinstance(value, str):  # command line: a,b,c or [a, b]
            try:
                value = yaml.safe_load(value if value.strip().startswith("[") else "[" + value + "]")
            except yaml.YAMLError as e:
                raise ConfigError(f"{where}: {key}: cannot read {value!r} as a list: {e}") from None
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: {key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]", where) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: {key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}: {key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {key}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: {key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: {key}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: {key}: unsupported type {tp}")


# Deprecated keys still read: key -> the key that replaces it. The value is kept aside while the config is read
# and converted by _resolve_deprecated once every file and override is applied.
DEPRECATED_KEYS = {"train.eval_batches": "train.eval_tokens"}


def _apply(obj: Any, data: dict, where: str, prefix: str = "") -> None:
    """Set fields of dataclass `obj` from nested dict `data`; unknown keys raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'top level'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for k, v in data.items():
        key = prefix + str(k)
        if key in DEPRECATED_KEYS:
            obj.__dict__.setdefault("_deprecated", {})[k] = (_coerce(v, int, key, where), where)
            continue
        if k not in names:
            while isinstance(v, dict) and len(v) == 1:  # name the full dotted key, not just its section
                (sub, v), = v.items()
                key += f".{sub}"
            valid = _all_keys(Config)
            raise ConfigError(
                f"{where}: unknown key '{key}' (closest valid key: '{_closest(key, valid)}')"
            )
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            _apply(getattr(obj, k), v, where, key + ".")
        else:
            setattr(obj, k, _coerce(v, tp, key, where))
            obj.__dict__.setdefault("_given", set()).add(k)


def _resolve_deprecated(cfg: Config) -> None:
    """train.eval_batches (validation micro-batches per data-parallel rank) becomes train.eval_tokens: the same
    held-out samples in the layout this config describes (eval_batches x micro_batch x data-parallel ranks
    samples of seq_len tokens), from then on fixed whatever the layout."""
    t = cfg.train
    old = t.__dict__.pop("_deprecated", {})
    if "eval_batches" not in old:
        return
    n, where = old["eval_batches"]
    if "eval_tokens" in t.__dict__.get("_given", set()):
        raise ConfigError(f"{where}: train.eval_batches is deprecated and train.eval_tokens is set too: remove "
                          "train.eval_batches (docs/config.md)")
    p = cfg.parallel
    dp = max(1, world_size(cfg) // max(1, p.tp * p.cp * p.pp))
    t.eval_tokens = n * t.micro_batch * dp * t.seq_len
    log.warning("%s: train.eval_batches=%d is deprecated (it counted micro-batches per rank, so the held-out set "
                "changed with the layout): read as train.eval_tokens=%d (%d x micro_batch %d x %d data-parallel "
                "ranks x seq_len %d); set train.eval_tokens instead", where, n, t.eval_tokens, n, t.micro_batch, dp,
                t.seq_len)


def parse_override(text: str) -> tuple[str, str]:
    """`model.d_model=256` -> ('model.d_model', '256'). The text is converted by the key's type later,
    so a pattern such as `-` or `*` stays the string it is."""
    if "=" not in text:
        raise ConfigError(f"command line: override '{text}' must look like key=value (e.g. train.steps=50)")
    key, raw = text.split("=", 1)
    return key.strip(), raw.strip()


def _nest(key: str, value: Any) -> dict:
    out: dict = {}
    cur = out
    parts = key.split(".")
    for p in parts[:-1]:
        cur[p] = {}
        cur = cur[p]
    cur[parts[-1]] = value
    return out


def load_config(path: str | os.PathLike | None, overrides: list[str] = (), validate_config: bool = True) -> Config:
    """Read a YAML file (or start from defaults when path is None), apply dotted overrides, validate."""
    if path is None:
        return config_from_text(None, "defaults", overrides, validate_config)
    path = str(path)
    if not os.path.exists(path):
        raise ConfigError(f"{path}: config file not found")
    with open(path) as f:
        return config_from_text(f.read(), path, overrides, validate_config)


def config_from_text(text: str | None, where: str, overrides: list[str] = (), validate_config: bool = True) -> Config:
    """load_config for YAML text (e.g. the config a checkpoint's meta.json records); `where` names it in errors."""
    cfg = Config()
    if text is not None:
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: invalid YAML: {e}") from None
        _apply(cfg, data, where)
    cli_keys = set()
    for item in overrides:
        key, value = parse_override(item)
        _apply(cfg, _nest(key, value), "command line")
        cli_keys.add(key)
    # A later layer wins: data.paths given on the command line replaces the file's built-in corpus
    # (configs/tiny.yaml sets data.builtin=stdlib), unless the command line sets data.builtin too.
    if "data.paths" in cli_keys and "data.builtin" not in cli_keys and cfg.data.paths:
        cfg.data.builtin = None
    _resolve_deprecated(cfg)
    if validate_config:
        validate(cfg)
    return cfg


def config_from_dict(data: dict, where: str, validate_config: bool = False) -> Config:
    """A Config from a nested mapping (e.g. a checkpoint's recorded config); unknown keys name `where`."""
    cfg = Config()
    _apply(cfg, data or {}, where)
    if validate_config:
        validate(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


# ----------------------------------------------------------------------------------------------------
# Cross-checks
# ----------------------------------------------------------------------------------------------------


def blocks_of(pattern: str) -> list[str]:
    """The residual blocks of a pattern, in order (stage separators dropped)."""
    return [c for c in pattern if c not in PATTERN_SEPARATORS]


def mamba_dims(model: ModelConfig) -> dict:
    d_inner = model.mamba.expand * model.d_model
    return {"d_inner": d_inner, "nheads": d_inner // model.mamba.headdim}


def scan_dims(model: ModelConfig, letter: str) -> dict:
    """d_inner and dt_rank of a selective-scan mixer: `S` (model.mamba1) or `L` (model.longhorn)."""
    sec = model.mamba1 if letter == "S" else model.longhorn
    rank = sec.dt_rank if sec.dt_rank is not None else -(-model.d_model // 16)
    return {"d_inner": sec.expand * model.d_model, "dt_rank": rank, "d_state": sec.d_state}


def ffn_hidden(model: ModelConfig) -> int:
    if model.mlp.ffn_hidden is not None:
        return model.mlp.ffn_hidden
    return -(-int(8 * model.d_model / 3) // 256) * 256


def attn_dims(model: ModelConfig) -> dict:
    a = model.attn
    head_dim = a.head_dim if a.head_dim is not None else model.d_model // a.n_heads
    return {"head_dim": head_dim, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads or a.n_heads}


def world_size(cfg: Config) -> int:
    if cfg.parallel.world_size is not None:
        return cfg.parallel.world_size
    return int(os.environ.get("WORLD_SIZE", "1"))


def data_parallel_size(cfg: Config) -> int:
    p = cfg.parallel
    return world_size(cfg) // (p.tp * p.cp * p.pp)


# count keys with their smallest value, checked before every other check (None: unset is fine). The other
# counts have their own checks below or in their block kind's (models/registry.py); tests/test_config_values.py
# tries 0 and -1 on every integer key.
_COUNTS_FIRST = {
    "model.d_model": 1, "model.mamba.d_state": 1, "model.mamba.expand": 1, "model.mamba.headdim": 1,
    "model.mamba.ngroups": 1, "model.mamba.chunk_size": 1, "model.attn.n_heads": 1, "model.attn.n_kv_heads": 1,
    "model.attn.head_dim": 1, "model.mlp.ffn_hidden": 1,
    "train.steps": 1, "train.seq_len": 1, "train.micro_batch": 1, "train.global_batch": 1, "train.log_interval": 1,
    "parallel.tp": 1, "parallel.cp": 1, "parallel.pp": 1, "parallel.pp_virtual": 1, "parallel.world_size": 1,
    "kernels.ssd_dbc_split": 1,  # its values (1, 2, 4, 8) are checked with the other kernels.* (run_config.py)
}
# a float that may be infinite: the upper clamp of dt (mamba_ssm's "no clamp" is (0, inf)); NaN never
_MAY_BE_INF = {"model.mamba.dt_limit[1]"}


def _section(cfg: Config, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _float_values(obj: Any, prefix: str = ""):
    """(dotted key, value) of every float in the config, list items as key[i]."""
    for f in dataclasses.fields(obj):
        v, key = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(v):
            yield from _float_values(v, key + ".")
        elif isinstance(v, float):
            yield key, v
        elif isinstance(v, list):
            yield from ((f"{key}[{i}]", x) for i, x in enumerate(v) if isinstance(x, float))


def in_run_dir(path: str, run_dir: str) -> bool:
    """Whether a run.resume path names run_dir's own checkpoints: run_dir itself, its checkpoints folder or a
    checkpoint in it (not a run moved aside into run_dir/previous-*)."""
    path, run_dir = (os.path.abspath(os.path.expanduser(x)).rstrip(os.sep) for x in (path, run_dir))
    own = os.path.join(run_dir, "checkpoints")
    return path in (run_dir, own) or path.startswith(own + os.sep)


def validate(cfg: Config) -> None:
    """Every cross-check that can fail before compute. Raises ConfigError naming the keys."""
    m, t, o, p = cfg.model, cfg.train, cfg.optim, cfg.parallel

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    # the counts the checks below divide by or build sizes from: refused first, so a zero is named, not met as a
    # ZeroDivisionError (or, for train.global_batch, only after run.dir was created)
    for key, low in _COUNTS_FIRST.items():
        section, name = key.rsplit(".", 1)
        v = getattr(_section(cfg, section), name)
        need(v is None or v >= low, f"{key} must be {'positive' if low == 1 else f'>= {low}'}, got {v}")

    # pattern
    from megassm.models.registry import block_kind

    known = block_letters()
    need(len(blocks_of(m.pattern)) > 0, f"model.pattern: '{m.pattern}' has no blocks")
    for i, c in enumerate(m.pattern):
        need(
            c in known or c in PATTERN_SEPARATORS,
            f"model.pattern: unknown letter '{c}' at position {i} of '{m.pattern}' "
            f"(known: {', '.join(f'{k} {v}' for k, v in known.items())}, | stage boundary)",
        )
    need(m.d_model > 0, f"model.d_model must be positive, got {m.d_model}")
    need(m.pad_vocab_multiple > 0, f"model.pad_vocab_multiple must be positive, got {m.pad_vocab_multiple}")
    need(m.vocab_size is None or m.vocab_size > 0, f"model.vocab_size must be positive, got {m.vocab_size}")
    letters = set(blocks_of(m.pattern))
    kinds = [block_kind(c) for c in known if c in letters]  # registry order

    for kind in kinds:  # each kind's own sections (model.mamba.*, model.attn.*, ...)
        if kind.check is not None:
            kind.check(cfg, need)
    for kind in kinds:
        c, name = kind.letter, kind.name
        need(p.cp == 1 or kind.cp is not None,
             f"parallel.cp={p.cp}: context parallelism has no plan for {name} (`{c}` in model.pattern): "
             "its state hand-off between ranks is not built (docs/seeds.md)")
        need(not t.bptt or kind.bptt is not None,
             f"train.bptt=true with {name} (`{c}` in model.pattern): the BPTT carrier "
             "(training/bptt.py) does not carry its state yet; its state object and step() support it "
             "(docs/seeds.md)")

    # training
    need(t.steps > 0, f"train.steps must be positive, got {t.steps}")
    need(t.seq_len > 0, f"train.seq_len must be positive, got {t.seq_len}")
    need(t.micro_batch > 0, f"train.micro_batch must be positive, got {t.micro_batch}")
    need(t.precision in ("auto", "bf16", "fp32"), f"train.precision must be auto, bf16 or fp32, got '{t.precision}'")
    need(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, got '{t.device}'")
    need(t.eval_interval >= 0 and t.eval_tokens >= 0,
         f"train.eval_interval and train.eval_tokens must be >= 0, got {t.eval_interval} and {t.eval_tokens}")
    need(t.log_interval > 0, "train.log_interval must be positive")
    need(t.spike_action in ("off", "skip", "rollback"),
         f"train.spike_action must be off, skip or rollback, got '{t.spike_action}'")
    need(t.spike_window >= 2,
         f"train.spike_window must be >= 2 (a standard deviation needs two steps), got {t.spike_window}")
    need(0 < t.spike_sigma < float("inf"), f"train.spike_sigma must be a finite number > 0, got {t.spike_sigma}")
    need(t.spike_min_steps is None or 2 <= t.spike_min_steps <= t.spike_window,
         f"train.spike_min_steps must be in [2, train.spike_window={t.spike_window}], got {t.spike_min_steps}")
    need(t.spike_max_rollbacks >= 0, f"train.spike_max_rollbacks must be >= 0, got {t.spike_max_rollbacks}")
    need(t.spike_action != "rollback" or cfg.run.save_interval > 0,
         "train.spike_action=rollback needs run.save_interval > 0 (the checkpoints it rolls back to)")
    need(t.straggler_interval is None or t.straggler_interval >= 0,
         f"train.straggler_interval must be >= 0 (0: off; unset: train.log_interval), got {t.straggler_interval}")
    need(0 < t.straggler_fraction < float("inf"),
         f"train.straggler_fraction must be a finite number > 0, got {t.straggler_fraction}")
    need(t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 disables clipping), got {t.grad_clip}")
    need(t.bptt_windows >= 1, f"train.bptt_windows must be >= 1, got {t.bptt_windows}")
    need(t.loss_chunk_tokens >= 0, f"train.loss_chunk_tokens must be >= 0 (0: no chunking), got {t.loss_chunk_tokens}")
    need(t.activation_checkpointing_blocks >= 0,
         f"train.activation_checkpointing_blocks must be >= 0 (0: every block), got {t.activation_checkpointing_blocks}")
    need(not t.activation_checkpointing_blocks or t.activation_checkpointing,
         f"train.activation_checkpointing_blocks={t.activation_checkpointing_blocks} needs "
         "train.activation_checkpointing=true (it says how many blocks recompute)")
    need(t.activation_checkpointing_keep in ("pair", "sum"),
         f"train.activation_checkpointing_keep must be pair or sum, got '{t.activation_checkpointing_keep}'")
    need(t.activation_checkpointing_keep == "pair" or t.activation_checkpointing,
         f"train.activation_checkpointing_keep={t.activation_checkpointing_keep} needs "
         "train.activation_checkpointing=true (it says what each checkpointed block keeps)")
    n_blocks = len(blocks_of(m.pattern))
    need(t.activation_checkpointing_blocks <= n_blocks,
         f"train.activation_checkpointing_blocks={t.activation_checkpointing_blocks} is more than the model's "
         f"{n_blocks} blocks (model.pattern)")

    # optimizer
    need(o.lr > 0, f"optim.lr must be positive, got {o.lr}")
    need(0 <= o.min_lr <= o.lr, f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}]")
    need(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    need(o.decay in ("cosine", "linear", "constant"), f"optim.decay must be cosine, linear or constant, got '{o.decay}'")
    need(o.fused in ("auto", "true", "false"), f"optim.fused must be auto, true or false, got '{o.fused}'")
    need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1,
         f"optim.beta1 and optim.beta2 must be in [0, 1), got {o.beta1} and {o.beta2}")
    need(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    need(o.eps > 0, f"optim.eps must be positive (it keeps AdamW's update finite where a gradient is 0), got {o.eps}")
    need(m.norm_eps > 0, f"model.norm_eps must be positive, got {m.norm_eps}")
    need(m.init_std >= 0, f"model.init_std must be >= 0, got {m.init_std}")
    need(m.attn.rope_theta > 0, f"model.attn.rope_theta must be positive, got {m.attn.rope_theta}")
    need(m.mamba.dt_init_floor >= 0, f"model.mamba.dt_init_floor must be >= 0, got {m.mamba.dt_init_floor}")

    # checkpoints
    r = cfg.run
    need(r.checkpoint_format in ("canonical", "sharded"),
         f"run.checkpoint_format must be canonical or sharded, got '{r.checkpoint_format}'")
    need(not r.async_save or r.checkpoint_format == "sharded",
         "run.async_save=true needs run.checkpoint_format=sharded (the canonical format gathers to rank 0 and "
         "writes synchronously)")
    need(r.keep_last >= 0, f"run.keep_last must be >= 0 (0 keeps all), got {r.keep_last}")
    need(r.wandb in ("off", "online", "offline"), f"run.wandb must be off, online or offline, got '{r.wandb}'")
    need(r.wandb == "off" or bool(r.wandb_project.strip()), "run.wandb_project must not be empty with run.wandb on")
    need(r.save_interval >= 0, f"run.save_interval must be >= 0 (0: only at the end), got {r.save_interval}")
    resume = str(r.resume).strip()
    need(not r.overwrite or resume.lower() != "auto",
         "run.overwrite=true starts a new run (the earlier one in run.dir moved aside) and run.resume=auto continues "
         "the earlier one: set only one of them")
    need(not r.overwrite or resume.lower() in ("", "none", "auto") or not in_run_dir(resume, r.dir),
         f"run.overwrite=true would move run.resume={resume} aside with the earlier run in run.dir={r.dir}: resume "
         "it without run.overwrite, or copy it out of run.dir first")

    # data
    d = cfg.data
    need(d.builtin is not None or len(d.paths) > 0,
         "data: set data.paths (shard prefixes from megassm-preprocess) or data.builtin (e.g. stdlib)")
    need(d.builtin in (None, "stdlib"), f"data.builtin must be 'stdlib' or unset, got '{d.builtin}'")
    need(d.builtin is None or not d.paths,
         f"data.builtin={d.builtin} and data.paths are both set: pass data.builtin=none to train on data.paths "
         "(or drop data.paths to train on the built-in corpus)")
    need(d.weights is None or len(d.weights) == len(d.paths),
         f"data.weights has {0 if d.weights is None else len(d.weights)} entries but data.paths has {len(d.paths)}")
    need(len(d.split) == 3 and all(x >= 0 for x in d.split) and d.split[0] > 0,
         f"data.split must be three non-negative numbers train,valid,test with train > 0, got {d.split}")
    need(d.weights is None or (all(w >= 0 for w in d.weights) and sum(d.weights) > 0),
         f"data.weights must be non-negative numbers with a positive sum, got {d.weights}")
    need(d.prefetch >= 0, f"data.prefetch must be >= 0 (0: synchronous), got {d.prefetch}")

    # parallel layout and the batch triad
    for k in ("tp", "cp", "pp"):
        need(getattr(p, k) >= 1, f"parallel.{k} must be >= 1")
    need(not p.sp or t.seq_len % (p.tp * p.cp) == 0,
         f"parallel.sp=true: train.seq_len={t.seq_len} must be divisible by parallel.tp={p.tp}"
         + (f" x parallel.cp={p.cp}" if p.cp > 1 else "") + " (sequence shards)")
    need(t.seq_len % p.cp == 0,
         f"parallel.cp={p.cp}: train.seq_len={t.seq_len} must be divisible by parallel.cp (each rank holds one "
         "contiguous slice of every sequence)")
    for kind in kinds:  # the kinds' checks against the layout (e.g. the Mamba-2 conv halo under CP)
        if kind.check_layout is not None:
            kind.check_layout(cfg, need)
    need(m.vocab_size is None or (-(-m.vocab_size // m.pad_vocab_multiple) * m.pad_vocab_multiple) % p.tp == 0,
         f"parallel.tp={p.tp} must divide the padded vocabulary (model.vocab_size rounded up to "
         f"model.pad_vocab_multiple={m.pad_vocab_multiple})")
    need(p.engine in ("ddp", "fsdp2", "deepspeed"), f"parallel.engine must be ddp, fsdp2 or deepspeed, got '{p.engine}'")
    need(p.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage must be 0..3, got {p.zero_stage}")
    need(p.bucket_mb > 0, f"parallel.bucket_mb must be > 0, got {p.bucket_mb}")
    need(p.fsdp_param_dtype in ("auto", "bf16", "fp32"),
         f"parallel.fsdp_param_dtype must be auto, bf16 or fp32, got '{p.fsdp_param_dtype}'")
    need(p.fsdp_reduce_dtype in ("fp32", "bf16"), f"parallel.fsdp_reduce_dtype must be fp32 or bf16, got '{p.fsdp_reduce_dtype}'")
    need(cfg.run.profile_step >= 0, f"run.profile_step must be >= 0, got {cfg.run.profile_step}")
    need(p.fsdp_reshard in ("block", "micro_batch", "step"),
         f"parallel.fsdp_reshard must be block, micro_batch or step, got '{p.fsdp_reshard}'")
    need(p.fsdp_prefetch >= 0, f"parallel.fsdp_prefetch must be >= 0, got {p.fsdp_prefetch}")
    need(p.fsdp_grad_sync in ("micro_batch", "step"),
         f"parallel.fsdp_grad_sync must be micro_batch or step, got '{p.fsdp_grad_sync}'")
    need(p.shard_size >= 0, f"parallel.shard_size must be >= 0 (0: shard over every data-parallel rank), got {p.shard_size}")
    need(p.gpus_per_node >= 0, f"parallel.gpus_per_node must be >= 0 (0: from the launcher), got {p.gpus_per_node}")
    need(0 < p.timeout_s < float("inf"), f"parallel.timeout_s must be a finite number of seconds > 0, got {p.timeout_s}")
    need(cfg.run.lock_stale_s >= 60, f"run.lock_stale_s must be >= 60 (twice the lock's 30 s heartbeat), got "
         f"{cfg.run.lock_stale_s}")
    ws = world_size(cfg)
    model_par = p.tp * p.cp * p.pp
    need(ws % model_par == 0,
         f"world size {ws} is not divisible by parallel.tp x parallel.cp x parallel.pp = {p.tp}x{p.cp}x{p.pp}")
    dp = ws // model_par
    need(p.shard_size == 0 or p.engine == "fsdp2",
         f"parallel.shard_size={p.shard_size} needs parallel.engine=fsdp2 (HSDP: FSDP2 sharding inside groups of "
         f"shard_size data-parallel ranks, replicas across them); the {p.engine} engine has no shard groups")
    need(p.fsdp_grad_sync == "micro_batch" or p.engine == "fsdp2",
         f"parallel.fsdp_grad_sync={p.fsdp_grad_sync} needs parallel.engine=fsdp2")
    need(p.shard_size == 0 or (p.shard_size <= dp and dp % p.shard_size == 0),
         f"parallel.shard_size={p.shard_size} must divide the {dp} data-parallel ranks (world size {ws} / "
         f"(parallel.tp x parallel.cp x parallel.pp = {model_par})): each shard group is shard_size ranks, the "
         f"groups replicate, so data-parallel ranks = shard_size x replicas")
    need(p.gpus_per_node == 0 or ws <= p.gpus_per_node or ws % p.gpus_per_node == 0,
         f"parallel.gpus_per_node={p.gpus_per_node} must divide the world size {ws} (whole nodes)")
    need(t.global_batch % (t.micro_batch * dp) == 0,
         f"batch triad: train.global_batch={t.global_batch} must be a multiple of "
         f"train.micro_batch x data-parallel ranks = {t.micro_batch} x {dp}")
    n_stages = m.pattern.count("|") + 1
    need(p.pp_schedule in ("1f1b", "gpipe"), f"parallel.pp_schedule must be 1f1b or gpipe, got '{p.pp_schedule}'")
    need(p.pp_virtual >= 1, f"parallel.pp_virtual must be >= 1, got {p.pp_virtual}")
    need(p.pp_virtual == 1 or p.pp > 1, f"parallel.pp_virtual={p.pp_virtual} needs parallel.pp > 1")
    pipe = p.pp * p.pp_virtual
    need(p.pp == 1 or n_stages in (1, pipe),
         f"model.pattern has {n_stages} stages (cut by '|') but parallel.pp x parallel.pp_virtual = {pipe}")
    need(pipe == 1 or n_stages == 1 or all(blocks_of(st) for st in m.pattern.split("|")),
         f"model.pattern '{m.pattern}': every pipeline stage (between '|') needs at least one block")
    need(pipe == 1 or len(blocks_of(m.pattern)) >= pipe,
         f"model.pattern has {len(blocks_of(m.pattern))} blocks, fewer than the parallel.pp x parallel.pp_virtual "
         f"= {pipe} pipeline stages")
    accum = t.global_batch // max(t.micro_batch * dp, 1)
    rounds = max(1, accum // p.pp)
    need(p.pp_virtual == 1 or p.pp_schedule != "1f1b" or accum % rounds == 0,
         f"parallel.pp_virtual={p.pp_virtual} (interleaved 1F1B): the {accum} micro-batches of a step "
         f"(train.global_batch / (train.micro_batch x data-parallel ranks)) must be a multiple of "
         f"max(1, micro-batches // parallel.pp) = {rounds}")

    # last, so a key's own check (its range, with why) speaks first: any float still infinite or NaN here (e.g.
    # optim.lr=inf passes lr > 0) would fail only once training computes with it
    for key, v in _float_values(cfg):
        need(math.isfinite(v) or (key in _MAY_BE_INF and v == math.inf), f"{key} must be a finite number, got {v}")

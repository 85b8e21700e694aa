"""The config's sections: one dataclass per YAML section, each field with its default and a comment saying what it
means (docs/config.md is the table a user reads)."""
from __future__ import annotations

from dataclasses import dataclass, field


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

"""train.cuda_graph: the config refusals (CPU) and, on the device (`-m gpu`), graph replays training exactly
like the eager loop: losses and final weights, with gradient accumulation, document resets and a resume."""
import pytest
import torch

from megassm.config import ConfigError, load_config
from megassm.training.trainer import Trainer, check_supported

TINY = [
    "data.builtin=stdlib",
    "model.d_model=64",
    "model.mamba.d_state=16",
    "model.mamba.headdim=16",
    "model.mamba.chunk_size=16",
    "model.mlp.ffn_hidden=128",
    "train.seq_len=80",  # not a multiple of the chunk; packed documents give resets inside rows
    "train.micro_batch=2",
    "train.global_batch=4",  # two accumulated micro-batches per step
    "train.log_interval=1",
    "train.eval_interval=3",
    "train.eval_batches=2",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "run.progress=false",
]


def _cfg(run_dir, *extra, pattern="M-M-"):
    return load_config(None, TINY + [f"model.pattern={pattern}", f"run.dir={run_dir}", *extra])


@pytest.mark.parametrize("extra, pattern, match", [
    ((), "M*M-", r"model.pattern='M\*M-' has block\(s\) '\*'"),
    ((), "MBM-", "'B'"),
    (("train.bptt=true",), "M-M-", "train.bptt"),
    (("train.activation_checkpointing=true",), "M-M-", "train.activation_checkpointing"),
])
def test_cuda_graph_refuses_what_a_capture_cannot_hold(tmp_path, extra, pattern, match):
    cfg = _cfg(tmp_path, "train.cuda_graph=true", *extra, pattern=pattern)
    with pytest.raises(ConfigError, match="train.cuda_graph=true: .*" + match):
        check_supported(cfg)


def test_cuda_graph_refuses_model_parallel_and_sharding_engines(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"train.cuda_graph=true: parallel.tp=2"):
        check_supported(_cfg(tmp_path, "train.cuda_graph=true", "parallel.tp=2"))
    with pytest.raises(ConfigError, match=r"train.cuda_graph=true: parallel.engine=fsdp2"):
        check_supported(_cfg(tmp_path, "train.cuda_graph=true", "parallel.world_size=2", "parallel.engine=fsdp2"))
    check_supported(_cfg(tmp_path, "train.cuda_graph=true", "parallel.world_size=2"))  # DDP: flat all-reduce after replays


def test_cuda_graph_needs_a_cuda_device_before_any_model_is_built(tmp_path):
    with pytest.raises(ConfigError, match="needs a CUDA device; this run uses cpu"):
        Trainer(_cfg(tmp_path, "train.cuda_graph=true", "train.device=cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["M-M-", "MSL-"])
def test_cuda_graph_trains_like_the_eager_loop(tmp_path, pattern):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    common = ("train.steps=6", "train.precision=fp32", "run.save_interval=3")
    eager = Trainer(_cfg(tmp_path / "eager", *common, pattern=pattern))
    eager_losses = eager.fit()
    graphed = Trainer(_cfg(tmp_path / "graph", *common, "train.cuda_graph=true", pattern=pattern))
    graph_losses = graphed.fit()
    assert graphed.graphed is not None and graphed.graphed.graph is not None
    torch.testing.assert_close(torch.tensor(graph_losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(eager.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
    # stopped after 3 steps and resumed: the resumed trainer captures a new graph and continues exactly
    first = Trainer(_cfg(tmp_path / "cut", *common, "train.cuda_graph=true", pattern=pattern))
    first.cfg.train.steps = 3
    head = first.fit()
    resumed = Trainer(_cfg(tmp_path / "cut", *common, "train.cuda_graph=true", "run.resume=auto", pattern=pattern))
    assert resumed.step == 3
    torch.testing.assert_close(torch.tensor(head + resumed.fit()), torch.tensor(graph_losses), rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_cuda_graph_bf16_trains_close_to_eager(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    eager = Trainer(_cfg(tmp_path / "e", "train.steps=6")).fit()
    graph = Trainer(_cfg(tmp_path / "g", "train.steps=6", "train.cuda_graph=true")).fit()
    torch.testing.assert_close(torch.tensor(graph), torch.tensor(eager), rtol=1e-3, atol=1e-4)

"""The Megatron-LM bridge (megassm/interop/megatron.py, `megassm-checkpoint convert --to megatron` / Megatron ->
`--to canonical`), checked against megatron-core itself on the CPU: its MambaModel (local layers) is built from the
arguments a converted checkpoint records, loads the checkpoint with its own dist_checkpointing (resharding to another
TP degree), runs its forward with mamba_ssm's two kernels replaced by the fp64 stand-ins of tests/megatron_cpu.py (the
TEST-ONLY shim: what it replaces and why), and writes its own checkpoint, which converts back bit for bit."""
from __future__ import annotations

import contextlib
import json
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_cpu as mc  # noqa: E402
from compare import randomize_, rel  # noqa: E402
from multiproc import spawn  # noqa: E402

from megassm import checkpoint_cli  # noqa: E402
from megassm.config import AttentionConfig, Config, MambaConfig, MLPConfig, ModelConfig, dump_config  # noqa: E402
from megassm.interop import mapping  # noqa: E402
from megassm.interop import megatron as mg  # noqa: E402
from megassm.interop.sources import checkpoint_config  # noqa: E402
from megassm.models import build_model  # noqa: E402
from megassm.training import checkpoint as ckpt  # noqa: E402

TOL = 1e-4  # fp32 logits, relative (Frobenius)

# A: GQA attention with RoPE, SwiGLU, untied head, 2 Mamba groups (TP 2 splits them)
CFG_A = ModelConfig(pattern="M*-M", d_model=64, vocab_size=200, pad_vocab_multiple=64, tie_embeddings=False,
                    mamba=MambaConfig(d_state=16, headdim=16, ngroups=2, chunk_size=16),
                    attn=AttentionConfig(n_heads=4, n_kv_heads=2), mlp=MLPConfig(ffn_hidden=128))
# B: Nemotron-H's choices (no positional encoding, squared ReLU) plus what only MambaMixer's spec params express (D per
# channel, conv width 3), biases (add_bias_linear), a tied head, one group, MHA
CFG_B = ModelConfig(pattern="M-*M", d_model=32, vocab_size=100, pad_vocab_multiple=32, tie_embeddings=True,
                    mamba=MambaConfig(d_state=8, headdim=8, ngroups=1, d_conv=3, D_has_hdim=True, chunk_size=8),
                    attn=AttentionConfig(n_heads=2, rope=False, bias=True),
                    mlp=MLPConfig(ffn_hidden=64, activation="relu2", bias=True))


def _checkpoint(tmp_path, m: ModelConfig, seed: int = 3) -> tuple[str, torch.nn.Module]:
    """A megassm checkpoint of `m` whose every parameter is off its init (no unit norm, no zero bias)."""
    model = build_model(m)
    model.init_weights(seed)
    randomize_(model.named_parameters(), seed=seed, scale=0.3)
    path = ckpt.save_checkpoint(tmp_path / "run", 7, model=model, optimizer=None,
                                extra={"config": dump_config(Config(model=m))})
    return path, model


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@contextlib.contextmanager
def _one_process_megatron():
    """This process as a one-rank gloo group with megatron's parallel_state (TP 1) and the CPU shim; torn down after."""
    from megatron.core import parallel_state

    with mg._process_group(), mc.cpu_shim():
        mc.init_megatron(1)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def _megatron_load(model, release_dir: str) -> None:
    """Megatron's own load of a torch_dist checkpoint into `model` (its default strictness), then a strict
    load_state_dict: every parameter of megatron's model comes from the checkpoint."""
    from megatron.core import dist_checkpointing

    sharded = model.sharded_state_dict()
    loaded = dist_checkpointing.load(sharded, release_dir)
    model.load_state_dict({k: v for k, v in loaded.items() if k in sharded}, strict=True)


@pytest.mark.parametrize("m", [CFG_A, CFG_B], ids=["gqa-rope-swiglu", "relu2-tied-bias-Dhdim"])
def test_megatron_mambamodel_loads_our_checkpoint_with_our_logits(tmp_path, m):
    """megassm -> torch_dist; megatron-core's MambaModel, built from the checkpoint's own Megatron-LM arguments, loads
    it and its forward gives our logits (fp32, a length not a multiple of the SSD chunk)."""
    src, model = _checkpoint(tmp_path, m)
    out = checkpoint_cli.convert(src, str(tmp_path / "mg"), "megatron")
    assert open(os.path.join(out, mg.TRACKER)).read() == "release"
    from megatron.core import dist_checkpointing

    tokens = torch.randint(0, m.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
    with _one_process_megatron():
        args = dist_checkpointing.load_common_state_dict(os.path.join(out, "release"))["args"]
        mm = mc.build_from_args(args)
        _megatron_load(mm, os.path.join(out, "release"))
        theirs = mc.megatron_logits(mm, tokens)
    ours = model(tokens).logits
    assert theirs.shape == ours.shape
    assert rel(theirs, ours) <= TOL, rel(theirs, ours)


def test_round_trips_are_bit_identical_across_formats_and_tp(tmp_path):
    """ours -> legacy at TP 2 -> ours -> torch_dist -> ours -> legacy at TP 1 -> ours: the same tensors, and the config
    read back from Megatron-LM's arguments describes the same model."""
    src, model = _checkpoint(tmp_path, CFG_A)
    want = ckpt.read_model_state(src)
    cur = src
    for i, (fmt, tp) in enumerate([("legacy", 2), ("torch_dist", 1), ("legacy", 1)]):
        mgd = checkpoint_cli.convert(cur, str(tmp_path / f"mg{i}"), "megatron", tp=tp, megatron_format=fmt)
        cur = checkpoint_cli.convert(mgd, str(tmp_path / f"back{i}"), "canonical")
        _same(want, ckpt.read_model_state(cur))
        back = checkpoint_config(cur, "test").model
        assert mapping.config_differences(back, CFG_A, mapping.FOREIGN_KEYS) == []
        meta = json.load(open(os.path.join(cur, ckpt.META)))
        assert meta["converted_from"] == f"megatron-{fmt}" and meta["megatron_tp"] == tp
    assert sorted(os.listdir(os.path.join(tmp_path, "mg0", "release"))) == ["mp_rank_00", "mp_rank_01"]
    # what a reader of megassm checkpoints does with it: the model loads strictly
    build_model(back).load_state_dict(ckpt.read_model_state(cur), strict=True)


def _tp2_rank(rank, world, release_dir, legacy_dir, tokens, save_dir):
    """One of two TP ranks: megatron-core's MambaModel at TP 2 loads the TP-agnostic checkpoint, its local slices are
    compared with the legacy file of the same rank, its forward (all-reduces over gloo) gives logits, and megatron's
    own writer saves it again."""
    from megatron.core import dist_checkpointing

    with mc.cpu_shim():
        mc.init_megatron(world)
        args = dist_checkpointing.load_common_state_dict(release_dir)["args"]
        mm = mc.build_from_args(args, tp=world)
        _megatron_load(mm, release_dir)
        legacy = torch.load(os.path.join(legacy_dir, f"mp_rank_{rank:02d}", mg.LEGACY_FILE), weights_only=False)
        mismatched = []
        local = {}
        for k, v in mm.state_dict().items():
            if k.endswith("_extra_state"):
                continue
            k = mc.te_name(k)
            local[k] = v
            if k not in legacy["model"] or not torch.equal(legacy["model"][k], v):
                mismatched.append(k)
        tensors = {k for k, v in legacy["model"].items() if isinstance(v, torch.Tensor)}
        # the legacy file's names are the module state dict's (the TE spec's attention also keeps core_attention's
        # _extra_state, which megatron's local DotProductAttention does not have)
        names = {mc.te_name(k) for k in mm.state_dict()}
        legacy_names = {k for k in legacy["model"] if not k.endswith("core_attention._extra_state")}
        logits = mc.megatron_logits(mm, tokens)
        os.makedirs(save_dir, exist_ok=True)
        # as Megatron-LM's save_checkpoint lays it out: the arguments and version beside the model's sharded state
        dist_checkpointing.save({"args": args, "checkpoint_version": 3.0, "iteration": 0,
                                 "model": mm.sharded_state_dict()}, save_dir)
    return {"mismatched": mismatched, "extra": sorted(tensors - set(local)), "logits": logits,
            "names": sorted(names ^ legacy_names)}


def test_tp2_megatron_reshards_our_checkpoint_matches_legacy_slices_and_writes_back(tmp_path):
    """A checkpoint converted for TP 1 loads into megatron-core's MambaModel at TP 2 (two gloo ranks): each rank's
    slices equal our legacy TP-2 files bit for bit, the TP-2 forward gives our logits, and the checkpoint megatron
    itself writes at TP 2 converts back to our exact weights."""
    src, model = _checkpoint(tmp_path, CFG_A)
    dist_dir = checkpoint_cli.convert(src, str(tmp_path / "dist"), "megatron")  # written for TP 1
    legacy_dir = checkpoint_cli.convert(src, str(tmp_path / "legacy"), "megatron", tp=2, megatron_format="legacy")
    tokens = torch.randint(0, CFG_A.vocab_size, (2, 29), generator=torch.Generator().manual_seed(1))
    saved = tmp_path / "megatron-saved"
    ranks = spawn(_tp2_rank, 2, os.path.join(dist_dir, "release"), os.path.join(legacy_dir, "release"), tokens,
                  str(saved), timeout=300)
    for r in ranks:
        assert r["mismatched"] == [] and r["extra"] == [] and r["names"] == [], r
    ours = model(tokens).logits
    assert rel(ranks[0]["logits"], ours) <= TOL and rel(ranks[1]["logits"], ours) <= TOL
    back = checkpoint_cli.convert(str(saved), str(tmp_path / "back"), "canonical")
    _same(ckpt.read_model_state(src), ckpt.read_model_state(back))


@pytest.mark.parametrize("extra, words", [
    ({"pattern": "MSM"}, ["block 1 'S'", "no counterpart"]),
    ({"mamba": MambaConfig(d_state=16, headdim=16, ngroups=2, norm_before_gate=True, dt_limit=[0.0, 0.5])},
     ["norm_before_gate", "dt_limit"]),
    ({"attn": AttentionConfig(n_heads=4, n_kv_heads=2, bias=True)}, ["add_bias_linear"]),
])
def test_refusals_name_the_reason_and_write_nothing(tmp_path, capsys, extra, words):
    import dataclasses

    m = dataclasses.replace(CFG_A, **extra)
    src, _ = _checkpoint(tmp_path, m)
    out = tmp_path / "mg"
    rc = checkpoint_cli.main(["convert", "--input", src, "--output", str(out), "--to", "megatron"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and all(w in err[0] for w in words), err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


def test_tp_that_megatron_cannot_split_is_refused(tmp_path, capsys):
    src, _ = _checkpoint(tmp_path, CFG_A)
    rc = checkpoint_cli.main(["convert", "--input", src, "--output", str(tmp_path / "mg"), "--to", "megatron",
                              "--tp", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "--tp 4 must divide" in err
    assert "model.mamba.ngroups, which MambaMixer splits and never replicates (2)" in err
    assert not (tmp_path / "mg").exists()


def test_missing_megatron_core_is_named(tmp_path, monkeypatch, capsys):
    src, _ = _checkpoint(tmp_path, CFG_A)
    monkeypatch.setitem(sys.modules, "megatron.core", None)  # import megatron.core -> ImportError
    rc = checkpoint_cli.main(["convert", "--input", src, "--output", str(tmp_path / "mg"), "--to", "megatron"])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install megatron-core" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "mg").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


def test_config_that_disagrees_with_the_checkpoint_arguments_is_refused(tmp_path, capsys):
    import dataclasses

    src, _ = _checkpoint(tmp_path, CFG_A)
    out = checkpoint_cli.convert(src, str(tmp_path / "mg"), "megatron")
    other = tmp_path / "other.yaml"
    other.write_text(dump_config(Config(model=dataclasses.replace(CFG_A, attn=AttentionConfig(n_heads=4, n_kv_heads=2,
                                                                                               rope=False)))))
    rc = checkpoint_cli.main(["convert", "--input", out, "--output", str(tmp_path / "back"), "--to", "canonical",
                              "--config", str(other)])
    err = capsys.readouterr().err
    assert rc == 2 and "model.attn.rope: True in the checkpoint, False in --config" in err
    assert not (tmp_path / "back").exists()

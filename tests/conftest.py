import importlib.util
import os

import pytest

# Multi-rank tests build their process groups with the plain torch.distributed builder: importing
# megatron-core costs each rank ~2 s of CPU, and the suite starts a few hundred ranks on CI's two cores.
# test_parallel_tp.py::test_megatron_groups_on_gloo_match_layout checks that megatron-core gives the same
# groups for every layout, and the tests that call use_megatron_groups run end to end through it.
# `MEGASSM_PROCESS_GROUPS=megatron pytest` runs the whole suite through megatron-core.
os.environ.setdefault("MEGASSM_PROCESS_GROUPS", "torch")


def use_megatron_groups(monkeypatch):
    """This test's ranks build their groups with megatron-core's parallel_state (skipped without it)."""
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    monkeypatch.setenv("MEGASSM_PROCESS_GROUPS", "megatron")


@pytest.fixture(scope="session", autouse=True)
def _megassm_cache(tmp_path_factory):
    """One builtin-corpus cache per test session, never the user's ~/.cache."""
    if "MEGASSM_CACHE" not in os.environ:
        os.environ["MEGASSM_CACHE"] = str(tmp_path_factory.mktemp("megassm-cache"))
    yield

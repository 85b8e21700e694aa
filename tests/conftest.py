import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _megassm_cache(tmp_path_factory):
    """One builtin-corpus cache per test session, never the user's ~/.cache."""
    if "MEGASSM_CACHE" not in os.environ:
        os.environ["MEGASSM_CACHE"] = str(tmp_path_factory.mktemp("megassm-cache"))
    yield

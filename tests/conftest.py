import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _megassm_cache(tmp_path_factory):
    """One builtin-corpus cache per test session, never the user's ~/.cache."""
    if "MEGASSM_CACHE" not in os.environ:
        os.environ["MEGASSM_CACHE"] = str(tmp_path_factory.mktemp("megassm-cache"))
    yield


def pytest_collection_modifyitems(config, items):
    """The tests marked slow (30-90 s each on CI's 2 cores) first: pytest-xdist hands tests out in this order,
    so a long one left for the end would keep one worker busy while the other idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

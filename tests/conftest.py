import matplotlib
import pytest
import torch

matplotlib.use("Agg")  # tests draw figures without a screen


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run only where torch sees a GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_edurl_device_env(monkeypatch):
    """A developer's EDURL_DEVICE must not change what the unit tests see."""
    monkeypatch.delenv("EDURL_DEVICE", raising=False)
    yield

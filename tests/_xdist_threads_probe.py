"""Run only by tests/test_utils.py, in a pytest -n 2 subprocess: what conftest.py gave this worker."""

import os


def test_worker_thread_cap():
    assert os.environ.get("EDURL_MAX_THREADS") == os.environ["PROBE_EXPECT"], os.environ.get("EDURL_MAX_THREADS")

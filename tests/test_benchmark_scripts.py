"""The benchmark scripts that need no peer library still run: a few steps of each, as a subprocess.

Benchmarks are run by hand, so a change to the library's internals can break one silently: in stop 33
``_stack_update`` lost its ``alive`` argument and ``benchmarks/ppo_update_profile.py`` crashed until the next
session ran it.
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ppo_update_profile_runs():
    proc = subprocess.run(
        [sys.executable, "benchmarks/ppo_update_profile.py", "--steps", "3", "--warmup", "1", "--seeds", "1,2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "seed stack, 2 seed(s)" in proc.stdout and "optimizer.step" in proc.stdout

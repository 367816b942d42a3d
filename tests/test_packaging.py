"""The two ways to install (pip with pyproject.toml, conda with environment.yml) ask for the same packages,
and the README, Makefile and CI agree on the commands."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name


def _split(requirement: str) -> tuple[str, str]:
    name, spec = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", requirement).groups()
    return name.lower().replace("_", "-"), spec.replace(" ", "")


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = [
        r for r in project["dependencies"] + project["optional-dependencies"]["dev"] if "python_version" not in r
    ]  # backports for old Pythons; conda ships a new enough Python
    pip_side = dict(_split(r) for r in wanted)

    env = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    conda_side = {}
    for dep in env["dependencies"]:
        if isinstance(dep, dict):  # the pip section: edurl itself, last, and packages conda-forge lacks
            assert dep["pip"][-1] == "-e .", "environment.yml installs edurl itself with `pip: [..., -e .]`"
            conda_side.update(_split(r) for r in dep["pip"][:-1])
            continue
        name, spec = _split(dep)
        if name in ("python", "pip"):
            continue
        conda_side[CONDA_NAMES.get(name, name)] = spec
    assert conda_side == pip_side


def test_python_floor_is_the_same():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    assert project["requires-python"] == ">=3.10"
    assert "python>=3.10" in env["dependencies"]


def test_readme_makefile_and_ci_agree():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for command in ("make lab", "make test", 'pip install -e ".[dev]"'):
        assert command in readme, f"README must show `{command}`"
    assert re.search(r"^lab:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "jupyter lab notebooks/" in makefile and "ipykernel install" in makefile
    assert "--nbval-lax" in makefile and "torch==2.13.0" in makefile
    assert "make test" in ci and "mktemp -d" in ci


def test_the_local_server_launcher_imports_without_the_tinker_sdk():
    """Notebook 7 imports LocalServer before it checks for the SDK (which needs Python >= 3.11); only the app
    itself needs the SDK's wire schema, and says so."""
    import subprocess

    block = "import sys; sys.modules['tinker'] = None; "  # as if the SDK were not installed
    ok = subprocess.run(
        [sys.executable, "-c", block + "from edurl.serve.launch import LocalServer; import edurl.serve.__main__"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    app = subprocess.run(
        [sys.executable, "-c", block + "from edurl.serve import create_app"], capture_output=True, text=True
    )
    assert app.returncode != 0 and "pip install -e '.[tinker]'" in app.stderr


@pytest.mark.skipif(shutil.which("make") is None or not hasattr(os, "sched_getaffinity"), reason="needs make and Linux")
def test_make_gives_each_test_worker_cores_over_workers_threads_whatever_omp_says():
    """GNU nproc obeys OMP_NUM_THREADS, so with OMP_NUM_THREADS=8 exported, make test once gave each of 2 workers
    4 threads on a 2-core machine (and warm-start cache keys that conftest.py's cap does not give)."""
    cores = len(os.sched_getaffinity(0))
    outer = ("MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL", "TEST_THREADS", "PYTEST_WORKERS")  # make test X=1
    env = {k: v for k, v in os.environ.items() if k not in outer} | {"OMP_NUM_THREADS": "8", "OMP_THREAD_LIMIT": "8"}
    dry = subprocess.run(["make", "-n", "unit"], cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    assert f"EDURL_MAX_THREADS={max(1, cores // 2)} " in dry, dry

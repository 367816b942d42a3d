"""edurl.llm._compat: a torch that the installed transformers has switched off is named at import, with the fix."""

import subprocess
import sys


def test_a_torch_that_transformers_switched_off_is_named_at_import():
    # transformers >= 5.20 switches off its PyTorch side below torch 2.6, and pip installs it beside torch 2.4
    # anyway; `import edurl.llm` then failed with "NameError: name 'nn' is not defined" inside transformers
    code = (
        "import transformers.utils as u\n"
        "u.is_torch_available = lambda: False  # what transformers reports for a torch older than it supports\n"
        "import edurl.llm\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ImportError: transformers" in proc.stderr and "cannot use this torch" in proc.stderr
    assert "pip install -U torch" in proc.stderr

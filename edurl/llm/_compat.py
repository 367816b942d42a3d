"""Checks, at import, that the installed transformers can run the LLM half of the course.

Recent transformers releases switch off their PyTorch side when torch is older than they support, and the first
model class then fails with a NameError deep inside transformers. pip cannot see the conflict (transformers does
not declare torch as a dependency), so this module names it, with the ways out, before anything else is imported.
"""

from __future__ import annotations

import torch
import transformers
import transformers.utils


def require_torch_in_transformers() -> None:
    """Raise ImportError when this transformers has switched off its PyTorch models for this torch."""
    if not transformers.utils.is_torch_available():
        raise ImportError(
            f"transformers {transformers.__version__} cannot use this torch ({torch.__version__}): it switches off "
            "its PyTorch models for torch versions older than it supports, and edurl.llm needs them. Upgrade torch "
            "(pip install -U torch), or install a transformers release that supports your torch (edurl needs "
            "transformers 4.56 or later)."
        )


require_torch_in_transformers()

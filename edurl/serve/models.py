"""The base models edurl.serve trains and samples: the course's own checkpoint by name, or any local folder."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from edurl.utils import device as default_device

TINY_ARITHMETIC = "edurl/tiny-arithmetic"


class ModelRegistry:
    """Loads each base model once and hands out ``(model, tokenizer, tokenizer_id)``.

    - ``edurl/tiny-arithmetic`` is Chapter 6's SFT checkpoint (``load_or_train_sft()``), trained and cached on
      first use (about 1.5 minutes on 2 CPU cores).
    - Any other name is a folder written by ``save_pretrained`` (a Hugging Face checkpoint), or a hub id whose
      files are already in the local cache.

    ``tokenizer_id`` is what the server reports in ``get_info``: the checkpoint's folder where there is one, so
    that the SDK's ``get_tokenizer()`` (``AutoTokenizer.from_pretrained(tokenizer_id)``) works offline.
    Training clients copy the base model, so one loaded base serves every session.
    """

    def __init__(self, device: str | torch.device | None = None, progress: bool = True):
        self.device = device if device is not None else default_device()
        self.progress = progress
        self._loaded: dict[str, tuple] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return [TINY_ARITHMETIC, *[n for n in self._loaded if n != TINY_ARITHMETIC]]

    def load(self, name: str):
        with self._lock:
            if name not in self._loaded:
                self._loaded[name] = self._load(name)
            return self._loaded[name]

    def _load(self, name: str):
        if name == TINY_ARITHMETIC:
            from edurl.llm.sft import SFTConfig, load_or_train_sft

            model, tokenizer, _, path = load_or_train_sft(SFTConfig(device=str(self.device)), progress=self.progress)
            return model.to(self.device).eval(), tokenizer, str(Path(path).resolve())
        from edurl.llm.policy import load_policy

        try:
            model, tokenizer = load_policy(name, device=self.device)
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(
                f"unknown base_model {name!r}: use {TINY_ARITHMETIC!r} or the folder of a Hugging Face checkpoint "
                f"on the server's machine ({exc})"
            ) from None
        path = Path(name).expanduser()
        return model, tokenizer, str(path.resolve()) if path.is_dir() else name

"""The LLM half of the course: a tiny LM as a policy (Chapter 6) and GRPO (Chapter 7).

Modules, in the order Chapter 6 teaches them:

* ``tokenizer``  -- a character-level tokenizer with a ChatML chat template
* ``model``      -- a tiny Qwen2/Llama decoder built from transformers' own code
* ``tasks``      -- synthetic arithmetic with verifiable answers; JSONL for your own data
* ``rewards``    -- ``correct + 0.1 * (format - 1)``
* ``renderer``   -- messages <-> token ids, stop sequences, parsing replies
* ``sampling``   -- batched KV-cache sampling with per-token log-probs
* ``datum``      -- the training datum: model input, targets, log-probs, advantages
* ``sft``        -- the supervised warm start, cached on disk
* ``policy``     -- ``load_policy`` for any Hugging Face causal LM, optionally with LoRA
"""

from .datum import Datum, ModelInput, build_datum, build_supervised_datum
from .evaluation import EvalResult, evaluate, sequence_logprobs
from .model import TinyLMConfig, build_tiny_lm, num_parameters
from .policy import LoraSettings, load_policy
from .renderer import ChatMLRenderer
from .rewards import Grade, extract_boxed, grade
from .sampling import Completion, SamplingParams, sample
from .sft import SFTConfig, load_or_train_sft, train_sft
from .tasks import ArithmeticTask, JsonlTask, Problem
from .tokenizer import build_char_tokenizer

__all__ = [
    "ArithmeticTask", "ChatMLRenderer", "Completion", "Datum", "EvalResult", "Grade", "JsonlTask", "LoraSettings",
    "ModelInput", "Problem", "SFTConfig", "SamplingParams", "TinyLMConfig", "build_char_tokenizer", "build_datum",
    "build_supervised_datum", "build_tiny_lm", "evaluate", "extract_boxed", "grade", "load_or_train_sft", "load_policy",
    "num_parameters", "sample", "sequence_logprobs", "train_sft",
]

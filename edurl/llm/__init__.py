"""The LLM half of the course: a tiny LM as a policy (Chapter 6), GRPO (Chapter 7), RLHF (Chapter 8), and
multi-turn environments and tools (Chapter 9).

Modules, in the order the chapters teach them:

* ``tokenizer``      -- a character-level tokenizer with a ChatML chat template
* ``model``          -- a tiny Qwen2/Llama decoder built from transformers' own code
* ``tasks``          -- synthetic arithmetic with verifiable answers; JSONL for your own data
* ``rewards``        -- ``correct + 0.1 * (format - 1)``
* ``renderer``       -- messages <-> token ids, stop sequences, parsing replies
* ``padding``        -- one ``pad`` for every batch (left for sampling, right for training)
* ``sampling``       -- batched KV-cache sampling with per-token log-probs
* ``datum``          -- the training datum: model input, targets, log-probs, advantages, mask
* ``evaluation``     -- greedy pass@1 and format rate on held-out problems
* ``policy``         -- ``load_policy`` for any Hugging Face causal LM, optionally with LoRA
* ``sft``            -- the supervised warm start, cached on disk, and GRPO's step-matched SFT baseline
* ``temperature``    -- next-token distributions and group diversity by sampling temperature
* ``losses``         -- ``rl_objective``: per-token losses, aggregation, KL, group advantages (Chapter 7)
* ``shared_prefix``  -- training log-probs that run a group's shared prompt once
* ``clients``        -- Tinker-style ``ServiceClient`` / ``TrainingClient`` / ``SamplingClient``
* ``loop``           -- the loop around a step: resume, evaluation, metrics.jsonl, checkpoints
* ``grpo``           -- ``GRPOConfig``, ``grpo_step`` and ``train_grpo``
* ``length_bias``    -- GRPO's length bias in a run on a three-logit policy (Chapter 7, section 4)
* ``preference``     -- RLHF: simulated raters, reward models, DPO (Chapter 8)
* ``envs``           -- multi-turn environments, rollouts and episodes as datums; guess-the-number, a calculator
* ``multiturn``      -- the game warm starts and GRPO over whole episodes (Chapter 9)
* ``off_policy``     -- a sampler k steps ahead of the trainer, in a thread of its own (Chapter 10)
* ``offline``        -- a buffer of logged rollouts, and training from it alone with DRO (Chapter 10)
* ``distributed``    -- data-parallel GRPO under torchrun: ranks, shares of the loss, summed gradients (Chapter 10)

The reader's path through GRPO is two files, read downwards: ``grpo.grpo_step`` then ``losses.rl_objective``.
Every submodule is imported here, so ``llm.grpo.train_grpo`` works after ``from edurl import llm`` alone.
"""

from edurl.llm import (
    _compat,  # noqa: F401  (first: it names a torch that this transformers cannot use, before anything fails)
    clients,
    datum,
    distributed,
    envs,
    evaluation,
    grpo,
    length_bias,
    loop,
    losses,
    model,
    multiturn,
    off_policy,
    offline,
    padding,
    policy,
    renderer,
    rewards,
    sampling,
    sft,
    shared_prefix,
    tasks,
    temperature,
    tokenizer,
)
from edurl.llm.clients import AdamParams, SamplingClient, ServiceClient, TrainingClient
from edurl.llm.datum import Datum, ModelInput, build_datum, build_datums, build_supervised_datum
from edurl.llm.evaluation import EvalResult, evaluate, sequence_logprobs
from edurl.llm.grpo import GRPOConfig, GRPOResult, Rollout, collect, grpo_step, train_grpo, update
from edurl.llm.loop import make_training_client, problem_seed
from edurl.llm.losses import aggregate, group_advantages, rl_objective
from edurl.llm.model import TinyLMConfig, build_tiny_lm, num_parameters
from edurl.llm.offline import RolloutBuffer, collect_buffer, train_offline
from edurl.llm.padding import pad
from edurl.llm.policy import LoraSettings, load_policy
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.rewards import Grade, extract_boxed, grade
from edurl.llm.sampling import Completion, PrefixCache, SamplingParams, sample
from edurl.llm.sft import SFTConfig, continued_sft, load_or_train_sft, train_sft
from edurl.llm.tasks import ArithmeticTask, JsonlTask, Problem, TaskConfig, make_problem
from edurl.llm.tokenizer import build_bpe_tokenizer, build_char_tokenizer

__all__ = [
    "distributed",
    "off_policy",
    "offline",
    "Rollout",
    "collect",
    "update",
    "make_training_client",
    "RolloutBuffer",
    "collect_buffer",
    "train_offline",
    # submodules
    "clients",
    "datum",
    "envs",
    "evaluation",
    "grpo",
    "length_bias",
    "loop",
    "losses",
    "model",
    "multiturn",
    "padding",
    "policy",
    "renderer",
    "rewards",
    "sampling",
    "sft",
    "shared_prefix",
    "tasks",
    "temperature",
    "tokenizer",
    # Chapter 6
    "ArithmeticTask",
    "ChatMLRenderer",
    "Completion",
    "Datum",
    "EvalResult",
    "Grade",
    "JsonlTask",
    "LoraSettings",
    "ModelInput",
    "Problem",
    "PrefixCache",
    "SFTConfig",
    "SamplingParams",
    "TaskConfig",
    "TinyLMConfig",
    "build_bpe_tokenizer",
    "build_char_tokenizer",
    "build_datum",
    "build_datums",
    "build_supervised_datum",
    "build_tiny_lm",
    "evaluate",
    "extract_boxed",
    "grade",
    "load_or_train_sft",
    "load_policy",
    "make_problem",
    "num_parameters",
    "pad",
    "sample",
    "sequence_logprobs",
    "train_sft",
    # Chapter 7
    "AdamParams",
    "GRPOConfig",
    "GRPOResult",
    "SamplingClient",
    "ServiceClient",
    "TrainingClient",
    "aggregate",
    "continued_sft",
    "group_advantages",
    "grpo_step",
    "problem_seed",
    "rl_objective",
    "train_grpo",
]

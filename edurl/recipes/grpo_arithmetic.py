"""GRPO on 2-digit addition from the Chapter 6 SFT checkpoint (Chapter 7).

    python -m edurl.recipes.grpo_arithmetic                       # defaults: about 3 minutes on 2 CPU cores
    python -m edurl.recipes.grpo_arithmetic --loss-fn ppo --num-substeps 4 --log-dir runs/ppo4
    python -m edurl.recipes.grpo_arithmetic --resume               # continue from the newest checkpoint
    python -m edurl.recipes.grpo_arithmetic --sft.num-digits 3 --loss-fn ppo   # nested fields: --sft.*
    python -m edurl.recipes.grpo_arithmetic --help                # every field, with its doc and default
    torchrun --nproc_per_node 2 -m edurl.recipes.grpo_arithmetic --num-threads 1   # data-parallel (Chapter 10)

Under torchrun each process samples and trains on its share of every batch and the gradients are summed, so a
step is the single-process step on the whole batch (see :mod:`edurl.llm.distributed`); only rank 0 prints,
plots and writes checkpoints. Give each process its own cores: ``--num-threads`` = cores / nproc_per_node.

Writes ``<log_dir>/metrics.jsonl``, ``<log_dir>/config.json``, checkpoints under ``<log_dir>/checkpoints/``
and ``<log_dir>/learning_curves.png``.
"""

import warnings
from pathlib import Path

import torch

from edurl.llm.distributed import init_world
from edurl.llm.grpo import GRPOConfig, train_grpo
from edurl.llm.loop import _check_log_dir
from edurl.llm.policy import check_model_path
from edurl.plotting import plot_grpo_metrics
from edurl.recipes._cli import parse_config, refuse, run_as_script, save_figure


def main(argv=None):
    config = parse_config(GRPOConfig, argv, data_parallel=True, save_every=50)
    if config.base_model is not None:  # a mistyped path ends here, before the task and the SFT start are built
        try:
            check_model_path(config.base_model)
        except (ValueError, FileNotFoundError) as err:
            refuse(f"--base-model: {err}")
    # a fresh run into an earlier run's checkpoints ends with the reason, not a traceback; a resume is checked by
    # train_grpo, against the config it runs (under torchrun it samples per problem)
    if not config.resume:
        try:
            with warnings.catch_warnings():  # train_grpo gives the same warnings (an earlier run's metrics) once
                warnings.simplefilter("ignore")
                _check_log_dir(config, Path(config.log_dir), "GRPO", main=False)
        except ValueError as err:
            refuse(str(err))
    result = train_grpo(config)
    world = init_world(config.device)
    if world.size > 1:
        torch.distributed.destroy_process_group()
    if not world.is_main:
        return result
    png = save_figure(plot_grpo_metrics(result.metrics), Path(config.log_dir) / "learning_curves.png", dpi=110)
    if result.start is not None:
        print(
            f"held-out pass@1: {result.start.pass_at_1:.1%} -> {result.final.pass_at_1:.1%} "
            f"({config.num_eval} test problems, greedy)"
        )
    else:
        print(f"held-out pass@1 after resuming: {result.final.pass_at_1:.1%}")
    print(f"metrics: {Path(config.log_dir) / 'metrics.jsonl'}\nlearning curves: {png}")
    return result


if __name__ == "__main__":
    run_as_script(main)

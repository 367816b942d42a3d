"""A design prototype for Chapter 8, not a peer comparison: RLHF on a warm start whose replies vary in style.

`reward_model_learnability.py` shows that a reward model cannot learn the gold rater on Chapter 6's warm start,
whose replies differ only in the boxed number. This script tries the fix proposed for Chapter 8: an SFT warm start
whose demonstrations vary in visible style, and a gold score with a visible part the reward model can learn.

* Demonstrations: an optional preamble ("", "The answer is ", "Sure! ") before ``\\boxed{answer}``, and 0-3
  trailing " ok" fillers, drawn at random per demonstration (600 SFT steps, cached under their own key).
* Gold score: closeness of the answer, ``-log(1 + |error|)`` (-4 when unparseable), plus 0.5 for "The answer is "
  and -0.5 per filler. The biased rater adds ``--length-bonus`` per character, which the fillers satisfy.
* For the gold and the biased rater: pairs from the warm start (1024 train / 256 held-out problems, 40 tokens),
  a reward model (5 epochs, lr 1e-3), its held-out accuracy as a share of the exact ceiling, then GRPO against
  it (16 problems x 8, lr 3e-4, ``--steps``) at each KL coefficient of ``--kl`` (Tinker's reward-mode penalty),
  printing the proxy and gold rewards, reply length and correctness every 10 steps (10-step means).

    python benchmarks/rlhf_prototype.py --seed 0
    python benchmarks/rlhf_prototype.py --seed 1 --kl 0,0.05,0.2

It patches ``edurl.llm.preference.gold_score`` for its own gold score, so run it as a script, never import it.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, replace

import edurl.llm.preference as P
from edurl.llm.grpo import GRPOConfig, train_grpo
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.rewards import extract_boxed, is_integer_answer
from edurl.llm.sft import SFTConfig, load_or_train_sft
from edurl.llm.tasks import ArithmeticTask, Problem

PREAMBLES = ("", "The answer is ", "Sure! ")
FILLERS = (0, 0, 1, 2, 3)


@dataclass(frozen=True)
class StyledProblem(Problem):
    style: tuple = ("", 0)
    """(preamble, number of " ok" fillers) of this problem's demonstration."""

    def demonstration(self) -> str:
        preamble, fillers = self.style
        return f"{preamble}\\boxed{{{self.answer}}}" + " ok" * fillers


class StyledTask(ArithmeticTask):
    def sample(self, n, split="train", seed=0):
        rng = random.Random(f"style-{seed}-{split}")
        return [
            StyledProblem(p.question, p.answer, (rng.choice(PREAMBLES), rng.choice(FILLERS)))
            for p in super().sample(n, split=split, seed=seed)
        ]


@dataclass
class StyledSFTConfig(SFTConfig):
    styled: int = 1
    """Marks the cache key: these checkpoints are not Chapter 6's."""

    def task(self) -> StyledTask:
        return StyledTask(num_digits=self.num_digits, ops=self.ops)


def styled_gold_score(reply: str, answer: str) -> float:
    given = extract_boxed(reply)
    if given is None or not is_integer_answer(given):
        return P.UNPARSEABLE_SCORE
    visible = (0.5 if reply.startswith("The answer is ") else 0.0) - 0.5 * reply.count(" ok")
    return -math.log1p(abs(int(given) - int(answer))) + visible


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--kl", default="0,0.05", help="comma-separated KL coefficients")
    parser.add_argument("--length-bonus", type=float, default=0.15)
    args = parser.parse_args()
    P.gold_score = styled_gold_score  # Rater.score and RewardModelReward's gold metric read the module's name

    sft = StyledSFTConfig(target_pass_at_1=None, max_steps=600)
    policy, tokenizer, _, path = load_or_train_sft(sft)
    renderer, task = ChatMLRenderer(tokenizer), sft.task()
    rm_config = P.RewardModelConfig(sft=sft, seed=args.seed, epochs=5, learning_rate=1e-3, eval_every=1000)
    for name, rater in (("gold", P.Rater()), ("biased", P.Rater(length_bonus=args.length_bonus))):
        pairs = {
            split: P.sample_pairs(
                policy, renderer, task.sample(n, split=split, seed=args.seed), rater, seed=args.seed, max_tokens=40
            )
            for split, n in (("train", 1024), ("test", 256))
        }
        data = P.PreferenceData(policy, tokenizer, str(path), rater, pairs["train"], pairs["test"])
        result = P.train_reward_model(replace(rm_config, length_bonus=rater.length_bonus), data)
        end = result.final
        print(
            f"{name} reward model: held-out accuracy {end['test/expected_accuracy'] / end['test/ceiling']:.3f} of the "
            f"ceiling (chance {0.5 / end['test/ceiling']:.3f})",
            flush=True,
        )
        for kl in (float(x) for x in args.kl.split(",")):
            config = GRPOConfig(
                sft=sft,
                seed=args.seed,
                max_steps=args.steps,
                batch_size=16,
                group_size=8,
                max_tokens=40,
                learning_rate=3e-4,
                kl_coef=kl,
                eval_every=10**6,
                num_eval=50,
                log_dir=f"runs/rlhf_prototype/{name}_kl{kl}_seed{args.seed}",
            )
            m = train_grpo(config, reward_fn=P.RewardModelReward(result.model, renderer, rater=rater)).metrics
            print(f"  GRPO against the {name} reward model, kl_coef {kl}:")
            for column in ("env/all/reward/proxy", "env/all/reward/gold", "env/all/reply_chars", "env/all/correct"):
                every_10 = m[column].rolling(10, min_periods=1).mean().iloc[::10]
                print(f"    {column:22s} " + " ".join(f"{x:6.2f}" for x in every_10), flush=True)


if __name__ == "__main__":
    main()

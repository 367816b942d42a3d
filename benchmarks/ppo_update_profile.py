"""Where one PPO optimizer step's time goes (issue 19): the phases of ``ppo_update``'s inner loop, timed apart.

The step is the one ``ppo_update`` takes, on one minibatch of the default ``PPOConfig`` (CartPole's shapes:
4 observations, 2 actions, 64x64 MLPs for the policy and the value, fused Adam as ``train_ppo`` makes it):
forward and loss, ``zero_grad``, ``backward``, ``clip_grad_norm_``, ``optimizer.step``. Each phase is timed
with ``perf_counter`` over ``--steps`` steps after ``--warmup`` more, on random inputs of the right shapes.

    python benchmarks/ppo_update_profile.py                  # 1 torch thread, 2000 timed steps
    python benchmarks/ppo_update_profile.py --threads 2 --steps 5000

Prints ms per step and each phase's share, from one run on one machine. Then the same step as ``train_ppo``
takes it now, on a seed stack (``edurl.rl.seed_stack``: one batched network for S seeds, its backward written
out by hand, per-seed clipping, Adam over the seeds' rows), for each S in ``--seeds``: ms per optimizer step,
and per seed (with ``--torch-profile``, the torch profiler's top operators of that step; with
``--head-products``, the policy head's two products as the stack computes them and transposed, beside a hidden
layer's). Last, one ``TorchCartPole.step`` for each size in ``--envs`` (5 x ``--steps`` steps).

    python benchmarks/ppo_update_profile.py --threads 2 --seeds 8 --torch-profile --head-products
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch
from _args import positive_int  # benchmarks/ is on sys.path when a script runs

from edurl.envs import TorchCartPole
from edurl.objectives import clipped_surrogate
from edurl.rl import PPOConfig
from edurl.rl.networks import CategoricalPolicy, ValueNet
from edurl.rl.ppo import PPOBatch, _stack_update, _standardised
from edurl.rl.seed_stack import ActorCriticStack, RowAdam

PHASES = ("forward + loss", "zero_grad", "backward", "clip_grad_norm_", "optimizer.step")


def profile(steps: int, warmup: int, config: PPOConfig) -> dict[str, float]:
    """Seconds per step of each phase, averaged over ``steps`` steps after ``warmup``."""
    torch.manual_seed(0)
    policy, value = CategoricalPolicy(4, 2, config.hidden_sizes), ValueNet(4, config.hidden_sizes)
    params = [*policy.parameters(), *value.parameters()]
    optimizer = torch.optim.Adam(params, lr=config.learning_rate, eps=1e-5, fused=True)
    n = config.num_envs * config.num_steps // config.num_minibatches
    obs, actions = torch.randn(n, 4), torch.randint(0, 2, (n,))
    sampling_logprobs, advantages, returns = -torch.rand(n), torch.randn(n), torch.randn(n)
    totals = dict.fromkeys(PHASES, 0.0)
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logprobs, entropy = policy.logprob_and_entropy(obs, actions)
        adv = _standardised(advantages, config)
        policy_loss = clipped_surrogate(logprobs, sampling_logprobs, adv, 0.8, 1.2).mean()
        value_loss = 0.5 * ((value(obs) - returns) ** 2).mean()
        loss = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy.mean()
        t1 = time.perf_counter()
        optimizer.zero_grad()
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        t4 = time.perf_counter()
        optimizer.step()
        t5 = time.perf_counter()
        if i >= warmup:
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                totals[phase] += seconds
    return {phase: total / steps for phase, total in totals.items()}


def _stack_setup(num_seeds: int, config: PPOConfig) -> tuple[ActorCriticStack, RowAdam, PPOBatch]:
    """A seed stack, its optimizer, and random inputs of one minibatch's shape per seed."""
    stack = ActorCriticStack(range(num_seeds), 4, 2, config.hidden_sizes)
    optimizer = RowAdam(stack.rows, lr=config.learning_rate, eps=1e-5)
    n = config.num_envs * config.num_steps // config.num_minibatches
    g = torch.Generator().manual_seed(0)
    batch = PPOBatch(
        torch.randn(num_seeds, n, 4, generator=g),
        torch.randint(0, 2, (num_seeds, n), generator=g),
        -torch.rand(num_seeds, n, generator=g),
        torch.randn(num_seeds, n, generator=g),
        torch.randn(num_seeds, n, generator=g),
        torch.randn(num_seeds, n, generator=g),
    )
    return stack, optimizer, batch


def stack_step(num_seeds: int, steps: int, warmup: int, config: PPOConfig) -> float:
    """Seconds per optimizer step of ``_stack_update`` (what ``train_ppo`` runs) for ``num_seeds`` seeds, on
    random inputs of one minibatch's shape per seed."""
    stack, optimizer, batch = _stack_setup(num_seeds, config)
    _stack_update(stack, optimizer, batch, replace(config, update_epochs=warmup), 0.2)
    t0 = time.perf_counter()
    _stack_update(stack, optimizer, batch, replace(config, update_epochs=steps), 0.2)
    return (time.perf_counter() - t0) / steps


def torch_profile(num_seeds: int, steps: int, warmup: int, config: PPOConfig, rows: int = 15) -> None:
    """The torch profiler's operators of ``steps`` stack steps, by self CPU time: microseconds per step."""
    from torch.profiler import ProfilerActivity, profile

    stack, optimizer, batch = _stack_setup(num_seeds, config)
    _stack_update(stack, optimizer, batch, replace(config, update_epochs=warmup), 0.2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _stack_update(stack, optimizer, batch, replace(config, update_epochs=steps), 0.2)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"torch profile, {num_seeds} seed(s), {steps} steps: {total / steps:.0f} us per step under the profiler")
    print(f"  {'operator':<28} {'us/step':>8} {'share':>6} {'calls/step':>10}")
    for e in events[:rows]:
        share = e.self_cpu_time_total / total
        print(f"  {e.key:<28} {e.self_cpu_time_total / steps:8.1f} {share:6.1%} {e.count / steps:10.1f}")


def _median_seconds(fn, steps: int, rounds: int = 5) -> float:
    """Seconds per call of ``fn``: the median over ``rounds`` rounds of ``steps`` calls."""
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        per_call.append((time.perf_counter() - t0) / steps)
    return sorted(per_call)[rounds // 2]


def head_products(num_seeds: int, steps: int, config: PPOConfig) -> None:
    """The policy head's two matrix products per step as ``seed_stack`` computes them, ``baddbmm`` forward
    (``bias + 2 h @ W``, W a view into the stacked rows) and weight gradient (``2 h^T g - db``), and the same
    transposed: ``(2 W^T @ h^T)^T + bias`` with W^T copied contiguous first, and ``2 (g^T @ h)^T - db``.
    Microseconds each, median of 5 rounds of ``steps`` calls; a hidden layer's product for comparison."""
    n = config.num_envs * config.num_steps // config.num_minibatches
    k = config.hidden_sizes[-1]
    g = torch.Generator().manual_seed(0)
    h = torch.rand(num_seeds, n, k, generator=g)
    rows = torch.randn(num_seeds, 2 * k + 2, generator=g)  # a head's weight and bias, as split from the rows
    w, b = rows[:, : 2 * k].view(num_seeds, k, 2), rows[:, 2 * k :].unsqueeze(1)
    grad = torch.randn(num_seeds, n, 2, generator=g)
    db = grad.sum(1).unsqueeze(1)
    pairs = {
        "forward": (
            lambda: torch.baddbmm(b, h, w, alpha=2.0),
            lambda: torch.bmm(w.transpose(1, 2).contiguous(), h.transpose(1, 2)).transpose(1, 2).mul(2.0).add(b),
        ),
        "weight gradient": (
            lambda: torch.baddbmm(db, h.transpose(1, 2), grad, beta=-1.0, alpha=2.0),
            lambda: torch.bmm(grad.transpose(1, 2), h).transpose(1, 2).mul(2.0).sub(db),
        ),
    }
    hidden = torch.randn(num_seeds, k, k, generator=g)
    seconds = _median_seconds(lambda: torch.bmm(h, hidden), steps)
    flops = 2 * h.numel() * hidden.shape[-1]
    print(
        f"a hidden layer's product for comparison, {num_seeds} seed(s): {seconds * 1e6:.1f} us "
        f"({flops / seconds / 1e9:.0f} GFLOP/s)"
    )
    for name, (as_now, transposed) in pairs.items():
        assert torch.allclose(as_now(), transposed(), rtol=1e-4, atol=1e-4)
        times = {"as now": _median_seconds(as_now, steps), "transposed": _median_seconds(transposed, steps)}
        print(
            f"policy head {name}, {num_seeds} seed(s): {times['as now'] * 1e6:.1f} us as now, "
            f"{times['transposed'] * 1e6:.1f} us transposed ({times['transposed'] / times['as now']:.2f}x)"
        )


def env_step(num_envs: int, steps: int, warmup: int) -> float:
    """Seconds per ``TorchCartPole.step`` of ``num_envs`` envs on random actions (a rollout's other half)."""
    env = TorchCartPole(num_envs, check_actions=False)  # as the trainers run it
    env.reset(seed=0)
    actions = torch.randint(0, 2, (num_envs,), generator=torch.Generator().manual_seed(0))
    for _ in range(warmup):
        env.step(actions)
    t0 = time.perf_counter()
    for _ in range(steps):
        env.step(actions)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--seeds", default="1,8", help="seed-stack sizes to time (comma-separated; empty: none)")
    parser.add_argument("--envs", default="8", help="TorchCartPole sizes whose step to time (comma-separated)")
    parser.add_argument(
        "--torch-profile", action="store_true", help="also the torch profiler's top operators of each stack's step"
    )
    parser.add_argument(
        "--head-products",
        action="store_true",
        help="also time the policy head's products as the stack computes them and transposed",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = PPOConfig()
    per_step = profile(args.steps, args.warmup, config)
    total = sum(per_step.values())
    n = config.num_envs * config.num_steps // config.num_minibatches
    print(
        f"PPO optimizer step: minibatch of {n}, MLPs {config.hidden_sizes}, {args.threads} torch thread(s), "
        f"torch {torch.__version__}; mean of {args.steps} steps"
    )
    print(f"{'phase':<18} {'ms':>7} {'share':>6}")
    for phase, seconds in per_step.items():
        print(f"{phase:<18} {seconds * 1e3:7.3f} {seconds / total:6.0%}")
    print(f"{'total':<18} {total * 1e3:7.3f}")
    for num_seeds in [int(x) for x in args.seeds.split(",") if x]:
        seconds = stack_step(num_seeds, args.steps, args.warmup, config)
        print(
            f"seed stack, {num_seeds} seed(s): {seconds * 1e3:.3f} ms per optimizer step, "
            f"{seconds * 1e3 / num_seeds:.3f} ms per seed"
        )
        if args.torch_profile:
            torch_profile(num_seeds, max(1, args.steps // 10), args.warmup, config)
        if args.head_products:
            head_products(num_seeds, args.steps, config)
    for num_envs in [int(x) for x in args.envs.split(",") if x]:
        seconds = env_step(num_envs, 5 * args.steps, args.warmup)
        print(f"TorchCartPole.step, {num_envs} envs: {seconds * 1e6:.1f} us")


if __name__ == "__main__":
    main()

"""Many seeds in one process: S independent actor-critics computed as one batched network. Chapter 5.

RL results mean something only over several seeds, and for networks as small as CartPole's a seed's run is all
per-operation overhead. :class:`ActorCriticStack` keeps every weight of seed s in one flat leaf tensor,
``rows[s]`` (P,); a forward pass stacks the rows into (S, P), views each layer's weight as (S, in, out), and does
one batched matmul per layer (``torch.baddbmm``), so eight seeds cost far less than eight runs. Nothing mixes seeds:

- the loss of a step is the *sum* of the seeds' losses, so seed s's gradient is the gradient of its own loss;
- :func:`clip_grad_norm_per_seed_` clips each seed's gradient norm on its own (seed s's global norm);
- the optimiser, :class:`RowAdam`, is Adam over the S row tensors: one step count and one state per seed, and a
  seed whose gradient is None (its epochs stopped at ``target_kl``) is skipped;
- each seed draws its randomness (actions, minibatch order) from its own ``torch.Generator``.

So seed s of a stack repeats, to the last bit, the run that a stack of one seed makes with seed s
(``tests/rl/test_seed_stack.py`` checks this in float64, and that perturbing one seed's loss leaves the others'
gradients unchanged). ``train_ppo(PPOConfig(num_seeds=8))`` is the user of all this.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch

from edurl.metrics import MetricsLogger
from edurl.objectives import entropy
from edurl.rl.episodes import EpisodeLog
from edurl.rl.networks import CategoricalPolicy, ValueNet
from edurl.utils import keep_freed_memory

__all__ = [
    "ActorCriticStack",
    "RowAdam",
    "SeedRuns",
    "clip_grad_norm_per_seed_",
    "drop_seeds",
    "fused_adam",
    "inverse_cdf_sample",
    "keep_seeds",
]


class ActorCriticStack:
    """``len(seeds)`` pairs of (:class:`CategoricalPolicy`, :class:`ValueNet`), one leaf tensor per seed in ``rows``.

    Seed s's networks are initialised exactly as ``torch.manual_seed(s)`` followed by
    ``CategoricalPolicy(...)`` and ``ValueNet(...)`` would initialise them (so building a stack reseeds torch's
    global generator, as ``edurl.seed_everything`` does), and :meth:`networks` gives them back as those modules.
    Observations go in seed-major, ``(S, M, obs_dim)``; outputs come out ``(S, M)``. Building one calls
    :func:`edurl.utils.keep_freed_memory` (process-wide, glibc only).
    """

    def __init__(
        self,
        seeds: Sequence[int],
        obs_dim: int,
        num_actions: int,
        hidden_sizes: Sequence[int] = (64, 64),
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ):
        self.seeds = [int(s) for s in seeds]
        if not self.seeds:
            raise ValueError("ActorCriticStack needs at least one seed.")
        keep_freed_memory()  # its activations, (S, batch, hidden), are allocated and freed many times a step
        self.num_seeds, self.obs_dim, self.num_actions = len(self.seeds), obs_dim, num_actions
        self.hidden_sizes = tuple(hidden_sizes)
        self.device, self.dtype = torch.device(device), dtype or torch.get_default_dtype()
        rows = []
        for seed in self.seeds:
            torch.manual_seed(seed)
            policy = CategoricalPolicy(obs_dim, num_actions, self.hidden_sizes)
            value = ValueNet(obs_dim, self.hidden_sizes)
            rows.append(torch.cat([w.detach().reshape(-1) for w in self._module_tensors(policy, value)]))
        # per network, (offset, in, out) of each layer in a row; weights stored (in, out), as baddbmm wants them
        self._layout: dict[str, list[tuple[int, int, int]]] = {}
        self._sizes: list[int] = []  # numel of each weight and bias in row order
        offset = 0
        for name, out_dim in (("policy", num_actions), ("value", 1)):
            sizes = [obs_dim, *self.hidden_sizes, out_dim]
            self._layout[name] = []
            for a, b in zip(sizes[:-1], sizes[1:]):
                self._layout[name].append((offset, a, b))
                self._sizes += [a * b, b]
                offset += a * b + b
        self.rows = [row.to(self.device, self.dtype).requires_grad_() for row in rows]
        """S leaf tensors (P,): row s holds every weight and bias of seed s's policy and value."""
        self._acting: dict | None = None  # the layers, fixed for a rollout (see acting())
        self.generators = [torch.Generator(device=self.device).manual_seed(s) for s in self.seeds]
        """One generator per seed, for its action samples and its minibatch order."""

    @staticmethod
    def _module_tensors(policy: CategoricalPolicy, value: ValueNet) -> list[torch.Tensor]:
        """The tensors of one seed in row order: per linear layer, weight (in, out) then bias."""
        out = []
        for net in (policy.net, value.net):
            for layer in net:
                if isinstance(layer, torch.nn.Linear):
                    out += [layer.weight.T, layer.bias]
        return out

    def _layers(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, float]]]:
        """For "policy" and "value": (weight (S, in, out), bias (S, 1, out), alpha) per layer, as :meth:`_mlp`
        uses them, from one ``torch.stack`` of the rows (so a training step stacks and splits once).

        The MLPs are tanh MLPs, and tanh(z) = 2 sigmoid(2z) - 1. The hidden activations are kept as
        h = sigmoid(2z): the factor 2 on z rides in the matmul, and tanh's "2h - 1" goes into the next layer,
        whose output is (2h - 1) @ W + b = 2 (h @ W) + (b - 1 @ W): hence ``alpha`` 2 and the bias b - sum_in W.
        Same function, two fewer passes over every hidden tensor, and on AVX-512 CPUs ``torch.tanh`` is also
        ~6x slower than ``torch.sigmoid`` (340 vs 56 us on (8, 256, 64), torch 2.13, one thread). tanh and its
        backward were about a third of a stacked PPO step's time (torch profiler, 8 seeds).
        """
        flat = self.rows[0].unsqueeze(0) if self.num_seeds == 1 else torch.stack(self.rows)  # (S, P): one op
        return self._layers_of(flat)

    def _layers_of(self, flat: torch.Tensor) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, float]]]:
        """:meth:`_layers` from rows stacked as ``flat`` (S', P)."""
        pieces = iter(flat.split(self._sizes, dim=1))  # one op (and one backward) for every weight and bias
        S, out = flat.shape[0], {}
        for name, layers in self._layout.items():
            out[name] = []
            for i, (_, a, b) in enumerate(layers):
                weight, bias = next(pieces).view(S, a, b), next(pieces).unsqueeze(1)
                if i > 0:  # the input is h = (tanh + 1) / 2 of the previous layer
                    bias = bias - weight.sum(1, keepdim=True)
                out[name].append((weight, bias, 1.0 if i == 0 else 2.0))
        return out

    def _mlp(self, name: str, x: torch.Tensor, layers: dict | None = None, inputs: list | None = None) -> torch.Tensor:
        """Every seed's MLP at once: (S, M, in) -> (S, M, out); seed s's rows meet only seed s's weights.
        ``inputs``, when given, gets each layer's input appended (x, then the hidden h = sigmoid(2z) of each
        layer), for :meth:`backward_rows`."""
        if layers is None:
            layers = self._acting if self._acting is not None and not torch.is_grad_enabled() else self._layers()
        layers = layers[name]
        for i, (weight, bias, alpha) in enumerate(layers):
            if inputs is not None:
                inputs.append(x)
            if i < len(layers) - 1:
                x = torch.sigmoid(torch.baddbmm(bias, x, weight, beta=2.0, alpha=2.0 * alpha))
            elif weight.shape[-1] == 1:  # a value head: a gemv's summation order changes with S, a sum's does not
                x = (x * weight.transpose(1, 2)).sum(-1, keepdim=True) * alpha + bias
            else:
                x = torch.baddbmm(bias, x, weight, alpha=alpha)
        return x

    @contextmanager
    def acting(self) -> Iterator[ActorCriticStack]:
        """Inside, forward passes without grad reuse one set of layers instead of rebuilding them per call:
        for a rollout, during which the weights do not change (do not step an optimiser inside)."""
        with torch.no_grad():
            self._acting = self._layers()
        try:
            yield self
        finally:
            self._acting = None

    def evaluate(
        self, obs: torch.Tensor, actions: torch.Tensor, with_entropy: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """log pi_s(a|s), the entropy of pi_s(.|s) (None unless ``with_entropy``) and V_s(s), each (S, M), from one
        stack of the rows, with one backward into the rows (A2C's training step; PPO's backpropagates by hand,
        :meth:`forward_saved`)."""
        layers = self._layers()
        logp = torch.log_softmax(self._mlp("policy", obs, layers), -1)
        values = self._mlp("value", obs, layers).squeeze(-1)
        return logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1), entropy(logp) if with_entropy else None, values

    @torch.no_grad()
    def forward_saved(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """The policy's logits (S, M, A) and the values V_s(s) (S, M) for obs (S, M, obs_dim), as :meth:`evaluate`
        computes them but without an autograd graph, and what :meth:`backward_rows` needs to take a gradient
        from them into the rows: ``(logits, values, saved)``."""
        layers, inputs = self._layers(), {"policy": [], "value": []}
        logits = self._mlp("policy", obs, layers, inputs["policy"])
        values = self._mlp("value", obs, layers, inputs["value"]).squeeze(-1)
        return logits, values, (layers, inputs)

    @torch.no_grad()
    def backward_rows(self, saved: tuple, grad_logits: torch.Tensor, grad_values: torch.Tensor) -> None:
        """Backpropagation written out: set row s's ``grad`` to the gradient, with respect to seed s's weights, of
        sum(grad_logits[s] * logits[s]) + sum(grad_values[s] * values[s]), where ``saved`` is what
        :meth:`forward_saved` returned with those logits (S, M, A) and values (S, M). That is what
        ``loss.backward()`` gives when grad_logits and grad_values are the loss's gradients with respect to the
        outputs, without autograd's per-operation bookkeeping, which is most of a step's time for networks this
        small (``benchmarks/README.md``, "Where a PPO step's time goes"). ``tests/rl/test_seed_stack.py``
        compares it with autograd in float64.

        Layer by layer, with g = dL/dz for the layer's output z = x @ W + b (the last layer: g is given):
        dW = x^T g and db = sum over the batch of g; the layer below gets dL/dx = g @ W^T, and tanh's derivative
        1 - tanh(z)^2 = 4 h (1 - h) for the kept h = sigmoid(2z) (see :meth:`_layers`). A hidden input enters as
        2h - 1, so there dW = 2 h^T g - db (the folded bias b - sum_in W gives the -db).
        """
        layers, inputs = saved
        S, pieces = self.num_seeds, []
        for name, g in (("policy", grad_logits), ("value", grad_values.unsqueeze(-1))):
            grads = []
            for i in reversed(range(len(layers[name]))):
                weight, x = layers[name][i][0], inputs[name][i]
                db = g.sum(1)  # (S, out)
                if i == 0:  # the observations, as they are
                    dw = torch.bmm(x.transpose(1, 2), g)
                elif g.shape[-1] == 1:  # the value head, a sum in the forward pass too (see _mlp)
                    dw = (x * g).sum(1).mul_(2.0).sub_(db)
                else:
                    dw = torch.baddbmm(db.unsqueeze(1), x.transpose(1, 2), g, beta=-1.0, alpha=2.0)
                grads += [db, dw.reshape(S, -1)]
                if i > 0:  # dL/dz of the layer below: (g @ W^T) * 2 (input 2h - 1) * 2 h (1 - h) (h = sigmoid(2z))
                    g = g * weight.transpose(1, 2) if g.shape[-1] == 1 else torch.bmm(g, weight.transpose(1, 2))
                    g = g.mul_(torch.addcmul(x, x, x, value=-1.0)).mul_(4.0)
            pieces += reversed(grads)  # row order: per layer, weight then bias
        flat = torch.cat(pieces, 1)  # (S, P): one tensor, each row's grad a view of it
        for row, grad in zip(self.rows, flat):
            row.grad = grad

    def logits(self, obs: torch.Tensor) -> torch.Tensor:
        """(S, M, obs_dim) -> (S, M, num_actions)."""
        return self._mlp("policy", obs)

    def values(self, obs: torch.Tensor) -> torch.Tensor:
        """V(s) of each seed's critic: (S, M, obs_dim) -> (S, M)."""
        return self._mlp("value", obs).squeeze(-1)

    def seed_outputs(
        self, pos: int, obs: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """log pi(a|s), the entropy of pi(.|s) and V(s), each (M,), of the seed at position ``pos`` alone, for its
        own obs (M, obs_dim) and actions (M,). For batches whose size differs from seed to seed (REINFORCE's
        episodes): the pass is built from the seed's own row, so it has exactly the shapes and memory layout of
        its lone run (slices of the stacked rows sit at other offsets, and some CPU kernels round differently
        there: a float64 test caught one seed 8e-17 off after four updates)."""
        mine = self._layers_of(self.rows[pos].unsqueeze(0))
        logp = torch.log_softmax(self._mlp("policy", obs[None], mine), -1)[0]  # (M, A)
        values = self._mlp("value", obs[None], mine)[0, :, 0]
        return logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1), entropy(logp), values

    def logprob_and_entropy(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log pi_s(a|s) and the entropy of pi_s(.|s), both (S, M), for obs (S, M, obs_dim) and actions (S, M)."""
        logp = torch.log_softmax(self.logits(obs), -1)
        return logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1), entropy(logp)

    @torch.no_grad()
    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Actions and their log-probs for a vector env of S blocks of N envs: obs (S*N, obs_dim) -> (S*N,) each.

        Block s is seed s's: it is acted on by seed s's policy with uniforms from seed s's generator,
        by inverting the CDF (action = how many cumulative probabilities the uniform exceeds).
        """
        S = self.num_seeds
        logp = torch.log_softmax(self.logits(obs.view(S, -1, obs.shape[-1])), -1)  # (S, N, A)
        n = logp.shape[1]
        u = torch.stack([torch.rand(n, 1, generator=g, device=self.device, dtype=logp.dtype) for g in self.generators])
        actions, logprobs = inverse_cdf_sample(logp, u)
        return actions.flatten(), logprobs.flatten()

    def keep(self, positions: Sequence[int]) -> None:
        """Keep only the seeds at ``positions`` (in this order): their rows and generators, untouched."""
        self.rows = [self.rows[p] for p in positions]
        self.generators = [self.generators[p] for p in positions]
        self.seeds = [self.seeds[p] for p in positions]
        self.num_seeds, self._acting = len(self.rows), None

    def randperms(self, n: int, active: Sequence[bool]) -> torch.Tensor:
        """(S, n): a random order of n items per seed from its generator; ``arange`` (no draw) for a seed
        that is not active, so a frozen seed's generator stays where its own run would have left it."""
        return torch.stack(
            [
                torch.randperm(n, generator=g, device=self.device) if on else torch.arange(n, device=self.device)
                for g, on in zip(self.generators, active)
            ]
        )

    @torch.no_grad()
    def networks(self, positions: list[int] | None = None) -> list[tuple[CategoricalPolicy, ValueNet]]:
        """Each seed's policy and value as ordinary modules (copies, on the stack's device and dtype); only the
        seeds at ``positions`` (places in the stack) when given."""
        out = []
        for row in self.rows if positions is None else [self.rows[p] for p in positions]:
            policy = CategoricalPolicy(self.obs_dim, self.num_actions, self.hidden_sizes)
            value = ValueNet(self.obs_dim, self.hidden_sizes)
            policy.to(self.device, self.dtype), value.to(self.device, self.dtype)
            offset = 0
            for t in self._module_tensors(policy, value):
                t.copy_(row.detach()[offset : offset + t.numel()].view(t.shape))  # t is weight.T (a view) or bias
                offset += t.numel()
            out.append((policy, value))
        return out


@torch.no_grad()
def inverse_cdf_sample(logp: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Categorical samples from log-probs (..., A) and uniforms (..., 1): the action is how many cumulative
    probabilities u exceeds. Returns actions (...) and their log-probs (...). ``train_ppo`` samples this way on
    every path, so a seed's actions come from its own generator's uniforms whether or not it runs in a stack."""
    actions = (u > logp.exp().cumsum(-1)[..., :-1]).sum(-1)
    return actions, logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def clip_grad_norm_per_seed_(rows: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale each row's gradient by min(1, max_norm / (||g_s|| + 1e-6)): the rule of
    ``torch.nn.utils.clip_grad_norm_`` applied to each seed's parameters alone. Rows whose grad is None are
    skipped. Returns the norms of the rows that have a gradient."""
    grads = [row.grad for row in rows if row.grad is not None]
    norms = torch.stack(torch._foreach_norm(grads))
    torch._foreach_mul_(grads, list((max_norm / (norms + 1e-6)).clamp(max=1.0).unbind()))
    return norms


def _seed_dir(config, seed: int) -> str | None:
    return f"{config.log_dir}/seed{seed}" if config.log_dir else None


class SeedRuns:
    """The per-seed bookkeeping of a trainer that runs seeds side by side (REINFORCE, A2C and PPO): an
    :class:`~edurl.rl.episodes.EpisodeLog` and a metrics logger per seed, which seeds are still training, and the
    networks a seed leaves behind when it has solved. Positions are places in the stack (the live seeds, in order);
    indices into ``seeds`` are the seeds themselves."""

    def __init__(self, config, seeds: Sequence[int]):
        self.seeds = list(seeds)
        one = len(self.seeds) == 1
        # one log per seed, holding the config of that seed's own run; their clocks start here (setup counts)
        # (a stacked seed writes its metrics to log_dir/seed{s}, and its config says so)
        configs = (
            [config]
            if one
            else [replace(config, seed=s, num_seeds=1, log_dir=_seed_dir(config, s)) for s in self.seeds]
        )
        self.logs = [EpisodeLog(c) for c in configs]
        self._configs = configs
        self.loggers: list[MetricsLogger | None] = [None] * len(configs)
        """Opened by :meth:`open_logs`, once the run's env and device are known to work."""
        self.live = list(range(len(self.seeds)))
        """The seeds still training (indices into ``seeds``), in stack order."""
        self.final: dict[int, tuple] = {}

    def open_logs(self) -> None:
        """Start each seed's metrics.jsonl in its log_dir, replacing an earlier run's. The trainers call it once the
        env and the device are set up, so that a run that fails there (a misspelt env id, no CUDA) leaves the last
        run's metrics where they were."""
        self.loggers = [MetricsLogger(c.log_dir, if_exists="overwrite") if c.log_dir else None for c in self._configs]

    def record(self, ro, num_envs: int, env_steps: int | Sequence[int], rows: Sequence[dict]) -> list[int]:
        """Add each live seed's finished episodes from the rollout ``ro`` (its envs are the block of ``num_envs``
        at its position) to its log at ``env_steps`` (one count for all, or one per live seed), and its metrics
        ``rows[pos]`` to its logger. Returns the positions of the seeds that have now solved (with
        ``stop_when_solved``) or run out of episodes."""
        owner = [e // num_envs for e in ro.episode_envs]
        steps = [env_steps] * len(self.live) if isinstance(env_steps, int) else list(env_steps)
        done = []
        for pos, (s, row, step) in enumerate(zip(self.live, rows, steps)):
            mine = [i for i, o in enumerate(owner) if o == pos]
            log = self.logs[s]
            log.add([ro.episode_returns[i] for i in mine], [ro.episode_lengths[i] for i in mine], step)
            if self.loggers[s]:
                self.loggers[s].log(step, **row, episodes=len(log), **{"time/total": log.elapsed()})
            if mine and log.should_stop():
                done.append(pos)
        return done

    def show(self, bar, n: int, done: Sequence[int], **extra: str) -> None:
        """Advance the progress ``bar`` by ``n`` and show the worst live seed's recent mean return, how many seeds
        have solved (when there are several; ``done`` are the positions that solved just now) and ``extra``."""
        bar.update(n)
        solved = {"solved": f"{len(self.seeds) - len(self.live) + len(done)}/{len(self.seeds)}"}
        bar.set_postfix(
            mean_return=f"{min(self.logs[s].recent_mean() for s in self.live):.0f}",
            **extra,
            **(solved if len(self.seeds) > 1 else {}),
            refresh=False,
        )

    def leave(self, done: Sequence[int], networks: Sequence[tuple]) -> list[int]:
        """The seeds at positions ``done`` leave with their ``networks`` (one (policy, value) per position in
        ``done``). Returns the positions that stay, for the stack, optimiser and envs to keep."""
        self.final.update(zip([self.live[p] for p in done], networks))
        kept = [p for p in range(len(self.live)) if p not in done]
        self.live = [self.live[p] for p in kept]
        return kept

    def results(self, networks: Sequence[tuple]) -> list:
        """Every seed's :class:`~edurl.rl.episodes.TrainResult`, the live seeds taking ``networks``; closes the
        loggers."""
        self.final.update(zip(self.live, networks))
        out = []
        for s, (log, logger) in enumerate(zip(self.logs, self.loggers)):
            if logger:
                logger.close()
            out.append(log.result(*self.final[s]))
        return out


def fused_adam(device: torch.device) -> bool:
    """Whether ``torch.optim.Adam(..., fused=True)`` runs on ``device``: one kernel for every seed's step, which
    matters for networks this small."""
    return device.type in ("cpu", "cuda")


class RowAdam:
    """Adam over a stack's rows: one state (moments and step count) per row, the update of
    ``torch.optim.Adam(rows, fused=True)`` bit for bit (``tests/rl/test_seed_stack.py``), without the Python that
    ``torch.optim`` wraps around its kernel on every step (grouping tensors by device and dtype, hooks, profiler
    ranges): about 0.1 ms of what was then a 1.3 ms PPO step on CartPole's networks. A row whose ``grad`` is None is skipped, so
    its weights, moments and step count stay as they are. On a device without the fused kernel
    (:func:`fused_adam`), or with ``fused=False``, it hands the step to ``torch.optim.Adam``.
    """

    def __init__(
        self, rows: Sequence[torch.Tensor], lr: float, eps: float = 1e-8, betas=(0.9, 0.999), fused: bool | None = None
    ):
        self.rows, self.lr, self.eps, self.betas = list(rows), lr, eps, tuple(betas)
        self.fused = all(fused_adam(row.device) for row in self.rows) if fused is None else fused
        self._state = [self._fresh(row) for row in self.rows] if self.fused else None
        self._torch = None if self.fused else torch.optim.Adam(self.rows, lr=lr, eps=eps, betas=self.betas)

    @staticmethod
    def _fresh(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # as torch.optim.Adam(fused=True) starts a parameter: zero moments, a float32 step count on its device
        zeros = torch.zeros_like(row, memory_format=torch.preserve_format)
        return zeros, zeros.clone(), torch.zeros((), dtype=torch.float32, device=row.device)

    @property
    def steps(self) -> list[int]:
        """The number of steps each row has taken."""
        if self._torch is not None:
            return [int(self._torch.state[row]["step"]) if row in self._torch.state else 0 for row in self.rows]
        return [int(step) for _, _, step in self._state]

    def zero_grad(self) -> None:
        for row in self.rows:
            row.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if self._torch is not None:
            self._torch.param_groups[0]["lr"] = self.lr
            self._torch.step()
            return
        live = [(row, state) for row, state in zip(self.rows, self._state) if row.grad is not None]
        if not live:
            return
        params = [row for row, _ in live]
        exp_avgs, exp_avg_sqs, steps = ([state[i] for _, state in live] for i in range(3))
        torch._foreach_add_(steps, 1)
        torch._fused_adam_(
            params,
            [row.grad for row in params],
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            lr=self.lr,
            beta1=self.betas[0],
            beta2=self.betas[1],
            weight_decay=0.0,
            eps=self.eps,
            amsgrad=False,
            maximize=False,
        )

    def keep(self, positions: Sequence[int]) -> None:
        """Train only the rows at ``positions`` from now on (in this order), with their state."""
        rows = [self.rows[p] for p in positions]
        if self._torch is not None:
            state = self._torch.state
            self._torch = torch.optim.Adam(rows, **self._torch.defaults)
            for row in rows:
                if row in state:
                    self._torch.state[row] = state[row]
        else:
            self._state = [self._state[p] for p in positions]
        self.rows = rows


def keep_seeds(stack: ActorCriticStack, optimizer: RowAdam, positions: Sequence[int]) -> RowAdam:
    """Keep only the seeds at ``positions`` in ``stack`` and in ``optimizer``, with their state. Returns the
    optimizer."""
    stack.keep(positions)
    optimizer.keep(positions)
    return optimizer


def drop_seeds(stack: ActorCriticStack, optimizer, env, obs, counter, positions: Sequence[int], num_envs: int):
    """Keep only the seeds at ``positions`` of a stacked run: the stack's rows and their optimiser state
    (:func:`keep_seeds`), the env blocks, the observations and the episode counters. So the seeds still running
    no longer pay for those that are done. Returns ``(optimizer, obs)``."""
    optimizer = keep_seeds(stack, optimizer, positions)
    env.keep_blocks(positions)
    rows = torch.cat([torch.arange(p * num_envs, (p + 1) * num_envs, device=stack.device) for p in positions])
    obs = obs[rows] if isinstance(obs, torch.Tensor) else obs[rows.cpu().numpy()]
    counter.keep(rows)
    return optimizer, obs

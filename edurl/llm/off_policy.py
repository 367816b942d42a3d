"""Off-policy GRPO: a sampler that runs ``max_steps_off_policy`` steps ahead of the trainer (Chapter 10).

The synchronous loop (:func:`edurl.llm.grpo.grpo_step`) waits for the sampler, then for the trainer::

    step:     0          1          2
    sampler   [s0]       [s1]       [s2]            s_t sampled with the weights after t steps
    trainer        [t0]       [t1]       [t2]

An asynchronous system lets the sampler start batch t + 1 while the trainer is still on batch t. Batch t + 1 is
then sampled with older weights than the trainer's when it trains on it: it is *stale*, or off-policy. With
``max_steps_off_policy = k`` (Tinker's ``AsyncConfig`` and TRL's async GRPO bound the same number), batch s is
sampled here with the weights of step ``max(0, s - k)``::

    k = 1:    sampler   [s0][s1]   [s2]   [s3]      s1 with weights 0, s2 with weights 1, ...
              trainer       [t0]   [t1]   [t2]      training on s_t overlaps sampling s_t+1

:class:`LaggedSampler` samples batch s with exactly those weights, in a thread of its own
(``concurrent_sampler=True``) or in the trainer's thread. Both give the same batches, so a run repeats (and
resumes) exactly, and the staleness is always k once s >= k: the worst case a real system allows. A real sampler
uses the newest weights it has (staleness 0 to k) and drops the groups that come back staler than k; this one
never makes such a group, because it waits for the weights it needs (``time/wait`` is how long the trainer
waited for the sampler; ``async/staleness`` is s minus the sampler's step).

The trainer's loss decides what staleness costs: the ratio ``r = pi / pi_sampler`` moves away from 1, and
``importance_sampling`` (unclipped), ``ppo`` (clipped) and ``cispo`` (capped weight) treat it differently; see
:mod:`edurl.llm.losses`. ``max_steps_off_policy = 0`` is the synchronous loop.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from edurl.llm.clients import SamplingClient, TrainingClient
from edurl.llm.grpo import GRPOConfig, Rollout, collect
from edurl.llm.renderer import ChatMLRenderer
from edurl.utils import torch_threads

__all__ = ["LaggedSampler"]


class LaggedSampler:
    """Batches for steps ``start_step, start_step + 1, ...``, batch s sampled with the weights of step
    ``max(0, s - k)``. The trainer calls :meth:`next` for each step's batch and :meth:`publish` after each
    optimizer step; :meth:`close` stops the thread. ``snapshots`` are the weights a checkpoint kept
    (:meth:`state`), by step."""

    def __init__(
        self,
        config: GRPOConfig,
        trainer: TrainingClient,
        renderer: ChatMLRenderer,
        task,
        reward_fn=None,
        start_step: int = 0,
        snapshots: dict[int, dict[str, torch.Tensor]] | None = None,
    ):
        if config.max_steps_off_policy is None or config.max_steps_off_policy < 0:
            raise ValueError(f"max_steps_off_policy must be an int >= 0, got {config.max_steps_off_policy!r}")
        self.config, self.trainer, self.renderer, self.task, self.reward_fn = config, trainer, renderer, task, reward_fn
        self.k = config.max_steps_off_policy
        self._snapshots: dict[int, SamplingClient] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue()
        for version, weights in (snapshots or {}).items():
            self._snapshots[int(version)] = self._restore(weights)
        missing = [v for v in range(self.version_for(start_step), start_step) if v not in self._snapshots]
        if missing:
            raise ValueError(
                f"resuming at step {start_step} with max_steps_off_policy={self.k} needs the weights of steps "
                f"{missing[0]} to {missing[-1]}, which the checkpoint does not hold; resume with the "
                "max_steps_off_policy the run was saved with"
            )
        self.publish(start_step)
        self._thread = None
        if config.concurrent_sampler:
            self._thread = threading.Thread(
                target=self._sample_ahead, args=(start_step,), name="edurl-sampler", daemon=True
            )
            self._thread.start()

    def version_for(self, step: int) -> int:
        """The step whose weights sample batch ``step``."""
        return max(0, step - self.k)

    def publish(self, version: int) -> None:
        """Snapshot the trainer's weights as those of step ``version`` (after ``version`` optimizer steps), and
        forget the snapshots no later batch needs."""
        snapshot = self.trainer.save_weights_and_get_sampling_client(f"step_{version}")
        with self._cond:
            self._snapshots[version] = snapshot
            for old in [v for v in self._snapshots if v < self.version_for(version)]:
                del self._snapshots[old]
            self._cond.notify_all()

    def next(self, step: int) -> tuple[Rollout, float]:
        """Batch ``step``, and the seconds the trainer waited for it."""
        t0 = time.perf_counter()
        if self._thread is None:
            rollout = self._sample(step)
        else:
            rollout = self._queue.get()
            if isinstance(rollout, BaseException):
                raise RuntimeError(f"the sampler thread failed while sampling for step {step}") from rollout
        if rollout.step != step:
            raise RuntimeError(f"the sampler sent the batch of step {rollout.step} for step {step}")
        return rollout, time.perf_counter() - t0

    def state(self, next_step: int) -> dict[int, dict[str, torch.Tensor]]:
        """The weights that batches ``next_step`` onwards need and that the trainer no longer has (steps
        ``next_step - k`` to ``next_step - 1``): what a checkpoint must keep for a resumed run to repeat."""
        with self._cond:
            return {
                v: {name: p.detach().cpu().clone() for name, p in s.model.named_parameters()}
                for v, s in self._snapshots.items()
                if self.version_for(next_step) <= v < next_step
            }

    def close(self) -> None:
        """Stop the sampler thread (it finishes the batch it is on)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ---------------------------------------------------------------- internals
    def _restore(self, weights: dict[str, torch.Tensor]) -> SamplingClient:
        sampler = self.trainer.save_weights_and_get_sampling_client("restored")
        named = dict(sampler.model.named_parameters())
        with torch.no_grad():
            for name, value in weights.items():
                named[name].copy_(value)
        return sampler

    def _sample(self, step: int) -> Rollout | None:
        version = self.version_for(step)
        with self._cond:
            self._cond.wait_for(lambda: version in self._snapshots or self._stop.is_set())
            if self._stop.is_set():
                return None
            sampler = self._snapshots[version]
        rollout = collect(
            self.config, sampler, self.renderer, self.task, step, self.renderer.get_stop_sequences(), self.reward_fn
        )
        rollout.sampler_version = version
        return rollout

    def _sample_ahead(self, start_step: int) -> None:
        try:
            with torch_threads(self.config.num_threads):  # the thread count is set per thread
                for step in range(start_step, self.config.max_steps):
                    rollout = self._sample(step)
                    if rollout is None:
                        return
                    self._queue.put(rollout)
        except BaseException as error:  # handed to the trainer, which raises it
            self._queue.put(error)

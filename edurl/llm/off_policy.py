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

import io
import multiprocessing
import pickle
import queue
import sys
import threading
import time
import traceback
import types

import torch

from edurl.llm.clients import SamplingClient, TrainingClient
from edurl.llm.datum import Datum, ModelInput
from edurl.llm.grpo import GRPOConfig, Rollout, collect
from edurl.llm.renderer import ChatMLRenderer
from edurl.utils import cpu_threads, torch_threads

__all__ = [
    "LaggedSampler",
    "ProcessSampler",
    "SamplerProcess",
    "check_snapshots",
    "make_lagged_sampler",
    "spawn_payload",
]


class _Lag:
    """The rule both samplers follow: batch s is sampled with the weights of step ``max(0, s - k)``, k being
    ``config.max_steps_off_policy``."""

    def _set_lag(self, config: GRPOConfig, start_step: int, snapshots) -> dict[int, dict[str, torch.Tensor]]:
        """Check k and that a resumed run's ``snapshots`` hold every step it needs (before anything is built
        from them); keep ``config`` and ``k``; the snapshots, keyed by int step."""
        if config.max_steps_off_policy is None or config.max_steps_off_policy < 0:
            raise ValueError(f"max_steps_off_policy must be an int >= 0, got {config.max_steps_off_policy!r}")
        self.config, self.k = config, config.max_steps_off_policy
        return check_snapshots(self.k, start_step, snapshots)

    def version_for(self, step: int) -> int:
        """The step whose weights sample batch ``step``."""
        return max(0, step - self.k)


def check_snapshots(k: int, start_step: int, snapshots) -> dict[int, dict[str, torch.Tensor]]:
    """A resumed run's ``snapshots`` (the weights its checkpoint kept, by step), keyed by int step, once they are
    known to hold every step that a lag of ``k`` needs from ``start_step`` on."""
    snapshots = {int(v): w for v, w in (snapshots or {}).items()}
    missing = [v for v in range(max(0, start_step - k), start_step) if v not in snapshots]
    if missing:
        raise ValueError(
            f"resuming at step {start_step} with max_steps_off_policy={k} needs the weights of steps "
            f"{missing[0]} to {missing[-1]}, which the checkpoint does not hold; resume with the "
            "max_steps_off_policy the run was saved with"
        )
    return snapshots


class LaggedSampler(_Lag):
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
        snapshots = self._set_lag(config, start_step, snapshots)
        self.trainer, self.renderer, self.task, self.reward_fn = trainer, renderer, task, reward_fn
        self._snapshots: dict[int, SamplingClient] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue()
        for version, weights in snapshots.items():
            self._snapshots[version] = self._restore(weights)
        self.publish(start_step)
        self._thread = None
        if config.concurrent_sampler:
            self._thread = threading.Thread(
                target=self._sample_ahead, args=(start_step,), name="edurl-sampler", daemon=True
            )
            self._thread.start()

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
        trained = set(self.trainer._trainable_names())  # a LoRA snapshot's frozen base is the trainer's own
        with self._cond:
            return {
                v: {name: p.detach().cpu().clone() for name, p in s.model.named_parameters() if name in trained}
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
        trained = set(self.trainer._trainable_names())
        with torch.no_grad():
            for name, value in weights.items():
                if name in trained:  # a checkpoint from before the base was shared holds it too: never write it
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


def make_lagged_sampler(
    config: GRPOConfig, trainer: TrainingClient, renderer, task, reward_fn, start_step, snapshots, process=None
):
    """The sampler that ``config`` asks for: :class:`ProcessSampler` with ``sampler_process=True`` (in ``process``,
    a :class:`SamplerProcess` started earlier, if given), else :class:`LaggedSampler` (a thread, or in turn)."""
    if config.sampler_process:
        return ProcessSampler(config, trainer, renderer, task, reward_fn, start_step, snapshots, process)
    return LaggedSampler(config, trainer, renderer, task, reward_fn, start_step, snapshots)


class _DefinedInMain(Exception):
    """Raised by :class:`_SpawnPickler` for a function or class that the spawned process cannot import."""


class _SpawnPickler(pickle.Pickler):
    """pickle.dumps, refusing the functions and classes of an interactive ``__main__`` (a notebook, ``python -c``,
    a REPL). Pickle sends those by name (``__main__.my_reward``), and a spawned process imports a ``__main__`` that
    has no file as an empty module, so it fails to find the name only once it is started."""

    def persistent_id(self, obj):  # called for every object pickled, so it sees a reward_fn and a task's class
        if isinstance(obj, (types.FunctionType, type)) and getattr(obj, "__module__", None) == "__main__":
            raise _DefinedInMain(f"{'class' if isinstance(obj, type) else 'function'} {obj.__qualname__}")
        return None


def _dumps_for_spawn(obj) -> bytes:
    """``obj`` pickled for a spawned process; :class:`_DefinedInMain` if it uses what that process cannot import."""
    if getattr(sys.modules.get("__main__"), "__file__", None) is not None:
        return pickle.dumps(obj)  # a script: spawn runs its file again, so its functions are found
    buffer = io.BytesIO()
    _SpawnPickler(buffer).dump(obj)
    return buffer.getvalue()


def spawn_payload(obj) -> bytes:
    """``obj`` (the sampler process's setup, or a part of it) pickled for the spawned process, or a ``TypeError``
    that says what cannot be sent and what to do. ``train_grpo`` sends the ``reward_fn`` through it before the warm
    start, so that such a refusal costs nothing."""
    try:
        return _dumps_for_spawn(obj)
    except _DefinedInMain as error:
        raise TypeError(
            "sampler_process=True sends the renderer, the task and the reward_fn to a second process, which "
            f"imports their functions and classes by name, but the {error} is defined in a notebook cell (or "
            "python -c, or a REPL), which a process cannot import; put it in a .py file next to the notebook "
            "and import it from there, or sample in a thread with sampler_process=False"
        ) from None
    except Exception as error:
        raise TypeError(
            "sampler_process=True sends the model, the renderer, the task and the reward_fn to a second "
            f"process, but one of them cannot be pickled ({error}); define a reward_fn at module level (not "
            "a lambda or a closure), or sample in a thread with sampler_process=False"
        ) from error


_MAIN_GUARD = (
    "sampler_process=True starts the sampler with 'spawn', which imports your script again in the new process: put "
    'the code that calls train_grpo under `if __name__ == "__main__":`, and define a reward_fn and your classes '
    "above it, at the top level (a notebook needs nothing). If the machine ran out of memory, or to rule the "
    "process out, sample in a thread with sampler_process=False"
)


class ProcessSampler(_Lag):
    """:class:`LaggedSampler`'s batches, sampled in a second process (``GRPOConfig(sampler_process=True)``).

    A thread shares the trainer's Python interpreter, and with it the lock that lets one thread at a time run
    Python code (the GIL): the sampler's decode loop is mostly small torch calls made from Python, so the two
    halves wait for each other. A process has an interpreter of its own, as a real system's sampler (a vLLM
    server) does. It is started with ``spawn`` and gets a copy of the sampler's model once; after each optimizer
    step the trainer sends it the trainable weights (``publish``), and it sends back each batch's datums packed
    into a few flat tensors. Batch s is still sampled with the weights of step ``max(0, s - k)``, so the batches
    are those of the thread and of the run in turn, to the bit on the same machine and thread count.

    Starting the process takes seconds (it imports torch, transformers and edurl). ``train_grpo`` starts it
    (:class:`SamplerProcess`) before it builds the trainer, so the two start-ups overlap; :meth:`__init__` then
    waits until the process has the model, and ``start_seconds`` is how long that wait took (logged as
    ``time/sampler_start`` with the first step, outside ``time/step``, as the trainer's own start-up is)."""

    def __init__(
        self,
        config: GRPOConfig,
        trainer: TrainingClient,
        renderer: ChatMLRenderer,
        task,
        reward_fn=None,
        start_step: int = 0,
        snapshots: dict[int, dict[str, torch.Tensor]] | None = None,
        process: SamplerProcess | None = None,
    ):
        snapshots = self._set_lag(config, start_step, snapshots)
        self.trainer = trainer
        self._names = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
        first = trainer.save_weights_and_get_sampling_client("process-sampler")
        device = next(first.model.parameters()).device
        first.model.to("cpu")  # sent as bytes; the process moves it back
        payload = spawn_payload(
            (config, first.model, first.tokenizer, str(device), renderer, task, reward_fn, start_step)
        )
        del first
        t0 = time.perf_counter()
        self.process = process if process is not None else SamplerProcess()
        self._kept: dict[int, dict[str, torch.Tensor]] = {}
        try:
            self.process.weights.put(("setup", payload))
            for version, weights in sorted(snapshots.items()):
                self._send(version, weights)
            self.publish(start_step)
            self._receive("ready", "starting")
        except BaseException:
            self.process.close()  # it would otherwise wait for a stop that no one sends
            raise
        self.start_seconds = time.perf_counter() - t0

    def publish(self, version: int) -> None:
        """Send the trainer's weights to the sampler process as those of step ``version``."""
        with torch.no_grad():
            named = dict(self.trainer.model.named_parameters())
            self._send(version, {name: named[name].detach().to("cpu", copy=True) for name in self._names})

    def next(self, step: int) -> tuple[Rollout, float]:
        """Batch ``step``, and the seconds the trainer waited for it."""
        t0 = time.perf_counter()
        rollout = unpack_rollout(pickle.loads(self._receive("rollout", f"sampling for step {step}")))
        if rollout.step != step:
            raise RuntimeError(f"the sampler sent the batch of step {rollout.step} for step {step}")
        return rollout, time.perf_counter() - t0

    def state(self, next_step: int) -> dict[int, dict[str, torch.Tensor]]:
        """As :meth:`LaggedSampler.state`: the trainable weights of steps ``next_step - k`` to ``next_step - 1``."""
        return {v: w for v, w in self._kept.items() if self.version_for(next_step) <= v < next_step}

    def close(self) -> None:
        """Stop the sampler process (it finishes the batch it is on) and wait for it."""
        self.process.close()

    def _receive(self, expected: str, doing: str):
        """The body of the sampler's next message, which must be of kind ``expected``."""
        while True:
            try:
                kind, body = self.process.batches.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.process.process.is_alive():
                    raise RuntimeError(
                        f"the sampler process exited (status {self.process.process.exitcode}) while {doing}; its "
                        f"error, if it printed one, is above. {_MAIN_GUARD}"
                    ) from None
        if kind == "error":
            raise RuntimeError(f"the sampler process failed while {doing}:\n{body}")
        if kind != expected:
            raise RuntimeError(f"the sampler process sent a {kind!r} message while {doing}")
        return body

    def _send(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self._kept[version] = weights
        for old in [v for v in self._kept if v < self.version_for(version)]:
            del self._kept[old]
        buffer = io.BytesIO()
        torch.save(weights, buffer)
        self.process.weights.put((version, buffer.getvalue()))


class SamplerProcess:
    """A spawned process that will serve :class:`ProcessSampler`, and its queues: ``weights`` (trainer to sampler:
    the setup, then weights by step) and ``batches`` (sampler to trainer). Start it early; it waits for the setup."""

    def __init__(self):
        if getattr(multiprocessing.current_process(), "_inheriting", False):  # a spawned child re-running a script
            raise RuntimeError(_MAIN_GUARD)
        ctx = multiprocessing.get_context("spawn")
        self.weights, self.batches, self.stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        self.weights.cancel_join_thread()  # weights the process never read must not keep this one from exiting
        # everything large goes through the queues, not the arguments: multiprocessing writes the arguments from
        # this thread, and would wait for ever on a large one if the process died before reading it
        self.process = ctx.Process(
            target=_serve, args=(self.weights, self.batches, self.stop), name="edurl-sampler", daemon=True
        )
        self.process.start()

    def close(self) -> None:
        """Stop the process (it finishes the batch it is on) and wait for it."""
        self.stop.set()
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        for q in (self.weights, self.batches):
            q.cancel_join_thread()  # what is still queued is not needed; exit without flushing it
            q.close()


def _serve(weights: multiprocessing.Queue, batches: multiprocessing.Queue, stop) -> None:
    """The sampler process: batch s with the weights of step ``max(0, s - k)``, for every step of the run."""
    parent = multiprocessing.parent_process()

    def receive():
        """The next message from the trainer, or None once it asked us to stop (or is gone)."""
        while not stop.is_set() and (parent is None or parent.is_alive()):
            try:
                return weights.get(timeout=0.5)
            except queue.Empty:
                continue
        return None

    try:
        message = receive()
        if message is None:
            return
        config, model, tokenizer, device, renderer, task, reward_fn, start_step = pickle.loads(message[1])
        if config.num_threads is not None:  # None leaves torch's own setting, as torch_threads does
            torch.set_num_threads(cpu_threads(config.num_threads))  # $EDURL_MAX_THREADS caps it, as everywhere
        sampler = SamplingClient(model.to(device), tokenizer, "process-sampler")
        batches.put(("ready", None))
        named = dict(sampler.model.named_parameters())
        k, received, loaded = config.max_steps_off_policy, {}, None
        for step in range(start_step, config.max_steps):
            version = max(0, step - k)
            while version not in received:
                message = receive()
                if message is None:
                    return
                received[message[0]] = message[1]
            for old in [v for v in received if v < version]:
                del received[old]
            if loaded != version:
                with torch.no_grad():
                    for name, value in torch.load(io.BytesIO(received[version]), weights_only=True).items():
                        named[name].copy_(value)
                loaded = version
            if stop.is_set():
                return
            rollout = collect(config, sampler, renderer, task, step, renderer.get_stop_sequences(), reward_fn)
            rollout.sampler_version = version
            # as bytes: a tensor put on the queue itself would be shared through a file descriptor that this
            # process must stay alive to hand over
            batches.put(("rollout", pickle.dumps(pack_rollout(rollout))))
    except BaseException as error:
        hint = ""
        if isinstance(error, AttributeError) and "__mp_main__" in str(error):  # found in __main__, not here
            hint = (
                "\nThe sampler process imports your script again without running its `if __name__ == "
                '"__main__":` block, so a reward_fn (or a class) defined inside that block does not exist there. '
                "Define it at the top level of the script, above the guard."
            )
        batches.put(("error", traceback.format_exc() + hint))
    finally:
        # a queue hands its messages to the pipe from a thread of its own: stay until the trainer has read them
        # and says stop (or is gone), or the last batch, or the error, can be lost with this process
        while not stop.wait(0.5) and (parent is None or parent.is_alive()):
            pass
        batches.cancel_join_thread()  # the trainer stopped: what it left unread is not needed


def pack_rollout(rollout: Rollout) -> dict:
    """``rollout`` with its datums' tensors joined into one flat tensor per field: a few large tensors pickle in
    about a millisecond, where 256 datums of 5 small ones each take tens (:func:`unpack_rollout` undoes it)."""
    datums = rollout.datums
    keys = list(datums[0].loss_fn_inputs) if datums else []
    for d in datums:
        if list(d.loss_fn_inputs) != keys:
            raise ValueError(f"every datum needs the fields {keys} in that order, got {list(d.loss_fn_inputs)}")
    return {
        "step": rollout.step,
        "row": rollout.row,
        "sampler_version": rollout.sampler_version,
        "lengths": [d.model_input.length for d in datums],
        "tokens": torch.tensor([t for d in datums for t in d.model_input.tokens], dtype=torch.long, device="cpu"),
        "fields": {key: torch.cat([d.loss_fn_inputs[key] for d in datums]) for key in keys},
    }


def unpack_rollout(packed: dict) -> Rollout:
    """The :class:`Rollout` that :func:`pack_rollout` packed (each field a view into its flat tensor)."""
    lengths, tokens = packed["lengths"], packed["tokens"].tolist()
    pieces = {key: flat.split(lengths) for key, flat in packed["fields"].items()}
    datums, start = [], 0
    for i, n in enumerate(lengths):
        inputs = {key: split[i] for key, split in pieces.items()}
        datums.append(Datum(ModelInput(tuple(tokens[start : start + n])), inputs))
        start += n
    return Rollout(packed["step"], datums, packed["row"], packed["sampler_version"])

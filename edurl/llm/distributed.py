"""Data-parallel GRPO on ``torch.distributed`` (Chapter 10): N processes, one batch, one step.

Under ``torchrun --nproc_per_node N``, every process (a *rank*) holds a full copy of the policy. One GRPO step::

    1. every rank draws the same P problems (a function of (seed, step)) and keeps its share: problems
       rank, rank + N, rank + 2N, ...
    2. it samples and grades only its share, each problem's group seeded by (seed, step, problem), so the
       samples do not depend on N
    3. the ranks exchange their rewards (P x G floats), so group, batch-level advantages and the logged
       metrics are those of the whole batch
    4. each rank runs forward_backward on its datums; its gradient is scaled by its share of the loss's
       denominator (its tokens / all tokens for token_mean, ...), then the gradients are summed over ranks
       (all_reduce), so every rank holds the gradient of the single-process loss on the whole batch
    5. every rank takes the same Adam step on the same gradient, so the copies stay equal

Only rank 0 evaluates, logs and writes checkpoints; resuming loads rank 0's checkpoint on every rank.
The backend is gloo on the CPU and NCCL on CUDA, where rank r uses the GPU ``LOCAL_RANK``.

A :class:`World` of size 1 (:data:`SINGLE`) makes every method here a no-op, so the single-process loop is the
same code. Libraries that do this at scale (DDP, FSDP, DeepSpeed) overlap step 4 with the backward pass and
shard the weights and optimizer; the arithmetic they must get right is the one of :func:`loss_share`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edurl._checks import is_whole
from edurl.llm.losses import AGGREGATION_MODES

__all__ = ["SINGLE", "World", "init_world", "launch", "loss_share"]


@dataclass(frozen=True)
class World:
    """This process's place among the ranks, and the collective operations the GRPO step needs."""

    rank: int = 0
    """This process's index, 0 to size - 1 (torchrun's RANK)."""
    size: int = 1
    """How many processes share a batch (torchrun's WORLD_SIZE)."""
    local_rank: int = 0
    """This process's index on its machine (torchrun's LOCAL_RANK): the GPU it uses."""
    device: str = "cpu"
    """Where collective operations run: "cpu" for gloo, "cuda" for NCCL."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that evaluates, logs and checkpoints."""
        return self.rank == 0

    def shard(self, n: int) -> list[int]:
        """This rank's share of ``n`` items: indices rank, rank + size, ..."""
        return list(range(self.rank, n, self.size))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``tensor`` over the ranks, as a new tensor on ``tensor``'s device."""
        if self.size == 1:
            return tensor
        buf = tensor.detach().to(self.device, torch.float64 if tensor.dtype == torch.float64 else torch.float32)
        torch.distributed.all_reduce(buf)
        return buf.to(tensor.device, tensor.dtype)

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Each of ``values`` summed over the ranks (in float64)."""
        if self.size == 1:
            return [float(v) for v in values]
        return self.all_reduce(torch.tensor([float(v) for v in values], dtype=torch.float64)).tolist()

    def sum(self, value: float) -> float:
        """``value`` summed over the ranks."""
        return float(value) if self.size == 1 else self.sum_floats([value])[0]

    def mean(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric averaged over the ranks, with equal weights (for per-problem means: every rank holds as
        many problems)."""
        if self.size == 1:
            return metrics
        keys = sorted(metrics)  # summed by name: two ranks may build the same dict in another order
        every = self.all_gather_object(keys)
        if any(k != keys for k in every):  # one rank's extra name would leave the others waiting in the sum
            raise ValueError(
                f"the ranks' metrics differ ({'; '.join(f'rank {r}: {k}' for r, k in enumerate(every))}): every rank "
                "must return the same names (a reward_fn's metrics, for instance), since they are averaged by name"
            )
        totals = dict(zip(keys, self.sum_floats([metrics[k] for k in keys])))
        return {k: totals[k] / self.size for k in metrics}

    def token_mean(
        self, metrics: dict[str, float], datums: Sequence, tokens: int | None = None, all_zero_advantage: bool = False
    ) -> dict[str, float]:
        """Metrics that are means over this rank's action tokens (``optim/entropy``, ``optim/kl_sample_train_v1``,
        ...), made means over every rank's: each rank's mean weighted by its number of action tokens, or by
        ``tokens`` when the metrics cover fewer (``ForwardBackwardOutput.metric_tokens``).

        ``all_zero_advantage`` (``ForwardBackwardOutput.all_zero_advantage``): this rank scored its datums only
        because none had a gradient to give. Its metrics then count only if no rank scored datums, as on one
        process, which scores none of those datums when any datum of the batch has a gradient. One all_reduce."""
        if self.size == 1:
            return metrics
        n = tokens if tokens is not None else sum(int((d.loss_fn_inputs["mask"] != 0).sum()) for d in datums)
        m = 0 if all_zero_advantage else n  # this rank's weight among the ranks that scored datums
        sums = self.sum_floats(
            [v * m if m else 0.0 for v in metrics.values()] + [m] + [v * n for v in metrics.values()] + [n]
        )
        k = len(metrics)
        scored, total = (sums[:k], sums[k]) if sums[k] > 0 else (sums[k + 1 : 2 * k + 1], sums[-1])
        if not total:  # no rank has an action token: nothing to weigh, keep this rank's
            return dict(metrics)
        return {key: v / total for key, v in zip(metrics, scored)}

    def gather_rows(self, local: torch.Tensor, n: int) -> torch.Tensor:
        """The (n, ...) tensor whose row i came from rank i % size, given this rank's rows (those of
        :meth:`shard`): e.g. every rank's rewards, in problem order."""
        if self.size == 1:
            return local
        out = torch.zeros((n, *local.shape[1:]), dtype=torch.float64)
        out[self.shard(n)] = local.detach().cpu().to(torch.float64)
        return self.all_reduce(out).to(local.dtype)  # the other ranks' rows are 0 here, so the sum places them

    def all_reduce_gradients(self, parameters: Sequence[torch.nn.Parameter], share: float) -> None:
        """Replace each gradient by the sum over ranks of ``share`` x that rank's gradient, in one flat fp32
        all_reduce. A parameter without a gradient (a rank with no datums) counts as zeros."""
        if self.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([g.reshape(-1).to(self.device, torch.float32) for g in grads]) * share
        torch.distributed.all_reduce(flat)
        offset = 0
        for p, g in zip(parameters, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g).to(p.device, p.dtype)
            offset += g.numel()

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Copy rank 0's weights to every rank (the same start for every copy, as DDP does when it wraps a model)."""
        if self.size == 1:
            return
        with torch.no_grad():
            for p in module.parameters():
                buf = p.detach().to(self.device)
                torch.distributed.broadcast(buf, src=0)
                p.copy_(buf.to(p.device))

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj`` (any picklable value), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        every = [None] * self.size
        torch.distributed.all_gather_object(every, obj)
        return every

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` (any picklable value) on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.size > 1:
            torch.distributed.barrier()


SINGLE = World()
"""One process: every collective is a no-op."""


def refuse_under_torchrun(desc: str) -> None:
    """Raise ``ValueError`` if torchrun started this process with more than one rank: a loop that trains on one
    process (``desc`` names it) would then train the whole run on every rank, into the same ``log_dir``."""
    size = os.environ.get("WORLD_SIZE", "1")
    if size.isdigit() and int(size) > 1:
        raise ValueError(
            f"{desc} was started by torchrun with WORLD_SIZE={size} processes, but it trains on one process: each "
            "would train the whole run and write into the same log_dir. Start it with python, not torchrun (of the "
            "course's loops, only train_grpo's own step splits a batch across processes)."
        )


def init_world(device: str | None = None) -> World:
    """The :class:`World` of this process, from torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK).

    Without them, or with WORLD_SIZE=1, this is :data:`SINGLE` and nothing is initialised. Otherwise it joins
    the process group: NCCL when ``device`` (or, when None, the machine) is CUDA, with this rank on GPU
    LOCAL_RANK (so a device named with another index, such as "cuda:0" on rank 1, is refused); gloo on the CPU.
    Calling it again returns the same world."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return SINGLE
    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={size} but {', '.join(missing)} not set: start data-parallel runs with torchrun, e.g. "
            "torchrun --nproc_per_node 2 -m edurl.recipes.grpo_arithmetic --num-threads 1"
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    from edurl.utils import device as pick_device

    chosen = pick_device(device)
    cuda = chosen.type == "cuda"
    if cuda:
        if chosen.index is not None and chosen.index != local_rank:
            raise ValueError(
                f"under torchrun each rank uses GPU LOCAL_RANK, but the device is {str(chosen)!r}, so rank {rank} "
                f"(LOCAL_RANK {local_rank}) would put its model on another rank's GPU. Pass device='cuda' (or "
                "EDURL_DEVICE=cuda, --device cuda) without an index, and torchrun's LOCAL_RANK picks each rank's GPU."
            )
        if local_rank >= (count := torch.cuda.device_count()):
            raise RuntimeError(
                f"LOCAL_RANK is {local_rank}, but this machine has {count} CUDA device(s), and each rank needs its "
                f"own: start at most {count} processes per machine (torchrun --nproc_per_node {count}), or run "
                "the ranks on the CPU over gloo (EDURL_DEVICE=cpu)."
            )
        torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return World(rank=rank, size=size, local_rank=local_rank, device="cuda" if cuda else "cpu")


def loss_share(datums: Sequence, aggregation: str, world: World) -> float:
    """This rank's share of the loss's denominator, so that summing ``share x gradient`` over the ranks gives
    the gradient of the loss on the whole batch (:func:`edurl.llm.losses.aggregate`):

    =========================  ===============================================
    aggregation                share
    =========================  ===============================================
    sum                        1 (the sum of the ranks' sums is the sum)
    token_mean                 this rank's action tokens / all action tokens
    seq_mean_token_mean        this rank's sequences with a token / all of them
    seq_mean_token_sum_norm    this rank's sequences / all sequences
    =========================  ===============================================

    A plain average of the ranks' gradients (share 1/size) is right only when every rank holds as many of
    these as every other; with completions of different lengths, token_mean's is not. One all_reduce.
    """
    if aggregation not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    # one process holds the whole batch (a batch without action tokens has a 0 loss and gradient either way)
    if aggregation == "sum" or world.size == 1:
        return 1.0
    tokens = [int((d.loss_fn_inputs["mask"] != 0).sum()) for d in datums]
    if aggregation == "token_mean":
        local = sum(tokens)
    elif aggregation == "seq_mean_token_mean":
        local = sum(t > 0 for t in tokens)
    else:  # seq_mean_token_sum_norm
        local = len(datums)
    (total,) = world.sum_floats([local])
    return local / total if total else 0.0


def launch(
    args: Sequence[str], nproc: int = 0, *, env: dict[str, str] | None = None, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` (``nproc=0``) or ``torchrun --standalone --nproc_per_node NPROC ARGS`` and wait for it.

    ``args`` follow the interpreter, e.g. ``["-m", "edurl.recipes.grpo_arithmetic", "--max-steps", "10"]``. The
    command runs in a process group of its own, so torchrun's ranks are stopped with it: when ``timeout``
    seconds pass, or when the caller is interrupted (a notebook's stop button), the whole group gets SIGTERM,
    then SIGKILL 5 s later, and no rank is left running in the background, holding its port and cores.
    Returns the finished process with its captured ``stdout`` and ``stderr`` (text). Raises ``RuntimeError``
    with the end of stderr when it exits with a non-zero status, and ``TimeoutError`` past ``timeout``.
    """
    if not is_whole(nproc) or nproc < 0:
        raise ValueError(f"nproc must be 0 (one plain process) or the number of torchrun ranks, got {nproc!r}")
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc else []
    cmd = [sys.executable, *launcher, *map(str, args)]
    if nproc and sys.platform == "win32":  # torch's Windows builds lack libuv, which torchrun's rendezvous asks for
        env = {**(os.environ if env is None else env), "USE_LIBUV": "0"}
    own_group = hasattr(os, "killpg")  # POSIX; Windows stops the process tree with taskkill (_stop)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=own_group
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc, own_group)
        out, err = proc.communicate()
        raise TimeoutError(
            f"{' '.join(cmd)} ran past {timeout:g} s and was stopped with its ranks; the end of its stderr:\n"
            f"{err[-3000:]}"
        ) from None
    except BaseException:  # KeyboardInterrupt and the like: stop the ranks too, then let it through
        _stop(proc, own_group)
        raise
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited with status {proc.returncode}{_first_rank_error(err)}; the end of its "
            f"stderr:\n{err[-3000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


_RANK_ERROR = re.compile(r"^(?:\[rank(\d+)\]:\s*)?([\w.]*(?:Error|Exception|Interrupt)\b:?.*)$", re.MULTILINE)


def _first_rank_error(stderr: str) -> str:
    """``; rank N raised X: ...`` for the first exception a rank printed, or "" when none did. torchrun's own
    summary fills the end of stderr, and a rank whose peer died reports only the broken connection, so the
    cause is the first exception that is not about a closed connection."""
    found = [(rank, line.strip()) for rank, line in _RANK_ERROR.findall(stderr) if not line.startswith("torch.")]
    causes = [f for f in found if "Connection closed" not in f[1] and "DistBackendError" not in f[1]] or found
    if not causes:
        return ""
    rank = causes[0][0]  # the first rank to fail; the last line of its traceback, which names the outermost
    line = [line for r, line in causes if r == rank][-1]  # exception (a chained one prints its cause first)
    return f"; {'rank ' + rank if rank else 'a rank'} raised {line}"


def _stop(proc: subprocess.Popen, own_group: bool) -> None:
    """SIGTERM to ``proc``'s process group (or to ``proc`` alone), SIGKILL if it is still there after 5 s. On
    Windows, which has no process groups to signal, ``taskkill /T`` ends the process with its children (torchrun's
    ranks); terminating the launcher alone left them running, holding their port and cores."""
    if not own_group and sys.platform == "win32":
        try:
            subprocess.run(["taskkill", "/F", "/T", "/PID", str(proc.pid)], capture_output=True, check=False)
            proc.wait(timeout=10)
            return
        except (OSError, subprocess.TimeoutExpired):  # no taskkill, or it did not work: the launcher at least
            pass
    kill = getattr(signal, "SIGKILL", signal.SIGTERM)  # Windows has no SIGKILL; its SIGTERM is TerminateProcess
    for sig, wait in ((signal.SIGTERM, 5.0), (kill, None)):
        try:
            os.killpg(proc.pid, sig) if own_group else proc.send_signal(sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            if own_group:  # the launcher is gone; its ranks may not be: finish the group off
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return

"""Data-parallel GRPO (edurl.llm.distributed): the ranks' summed gradient is the single-process gradient on the
whole batch, and a torchrun run with 2 processes repeats a single-process run, also across a resume."""

import json
import os
import socket

import pandas as pd
import pytest
import torch
import torch.multiprocessing as mp

from edurl.llm import losses as L
from edurl.llm.clients import ServiceClient
from edurl.llm.datum import Datum, build_datum
from edurl.llm.distributed import SINGLE, World, init_world, launch, loss_share
from edurl.llm.grpo import GRPOConfig, Rollout, train_grpo, update
from edurl.llm.model import build_tiny_lm
from edurl.llm.tokenizer import build_char_tokenizer
from edurl.utils import usable_cores

from .conftest import SMALL

MODES = list(L.AGGREGATION_MODES)
LOSSES = [("importance_sampling", {}), ("ppo", {}), ("dro", {"beta": 0.1})]


def _datums(n: int = 8):
    """n datums with completions of different lengths (so the ranks hold different numbers of tokens),
    sampler log-probs away from the policy's (off-policy, so the clip binds), and mixed advantages."""
    g = torch.Generator().manual_seed(0)
    datums = []
    for i in range(n):
        prompt = torch.randint(5, 40, (3 + i % 3,), generator=g).tolist()
        completion = torch.randint(5, 40, (2 + 3 * i,), generator=g).tolist()  # 2, 5, ..., 23 tokens
        logprobs = (-3.0 + 0.5 * torch.randn(len(completion), generator=g)).tolist()
        datums.append(build_datum(prompt, completion, logprobs, float(torch.randn(1, generator=g))))
    return datums


def _trainer():
    tok = build_char_tokenizer()
    return ServiceClient(device="cpu").create_training_client((build_tiny_lm(tok, SMALL, seed=0), tok), False)


def _gradient(trainer, datums, loss_fn, config, mode, world, share=None):
    """The flat gradient of one forward_backward on ``datums``, summed over ranks with ``share``
    (loss_share's, unless a share is given: the plain-average bug passes 1 / size)."""
    trainer.model.zero_grad(set_to_none=True)
    trainer.forward_backward(datums, loss_fn, config, aggregation=mode, max_tokens=24)
    params = trainer.trainable_parameters()
    world.all_reduce_gradients(params, loss_share(datums, mode, world) if share is None else share)
    return torch.cat([p.grad.reshape(-1) for p in params]).clone()


def _one_rank_uniform():
    """_datums with every odd datum's advantages set to 0: under 2 ranks, rank 1 holds no datum with a gradient
    (as when each of its groups' rewards were all equal)."""
    return [
        Datum(d.model_input, {**d.loss_fn_inputs, "advantages": torch.zeros_like(d.loss_fn_inputs["advantages"])})
        if i % 2
        else d
        for i, d in enumerate(_datums())
    ]


def _update_row(datums, world):
    """The metrics row of grpo.update on ``datums`` as the recipe runs it: datums whose advantages are all 0 are
    not scored (score_zero_advantage=False), so the metrics cover the other datums' tokens."""
    trainer = _trainer()
    trainer.score_zero_advantage = False
    config = GRPOConfig(loss_fn="importance_sampling", aggregation="token_mean", score_zero_advantage=False)
    return update(config, trainer, Rollout(0, datums, {}), world)


def _rank(rank, size, port, out):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    world = World(rank=rank, size=size)
    datums, trainer = _datums(), _trainer()
    mine = [datums[i] for i in world.shard(len(datums))]
    grads = {
        (name, mode): _gradient(trainer, mine, name, config, mode, world) for name, config in LOSSES for mode in MODES
    }
    grads["plain average"] = _gradient(trainer, mine, "importance_sampling", {}, "token_mean", world, 1 / size)
    rewards = torch.tensor([[float(i), 10.0 * i] for i in world.shard(5)])
    grads["gathered"] = world.gather_rows(rewards, 5)
    grads["token_mean"] = world.token_mean({"optim/x": float(rank + 1)}, mine)["optim/x"]
    grads["one rank uniform"] = _update_row(_one_rank_uniform()[rank::size], world)
    # metrics are averaged by name, whatever order each rank's dict has; different names are refused on every rank
    grads["by name"] = world.mean({"a": 1.0, "b": 10.0} if rank == 0 else {"b": 30.0, "a": 2.0})
    try:
        world.mean({"a": 1.0} if rank == 0 else {"c": 1.0})
    except ValueError as error:
        grads[f"names refused on rank {rank}"] = str(error)
    grads.update(_config_checks(rank, world))
    if rank == 0:
        torch.save(grads, out)
    torch.distributed.destroy_process_group()


def _config_checks(rank, world) -> dict:
    """What _check_same_config says on this rank: a per-rank log_dir (a notebook's mkdtemp on each rank) is refused
    on every rank; the same config passes, and warns when the ranks' threads outnumber the cores."""
    import warnings

    from edurl.llm.loop import _check_same_config

    out = {}
    try:
        _check_same_config(GRPOConfig(log_dir=f"runs/rank{rank}", num_threads=1), "grpo", world)
    except ValueError as error:
        out[f"config refused on rank {rank}"] = str(error)
    for threads in (1, usable_cores()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _check_same_config(GRPOConfig(num_threads=threads), "grpo", world)
        out[f"warnings with {threads} threads"] = [str(w.message) for w in caught]
    if hasattr(os, "sched_setaffinity"):  # ranks bound to cores (taskset, a cpuset, srun --cpu-bind) count those
        allowed = sorted(os.sched_getaffinity(0))
        for case, cpus in (
            ("pinned to one core", {allowed[0]}),
            ("each on a core of its own", {allowed[rank % len(allowed)]}),
        ):
            if len(allowed) < 2 and case != "pinned to one core":
                continue
            os.sched_setaffinity(0, cpus)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    _check_same_config(GRPOConfig(num_threads=1), "grpo", world)
            finally:
                os.sched_setaffinity(0, allowed)
            out[f"warnings {case}"] = [str(w.message) for w in caught]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp") / "grads.pt"
    mp.spawn(_rank, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return torch.load(out)


def test_metrics_are_averaged_by_name_and_different_names_are_refused(two_ranks):
    """A reward_fn's metrics in another order on rank 1 were summed by position (a=5.5, b=5.5); an extra name
    left the other rank waiting in the sum for 30 minutes."""
    assert two_ranks["by name"] == {"a": 1.5, "b": 20.0} and list(two_ranks["by name"]) == ["a", "b"]
    assert "rank 0: ['a']; rank 1: ['c']" in two_ranks["names refused on rank 0"]


def test_every_rank_refuses_a_config_that_differs_between_ranks(two_ranks):
    """A per-rank log_dir trained to the end and then failed on rank 1 (no metrics there); a per-rank learning
    rate trained copies that drifted apart while rank 0 alone saved."""
    message = two_ranks["config refused on rank 0"]
    assert "log_dir: 'runs/rank0' on rank 0, 'runs/rank1' on rank 1" in message, message
    cores = usable_cores()
    assert two_ranks["warnings with 1 threads"] == [] or cores < 2
    (oversubscribed,) = two_ranks[f"warnings with {cores} threads"]
    assert f"is {2 * cores} threads for the {cores} cores they may run on" in oversubscribed
    assert f"Pass num_threads={cores // 2}" in oversubscribed or cores < 2
    if hasattr(os, "sched_setaffinity"):  # the machine's core count said 2 cores here (on 2 or more), so no warning
        (pinned,) = two_ranks["warnings pinned to one core"]
        assert "is 2 threads for the 1 core they may run on" in pinned and "--nproc_per_node 1" in pinned, pinned
    if hasattr(os, "sched_setaffinity") and cores >= 2:  # rank 0's own affinity (1 core) warned for 2 ranks
        assert two_ranks["warnings each on a core of its own"] == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss", LOSSES, ids=[name for name, _ in LOSSES])
def test_two_ranks_sum_to_the_single_process_gradient(two_ranks, mode, loss):
    name, config = loss
    single = _gradient(_trainer(), _datums(), name, config, mode, SINGLE)
    dp = two_ranks[(name, mode)]
    assert single.norm() > 0
    assert (dp - single).norm() / single.norm() < 1e-6


def test_a_plain_average_of_the_ranks_gradients_is_wrong_for_token_mean(two_ranks):
    # rank 0 holds completions of 2, 8, 14, 20 tokens, rank 1 of 5, 11, 17, 23: a mean of the two means weights
    # rank 0's tokens more, which loss_share corrects
    single = _gradient(_trainer(), _datums(), "importance_sampling", {}, "token_mean", SINGLE)
    assert (two_ranks["plain average"] - single).norm() / single.norm() > 1e-3


def test_a_rank_with_no_scored_datum_leaves_the_metrics_to_the_others(two_ranks):
    """Rank 1's datums all have advantage 0, so it scores them only because it has nothing else to run: its
    metrics must not count, or the logged KL and entropy differ from one process's on the whole batch (where
    those datums are not scored). The gradient and loss agree either way."""
    single = _update_row(_one_rank_uniform(), SINGLE)
    dp = two_ranks["one rank uniform"]
    for key in ("optim/kl_sample_train_v1", "optim/kl_sample_train_v2", "optim/entropy", "optim/loss"):
        assert dp[key] == pytest.approx(single[key], rel=1e-6), key
    assert dp["optim/grad_norm"] == pytest.approx(single["optim/grad_norm"], rel=1e-5)


def test_when_no_rank_scored_a_datum_every_rank_counts(monkeypatch):
    """Two ranks with only zero-advantage datums (every group uniform): one process would have scored them all
    too, so their metrics are weighted by their tokens as usual (a fake all_reduce: the other rank sent
    ``other``)."""
    world = World(rank=0, size=2)
    other = [0.0, 0.0, 3.0 * 30, 30.0]  # rank 1: no scored tokens; over all its 30 tokens, a mean of 3
    monkeypatch.setattr(World, "sum_floats", lambda self, values: [a + b for a, b in zip(values, other)])
    assert world.token_mean({"optim/x": 1.0}, [], 10, all_zero_advantage=True) == {"optim/x": (10 + 90) / 40}
    other = [2.0 * 5, 5.0, 2.0 * 5, 5.0]  # rank 1 scored 5 tokens with a mean of 2: rank 0's stand-ins drop out
    assert world.token_mean({"optim/x": 1.0}, [], 10, all_zero_advantage=True) == {"optim/x": 2.0}


def test_gather_rows_puts_each_ranks_rows_in_problem_order(two_ranks):
    expected = torch.tensor([[float(i), 10.0 * i] for i in range(5)])
    assert torch.equal(two_ranks["gathered"], expected)


def test_token_mean_weights_each_rank_by_its_tokens(two_ranks):
    tokens = [sum(2 + 3 * i for i in range(r, 8, 2)) for r in (0, 1)]  # 44 and 56 action tokens
    assert two_ranks["token_mean"] == pytest.approx((1 * tokens[0] + 2 * tokens[1]) / sum(tokens))


def test_loss_share_by_hand_on_one_process():
    datums = _datums(3)  # 2, 5 and 8 action tokens
    for mode in MODES:
        assert loss_share(datums, mode, SINGLE) == 1.0
    assert SINGLE.shard(5) == [0, 1, 2, 3, 4]
    assert World(rank=1, size=3).shard(8) == [1, 4, 7]
    with pytest.raises(ValueError, match="unknown aggregation"):
        loss_share(datums, "mean", SINGLE)


def test_init_world_without_torchrun_is_a_single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_world() is SINGLE
    monkeypatch.setenv("WORLD_SIZE", "2")
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node"):
        init_world()


def test_more_ranks_than_gpus_is_refused_with_the_fix(monkeypatch):
    """Two ranks on a one-GPU machine: rank 1 has no GPU of its own (the GPU run of notebook 10 hit this)."""
    import edurl.utils

    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(edurl.utils, "device", lambda device=None: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK is 1, but this machine has 1 CUDA device.*EDURL_DEVICE=cpu"):
        init_world()


def test_an_indexed_gpu_under_torchrun_is_refused_with_the_fix(monkeypatch):
    """device='cuda:0' (or EDURL_DEVICE=cuda:0) used to put every rank's model on GPU 0, while the collectives
    used GPU LOCAL_RANK: gradients crossed GPUs every step."""
    import edurl.utils

    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(edurl.utils, "device", lambda device=None: torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device ran before the device was refused"))
    with pytest.raises(ValueError, match=r"'cuda:0', so rank 1 \(LOCAL_RANK 1\).*device='cuda'"):
        init_world("cuda:0")


def test_data_parallel_refuses_what_it_cannot_split(monkeypatch, tmp_path):
    monkeypatch.setattr("edurl.llm.grpo.init_world", lambda device=None: World(rank=0, size=2))
    base = dict(group_size=2, batch_size=4, max_steps=1, log_dir=str(tmp_path))
    for kw, match in [
        (dict(batch_size=6, num_substeps=2), "multiple of nproc_per_node x num_substeps"),
        (dict(drop_uniform_groups=True), "drop_uniform_groups"),
        (dict(kl_coef=0.1), "--kl-penalty loss"),
    ]:
        with pytest.raises(ValueError, match=match):
            train_grpo(GRPOConfig(**{**base, **kw}))
    with pytest.raises(ValueError, match="step_fn"):
        train_grpo(GRPOConfig(**base), step_fn=lambda *a: {})


# ---------------------------------------------------------------- torchrun end to end

ARGS = (
    "--sft.model.hidden-size 32 --sft.model.num-layers 2 --sft.model.num-heads 2 --sft.model.intermediate-size 64 "
    "--sft.max-steps 150 --sft.extra-steps 0 --sft.batch-size 16 --sft.warmup-steps 2 --sft.num-threads 1 --group-size 4 "
    "--batch-size 4 --max-tokens 14 --eval-every 10 --num-eval 8 --num-threads 1 --no-progress "
    "--learning-rate 1e-3 --save-every 10"
).split()
EXACT = [
    "env/all/reward/total",
    "env/all/correct",
    "env/all/format",
    "env/all/ac_tokens_per_turn",
    "env/all/by_group/frac_mixed",
    "test/pass_at_1",
]
CLOSE = ["optim/loss", "optim/grad_norm", "optim/entropy", "optim/kl_sample_train_v2"]


def _recipe(log_dir, nproc: int, *extra: str) -> pd.DataFrame:
    """Run the GRPO recipe with plain python (nproc 0) or under torchrun, with the warm-start cache beside log_dir."""
    args = ["-m", "edurl.recipes.grpo_arithmetic", *ARGS, "--log-dir", str(log_dir), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EDURL_CACHE": str(log_dir.parent / "cache")}
    launch(args, nproc, env=env, timeout=600)  # raises with the end of stderr if a rank fails
    return pd.read_json(log_dir / "metrics.jsonl", lines=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchrun")
    _recipe(root / "warm", 0, "--max-steps", "1")  # trains the cached warm start once, before the ranks read it
    single = _recipe(root / "single", 0, "--max-steps", "20", "--sample-per-problem")
    two = _recipe(root / "two", 2, "--max-steps", "20")
    _recipe(root / "resumed", 2, "--max-steps", "10")
    resumed = _recipe(root / "resumed", 2, "--max-steps", "20", "--resume")
    return single, two, resumed, root


def test_torchrun_with_two_processes_repeats_the_single_process_run(runs):
    single, two, _, root = runs
    assert list(two["step"]) == list(range(20))
    assert single["optim/grad_norm"].gt(0).all()  # the warm start's rewards differ within groups: real updates
    pd.testing.assert_frame_equal(two[EXACT], single[EXACT])
    pd.testing.assert_frame_equal(two[CLOSE], single[CLOSE], rtol=1e-4, atol=1e-7)
    config = json.loads((root / "two" / "config.json").read_text(encoding="utf-8"))
    assert config["sample_per_problem"] is True  # turned on by torchrun
    assert sorted(p.name for p in (root / "two" / "checkpoints").iterdir()) == ["step_000010", "step_000020"]


def test_torchrun_resume_repeats_the_uninterrupted_run(runs):
    _, two, resumed, _ = runs
    assert list(resumed["step"]) == list(range(20))
    pd.testing.assert_frame_equal(resumed[EXACT], two[EXACT])
    pd.testing.assert_frame_equal(resumed[CLOSE], two[CLOSE], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("nproc", [-1, 1.5, True])
def test_launch_refuses_an_nproc_that_is_not_a_count(nproc):
    # True passed the int check and ran torchrun --nproc_per_node True
    with pytest.raises(ValueError, match="nproc must be 0"):
        launch(["-c", "pass"], nproc)

import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edurl.llm.clients import SamplingClient, TrainingClient
from edurl.llm.datum import ModelInput
from edurl.llm.envs import (
    CalculatorEnv,
    Env,
    EnvGroupBuilder,
    GuessNumberEnv,
    GuessNumberGroupBuilder,
    ProblemGroupBuilder,
    StepResult,
    ToolError,
    calculate,
    do_group_rollouts,
    groups_to_datums,
    is_prefix_consistent,
    merged_datum,
    per_turn_datums,
    play_actions,
    trajectory_to_datums,
)
from edurl.llm.envs.calculator import run_tool
from edurl.llm.envs.guess_number import bisect_guess, parse_guess, play, random_guess, win_rate
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.sampling import SamplingParams

from .conftest import make_bpe_tokenizer


def _encode(renderer, text):
    return renderer.tokenizer.encode(text, add_special_tokens=False) + renderer.get_stop_sequences()


def _play_scripted(env, renderer, replies, encode=_encode):
    """Play ``env`` with fixed reply texts; returns the Trajectory (log-probs are made up, -0.1 * (k + 1))."""
    return play_actions(env, [encode(renderer, t) for t in replies], [-0.1 * (k + 1) for k in range(len(replies))])


GAME = ["0-31: 15", "16-31: 23", "16-22: 19", "20-22: 21"]  # secret 21: higher, lower, higher, correct


@pytest.fixture(params=["char", "bpe"])
def renderer(request, char_tokenizer):
    return ChatMLRenderer(char_tokenizer if request.param == "char" else make_bpe_tokenizer())


# ---------------------------------------------------------------- the prefix property


def test_each_observation_extends_the_previous_turn(renderer):
    traj = _play_scripted(GuessNumberEnv(21, renderer), renderer, GAME)
    assert [t.reward for t in traj.transitions] == [0, 0, 0, 1] and traj.transitions[-1].episode_done
    ts = traj.transitions
    for a, b in zip(ts, ts[1:]):
        seen = a.ob.to_ints() + a.ac.tokens
        assert b.ob.to_ints()[: len(seen)] == seen
    assert is_prefix_consistent(traj)


def test_a_scripted_episode_ends_as_a_rollout_does(renderer):
    """play_actions returned the last turn's observation as an ended episode's final_ob, where Trajectory and the
    rollout have it empty; with actions left to play, final_ob is the turn that was not played."""
    ended = _play_scripted(GuessNumberEnv(21, renderer), renderer, GAME)
    assert ended.transitions[-1].episode_done and ended.final_ob.to_ints() == []
    cut = _play_scripted(GuessNumberEnv(21, renderer), renderer, GAME[:2])
    assert not cut.transitions[-1].episode_done and cut.final_ob.length > cut.transitions[-1].ob.length


def _char_by_char(renderer, text):
    """A legal but non-canonical tokenization: one token per character, as a sampler may produce."""
    ids = [renderer.tokenizer.convert_tokens_to_ids(renderer.tokenizer.tokenize(ch))[0] for ch in text]
    return ids + renderer.get_stop_sequences()


def test_a_non_canonical_reply_breaks_the_prefix_with_bpe_but_not_with_characters(char_tokenizer):
    bpe = ChatMLRenderer(make_bpe_tokenizer())
    text = "The answer is 12"
    assert bpe.tokenizer.encode(text, add_special_tokens=False) != _char_by_char(bpe, text)[:-1]  # BPE merges
    traj = _play_scripted(GuessNumberEnv(21, bpe), bpe, [text, "0-31: 21"], encode=_char_by_char)
    assert not is_prefix_consistent(traj)
    char = ChatMLRenderer(char_tokenizer)  # one character is one token: every tokenization is canonical
    assert is_prefix_consistent(_play_scripted(GuessNumberEnv(21, char), char, [text, "0-31: 21"], _char_by_char))


class ForgetfulRenderer(ChatMLRenderer):
    """Re-renders earlier assistant turns without their scratchpad (as templates that strip earlier reasoning do)."""

    def build_generation_prompt(self, messages):
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        trimmed = [
            {**m, "content": m["content"].split(": ")[-1]} if m["role"] == "assistant" and i < last else m
            for i, m in enumerate(messages)
        ]
        return super().build_generation_prompt(trimmed)


def test_a_renderer_that_breaks_the_prefix_falls_back_to_one_datum_per_turn(char_tokenizer):
    r = ForgetfulRenderer(char_tokenizer)
    traj = _play_scripted(GuessNumberEnv(21, r), r, GAME)
    assert not is_prefix_consistent(traj)
    datums, merged = trajectory_to_datums(traj, 0.5)
    assert not merged and len(datums) == len(traj.transitions)
    for d, t in zip(datums, traj.transitions):  # each turn is scored on exactly the tokens it was sampled from
        assert d.model_input.to_ints() == (t.ob.to_ints() + t.ac.tokens)[:-1]
    with pytest.raises(ValueError, match="not one sequence"):
        merged_datum(traj, 0.5)


# ---------------------------------------------------------------- the merged datum


def test_merged_datum_masks_every_environment_token(renderer):
    traj = _play_scripted(GuessNumberEnv(21, renderer), renderer, GAME)
    d = merged_datum(traj, 0.7)
    tokens = d.model_input.to_ints() + [int(d.loss_fn_inputs["target_tokens"][-1])]
    assert tokens == traj.transitions[-1].ob.to_ints() + traj.transitions[-1].ac.tokens
    # independent reference: mark the action tokens by their positions in the final sequence
    action = [False] * len(tokens)
    for t in traj.transitions:
        start = t.ob.length
        assert tokens[start : start + len(t.ac.tokens)] == t.ac.tokens
        action[start : start + len(t.ac.tokens)] = [True] * len(t.ac.tokens)
    mask = d.loss_fn_inputs["mask"]
    assert mask.tolist() == [float(a) for a in action[1:]]
    assert d.loss_fn_inputs["advantages"].tolist() == pytest.approx([0.7 * float(a) for a in action[1:]])
    assert mask.sum() == sum(len(t.ac.tokens) for t in traj.transitions)
    lp = [x for t in traj.transitions for x in t.ac.logprobs]
    assert d.loss_fn_inputs["logprobs"][mask == 1].tolist() == pytest.approx(lp)


def _loss_and_grads(model, tokenizer, datums, aggregation):
    model = copy.deepcopy(model)
    trainer = TrainingClient(model, tokenizer)
    out = trainer.forward_backward(datums, "importance_sampling", aggregation=aggregation).result()
    return out.loss, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("aggregation", ["sum", "token_mean"])
def test_merged_datum_equals_the_per_turn_datums_in_loss_and_gradient(char_tokenizer, small_model, aggregation):
    r = ChatMLRenderer(char_tokenizer)
    traj = _play_scripted(GuessNumberEnv(21, r), r, GAME)
    loss_m, grads_m = _loss_and_grads(small_model, char_tokenizer, [merged_datum(traj, 0.7)], aggregation)
    loss_t, grads_t = _loss_and_grads(small_model, char_tokenizer, per_turn_datums(traj, 0.7), aggregation)
    assert loss_m == pytest.approx(loss_t, rel=1e-5)
    for a, b in zip(grads_m, grads_t):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # the same comparison catches a merge that also trains the environment's tokens
    loss_b, _ = _loss_and_grads(small_model, char_tokenizer, [_trains_everything(merged_datum(traj, 0.7))], aggregation)
    assert loss_b != pytest.approx(loss_t, rel=1e-3)


def _trains_everything(d):
    """The bug: mask 1 and the advantage on every token, the environment's included."""
    ones = torch.ones_like(d.loss_fn_inputs["mask"])
    adv = d.loss_fn_inputs["advantages"].max()
    return type(d)(d.model_input, {**d.loss_fn_inputs, "mask": ones, "advantages": adv * ones})


def test_environment_tokens_get_exactly_zero_gradient(char_tokenizer, small_model):
    from edurl.llm.losses import rl_objective

    r = ChatMLRenderer(char_tokenizer)
    d = merged_datum(_play_scripted(GuessNumberEnv(21, r), r, GAME), 0.7)
    f = d.loss_fn_inputs

    def logit_grads(f):
        logits = small_model(input_ids=torch.tensor([d.model_input.to_ints()])).logits.detach().requires_grad_()
        lp = torch.log_softmax(logits, -1).gather(-1, f["target_tokens"][None, :, None])[..., 0]
        loss, _ = rl_objective(
            lp, f["logprobs"][None], f["advantages"][None], f["mask"][None], loss_fn="importance_sampling"
        )
        loss.backward()
        return logits.grad[0]  # (T, V): the gradient at each position's next-token logits

    grads = logit_grads(f)
    env = f["mask"] == 0
    assert torch.count_nonzero(grads[env]) == 0  # exactly zero, not small
    assert (grads[~env].abs().sum(-1) > 0).all()
    # the bug sends gradient into the environment's tokens
    assert torch.count_nonzero(logit_grads(_trains_everything(d).loss_fn_inputs)[env]) > 0


# ---------------------------------------------------------------- rollouts


class CountingSampler(SamplingClient):
    def __init__(self, *args):
        super().__init__(*args)
        self.calls = []

    def sample_batch(self, prompts, num_samples=1, sampling_params=None):
        self.calls.append(len(prompts))
        return super().sample_batch(prompts, num_samples, sampling_params)


def test_rollouts_batch_the_waiting_envs_and_record_what_the_model_saw(char_tokenizer, small_model):
    r = ChatMLRenderer(char_tokenizer)
    sampler = CountingSampler(small_model, char_tokenizer)
    builders = [GuessNumberGroupBuilder(s, r, group_size=4) for s in (3, 17, 30)]
    groups = do_group_rollouts(builders, sampler, SamplingParams(max_tokens=8, temperature=1.0, seed=0))
    assert len(groups) == 3 and all(len(g.trajectories) == 4 for g in groups)
    assert sampler.calls[0] == 12 and len(sampler.calls) <= 5  # one batched call per round, not per env
    assert sum(sampler.calls) == sum(t.num_turns for g in groups for t in g.trajectories)
    for g in groups:
        for t in g.trajectories:
            assert t.transitions[-1].episode_done and not any(x.episode_done for x in t.transitions[:-1])
            assert t.transitions[0].ob.to_ints() == r.build_generation_prompt(GuessNumberEnv(0, r).initial_messages())
    again = do_group_rollouts(builders, sampler, SamplingParams(max_tokens=8, temperature=1.0, seed=0))
    assert [t.transitions[-1].ac.tokens for g in again for t in g.trajectories] == [
        t.transitions[-1].ac.tokens for g in groups for t in g.trajectories
    ]


def test_rollouts_take_any_seed_a_step_can_have(char_tokenizer, small_model):
    # a turn's seed was seed * 1009 + ..., past 2**63 for a config seed of about 1.8e10 (a millisecond timestamp
    # is 1.7e12), and the sampler raised "Overflow when unpacking long long" at the first step
    r = ChatMLRenderer(char_tokenizer)
    builders = [GuessNumberGroupBuilder(3, r, group_size=2)]
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=2**63 - 1)
    groups = do_group_rollouts(builders, SamplingClient(small_model, char_tokenizer), params)
    assert len(groups[0].trajectories) == 2


class EchoEnv(Env):
    """Three turns of 5 tokens each (no stop token: every turn ends at max_tokens); after each, the environment
    appends ``k`` tokens of its own, k differing by env and turn, so the batch's conversations differ in length."""

    def __init__(self, k: int):
        self.k, self.turn, self.ob = k, 0, [7, 8, 9][: 1 + k % 3]

    def initial_observation(self):
        return ModelInput.from_ints(self.ob), []

    def step(self, action):
        self.turn += 1
        self.ob = self.ob + list(action) + [10 + self.turn] * (1 + (self.k + self.turn) % 4)
        done = self.turn == 3
        return StepResult(0.0, done, ModelInput.from_ints([] if done else self.ob), [], {})


class CachingSampler(SamplingClient):
    """Records the prefix cache the rollout passes (each instance its own list)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.caches = []

    def sample_batch(self, prompts, num_samples=1, sampling_params=None, prefix_cache=None, cache_keys=None):
        self.caches.append(prefix_cache)
        return super().sample_batch(prompts, num_samples, sampling_params, prefix_cache, cache_keys)


def test_rollouts_with_a_prefix_cache_draw_what_whole_prefills_draw(char_tokenizer, small_model):
    builders = [ProblemGroupBuilder(lambda k=k: EchoEnv(k), group_size=3) for k in range(4)]
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3)
    sampler = CachingSampler(small_model, char_tokenizer)
    cached = do_group_rollouts(builders, sampler, params, prefix_cache=True)
    cache = sampler.caches[-1]
    assert len({id(c) for c in sampler.caches}) == 1  # one cache for the whole rollout
    assert (cache.hits, cache.misses) == (24, 0)  # turns 2 and 3 of all 12 episodes
    whole = do_group_rollouts(builders, sampler, params)
    assert sampler.caches[-1] is None
    for a, b in zip(
        [t for g in cached for t in g.trajectories], [t for g in whole for t in g.trajectories], strict=True
    ):
        for x, y in zip(a.transitions, b.transitions, strict=True):
            assert x.ob.to_ints() == y.ob.to_ints() and x.ac.tokens == y.ac.tokens
            assert x.ac.logprobs == pytest.approx(y.ac.logprobs, abs=1e-5)


def test_training_the_environment_tokens_shows_in_kl_sample_train(char_tokenizer, small_model):
    # the metric that catches the bug: on real rollouts, sampler and trainer agree on every action token, but an
    # environment token has no sampling log-prob (0 in the datum), so a mask that includes it drives the KL up
    r = ChatMLRenderer(char_tokenizer)
    sampler = SamplingClient(small_model, char_tokenizer)
    groups = do_group_rollouts(
        [GuessNumberGroupBuilder(s, r, 2) for s in (5, 9)], sampler, SamplingParams(max_tokens=6, seed=1)
    )
    good = [merged_datum(t, 1.0) for g in groups for t in g.trajectories]
    bad = [_trains_everything(d) for d in good]
    trainer = TrainingClient(copy.deepcopy(small_model), char_tokenizer)
    kl_good = trainer.forward_backward(good, "importance_sampling").result().metrics["optim/kl_sample_train_v2"]
    kl_bad = trainer.forward_backward(bad, "importance_sampling").result().metrics["optim/kl_sample_train_v2"]
    assert kl_good < 1e-8 and kl_bad > 1.0


def test_group_advantages_and_datums(char_tokenizer):
    r = ChatMLRenderer(char_tokenizer)
    win = _play_scripted(GuessNumberEnv(21, r), r, GAME)
    lose = _play_scripted(GuessNumberEnv(21, r), r, ["0-31: 1"] * 5)
    from edurl.llm.envs import TrajectoryGroup

    group = TrajectoryGroup([win, lose, lose, lose], [0.0] * 4)
    assert group.advantages() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    datums, row = groups_to_datums([group, TrajectoryGroup([lose, lose], [0.0, 0.0])])  # the uniform group: none
    assert len(datums) == 4 and row["env/all/merged_fraction"] == 1.0


def test_a_uniform_group_gives_no_datums_whatever_its_reward(char_tokenizer):
    # eight episodes at 0.9 (a tool cost of 0.1): the mean of eight 0.9s is not 0.9 in floating point, so the
    # advantages were once -1.1e-16, the group was kept, and its tokens joined a mean loss's denominator
    from edurl.llm.envs import TrajectoryGroup

    r = ChatMLRenderer(char_tokenizer)
    episode = _play_scripted(
        CalculatorEnv("123+456=?", "579", r, tool_cost=0.1), r, ["<calc>123+456</calc>", "\\boxed{579}"]
    )
    assert episode.total_reward == pytest.approx(0.9) and sum([episode.total_reward] * 8) / 8 != episode.total_reward
    group = TrajectoryGroup([episode] * 8, [0.0] * 8)
    assert group.advantages() == [0.0] * 8
    assert group.turn_advantages() == [[0.0, 0.0]] * 8
    for per_turn in (False, True):
        assert groups_to_datums([group], per_turn_credit=per_turn)[0] == []


def test_equal_rewards_summed_in_another_order_are_a_uniform_group(char_tokenizer):
    # 0.1 + 1.1 is 1.2000000000000002 and 0.2 + 1.0 is 1.2 (a scratchpad bonus on different turns): the group was
    # once "mixed", with advantages of 1e-16, so it gave datums and counted in frac_mixed
    from dataclasses import replace

    from edurl.llm.envs import TrajectoryGroup, rollout_metrics

    r = ChatMLRenderer(char_tokenizer)
    episode = _play_scripted(CalculatorEnv("123+456=?", "579", r), r, ["<calc>123+456</calc>", "\\boxed{579}"])

    def with_rewards(*rewards):
        return replace(episode, transitions=[replace(t, reward=x) for t, x in zip(episode.transitions, rewards)])

    a, b = with_rewards(0.1, 1.1), with_rewards(0.2, 1.0)
    assert a.total_reward != b.total_reward
    group = TrajectoryGroup([a, b, a, b], [0.0] * 4)
    assert group.advantages() == [0.0] * 4
    assert group.turn_advantages(discount=0.0)[0] == pytest.approx([-0.05, 0.05])  # the turns still differ
    assert groups_to_datums([group])[0] == []
    assert rollout_metrics([group])["env/all/by_group/frac_mixed"] == 0.0
    mixed = TrajectoryGroup([a, with_rewards(0.2, 1.0 + 1e-6)], [0.0] * 2)  # a real difference is kept
    assert mixed.advantages() == pytest.approx([-5e-7, 5e-7], abs=1e-12)


def test_group_rewards_advantages_and_turns_off_the_usual_path(char_tokenizer, small_model):
    import numpy as np

    from edurl.llm.envs import TrajectoryGroup

    r = ChatMLRenderer(char_tokenizer)
    win = _play_scripted(GuessNumberEnv(21, r), r, GAME)
    # one group reward for four episodes: zip kept one episode and dropped three, without a word
    with pytest.raises(ValueError, match="1 group rewards for 4 episodes"):
        TrajectoryGroup([win] * 4, [0.0])
    # a NumPy or 0-d tensor advantage is one number for every turn, as a float is (both raised a TypeError)
    want = merged_datum(win, 0.5).loss_fn_inputs["advantages"]
    for advantage in (np.float32(0.5), torch.tensor(0.5), np.float64(0.5)):
        assert torch.equal(merged_datum(win, advantage).loss_fn_inputs["advantages"], want)
    builders = [GuessNumberGroupBuilder(3, r, group_size=2)]
    with pytest.raises(ValueError, match="max_turns must be a whole number"):  # -1 played no turn at all
        do_group_rollouts(builders, SamplingClient(small_model, char_tokenizer), SamplingParams(max_tokens=4), -1)


def test_turn_advantages_credit_each_turn_with_what_came_after_it(char_tokenizer):
    from edurl.llm.envs import TrajectoryGroup

    r = ChatMLRenderer(char_tokenizer)
    win = _play_scripted(GuessNumberEnv(21, r, shaped=True), r, GAME)  # rewards 16, 9, 4, 3 (/32)
    short = _play_scripted(GuessNumberEnv(21, r, shaped=True), r, ["0-31: 21"])  # 32/32 at once
    group = TrajectoryGroup([win, short], [0.0, 0.5])  # a group reward on the short one's last turn
    # rewards to go: win [32, 16, 7, 3]/32, short [1.5]; turn 0's mean is (1 + 1.5)/2; later turns only win
    got = group.turn_advantages()
    assert got[0] == pytest.approx([1 - 1.25, 0, 0, 0]) and got[1] == pytest.approx([1.5 - 1.25])
    own = group.turn_advantages(discount=0.0)  # each turn's own reward: win 16, 9, 4, 3 (/32), short 1 + 0.5
    assert own[0] == pytest.approx([0.5 - 1.0, 0, 0, 0]) and own[1] == pytest.approx([1.5 - 1.0])
    half = group.turn_advantages(discount=0.5)[0]  # win's turn 0: (16 + 9/2 + 4/4 + 3/8)/32 against short's 1.5
    assert half[0] == pytest.approx((16 + 4.5 + 1 + 0.375) / 32 - ((16 + 4.5 + 1 + 0.375) / 32 + 1.5) / 2)
    d = merged_datum(win, got[0])
    assert d.loss_fn_inputs["advantages"][d.loss_fn_inputs["mask"] == 1].unique().tolist() == pytest.approx([-0.25, 0])
    with pytest.raises(ValueError, match="one per turn"):
        merged_datum(win, [0.1, 0.2])


class _NeverEnds(GuessNumberEnv):
    def step(self, action):
        result = super().step(action)
        ob = self.initial_observation()[0] if result.episode_done else result.next_observation
        return StepResult(0.0, False, ob, [4], {})


def test_an_env_that_never_ends_is_stopped_with_a_clear_error(char_tokenizer, small_model):
    r = ChatMLRenderer(char_tokenizer)
    builder = ProblemGroupBuilder(lambda: _NeverEnds(3, r), 2)
    with pytest.raises(RuntimeError, match="episode_done"):
        do_group_rollouts([builder], SamplingClient(small_model, char_tokenizer), SamplingParams(max_tokens=4), 3)


class _NothingAfterTheEnd(GuessNumberEnv):
    """Returns None for the observation and the stop condition of an ended episode, which the rollout never reads."""

    def step(self, action):
        result = super().step(action)
        if not result.episode_done:
            return result
        return StepResult(result.reward, True, None, None, result.metrics)


def test_an_ended_episodes_observation_and_stop_condition_are_not_read(char_tokenizer, small_model):
    r = ChatMLRenderer(char_tokenizer)
    builder = ProblemGroupBuilder(lambda: _NothingAfterTheEnd(3, r), 2)
    sampler = SamplingClient(small_model, char_tokenizer)
    (group,) = do_group_rollouts([builder], sampler, SamplingParams(max_tokens=4, seed=0), 3)
    assert all(t.transitions[-1].episode_done for t in group.trajectories)


def test_builder_rejects_an_env_factory_that_reuses_one_env(char_tokenizer):
    env = GuessNumberEnv(3, ChatMLRenderer(char_tokenizer))
    with pytest.raises(ValueError, match="same Env"):
        ProblemGroupBuilder(lambda: env, 2).make_envs()
    assert isinstance(GuessNumberGroupBuilder(3, ChatMLRenderer(char_tokenizer), 2), EnvGroupBuilder)


class _OneEnvTwice(EnvGroupBuilder):
    """A builder of one's own that returns one env twice (ProblemGroupBuilder refuses that; this one did not)."""

    def __init__(self, env):
        self.env = env

    def make_envs(self):
        return [self.env, self.env]


class _AsyncGuess(GuessNumberEnv):
    """Tinker's Env has async methods; one ported as it is was called without await."""

    async def initial_observation(self):
        return super().initial_observation()


def test_rollouts_refuse_one_env_twice_an_async_env_and_credit_for_an_empty_episode(char_tokenizer, small_model):
    """One env in two places was stepped twice a round (6 guesses in a 5-guess game, no error); an env with async
    def methods failed with "cannot unpack non-iterable coroutine object"; turn_advantages on an episode with no
    turns raised an IndexError where advantages() and merged_datum name it."""
    from edurl.llm.envs import Trajectory, TrajectoryGroup

    r = ChatMLRenderer(char_tokenizer)
    sampler, params = SamplingClient(small_model, char_tokenizer), SamplingParams(max_tokens=4, seed=0)
    env = GuessNumberEnv(3, r)
    for builders in ([_OneEnvTwice(env)], [ProblemGroupBuilder(lambda: GuessNumberEnv(3, r), 2), _OneEnvTwice(env)]):
        with pytest.raises(ValueError, match=r"builders\[\d\] \(_OneEnvTwice\).*already in this rollout"):
            do_group_rollouts(builders, sampler, params, 3)
    with pytest.raises(TypeError, match=r"_AsyncGuess.initial_observation is an async def .*plain def"):
        do_group_rollouts([ProblemGroupBuilder(lambda: _AsyncGuess(3, r), 2)], sampler, params, 3)
    win = _play_scripted(GuessNumberEnv(21, r, shaped=True), r, GAME)
    with pytest.raises(ValueError, match="trajectory 1 has no transitions; an episode needs at least one model turn"):
        TrajectoryGroup([win, Trajectory([], None)], [0.0, 0.0]).turn_advantages()


def test_guess_number_refuses_a_secret_or_range_no_guess_can_meet(char_tokenizer):
    """GuessNumberEnv(3.5) was a game no (integer) guess wins; win_rate on an empty range divided by zero or gave
    a rate (1.0 for random_blind on [5, 3])."""
    r = ChatMLRenderer(char_tokenizer)
    for kwargs, message in [
        (dict(secret=3.5), "secret must be a whole number"),
        (dict(secret=True), "secret must be a whole number"),
        (dict(secret=3, low=0.5, high=9.5), "low and high must be whole numbers"),
        (dict(secret=3, low=5, high=4), r"the range \[5, 4\] is empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            GuessNumberEnv(renderer=r, **kwargs)
    for player in ("bisect", "random_in_range", "random_blind"):
        for low, high in ((5, 4), (5, 3)):
            with pytest.raises(ValueError, match="is empty: high must be >= low"):
                win_rate(player, low, high)
        with pytest.raises(ValueError, match="tries must be an int >= 0"):
            win_rate(player, tries=-1)
    import numpy as np

    assert GuessNumberEnv(np.int64(3), r).secret == 3  # a NumPy secret, as rng.integers draws it


# ---------------------------------------------------------------- guess the number


def test_a_guess_of_thousands_of_digits_is_a_wrong_guess(char_tokenizer):
    # int() refuses more than 4300 digits: the env once raised, and lost the whole batch of rollouts
    r = ChatMLRenderer(char_tokenizer)
    env = GuessNumberEnv(21, r)
    env.initial_observation()
    res = env.step(_encode(r, "9" * 5000))
    assert not res.episode_done and res.metrics["illegal"] == 0 and res.metrics["win"] == 0
    assert parse_guess("-" + "9" * 5000) < -(10**18) and parse_guess("then 0021") == 21 and parse_guess("-0") == 0
    assert parse_guess("\u0664\u0666") is None  # Arabic-Indic digits are no guess, as grade() reads them


def test_shaped_rewards_refuse_a_guess_penalty(char_tokenizer):
    # with shaped rewards a loss that leaves one number earns 31/32, and the penalty is charged on wins only: at
    # 0.05 a 5-guess win totalled 0.75, less than that loss
    with pytest.raises(ValueError, match="narrow loss more than a late win"):
        GuessNumberEnv(16, ChatMLRenderer(char_tokenizer), shaped=True, guess_penalty=0.05)
    # 5 x 0.001 < 1/32: a 5-guess win (0.995) still beats that loss (0.969), so it is allowed
    GuessNumberEnv(16, ChatMLRenderer(char_tokenizer), shaped=True, guess_penalty=0.001)
    with pytest.raises(ValueError, match="no penalty is safe"):
        GuessNumberEnv(16, ChatMLRenderer(char_tokenizer), shaped=True, relative=True, guess_penalty=0.001)


def test_guess_number_rules(char_tokenizer):
    r = ChatMLRenderer(char_tokenizer)
    traj = _play_scripted(GuessNumberEnv(21, r, guess_penalty=0.05), r, GAME)
    assert traj.total_reward == pytest.approx(1 - 0.05 * 4) and traj.transitions[-1].metrics["guesses"] == 4
    lost = _play_scripted(GuessNumberEnv(21, r), r, ["7"] * 9)
    assert lost.num_turns == 5 and lost.total_reward == 0 and lost.transitions[-1].metrics["win"] == 0
    env = GuessNumberEnv(21, r)
    env.initial_observation()
    res = env.step(_encode(r, "no idea"))
    assert not res.episode_done and res.metrics["illegal"] == 1
    assert r.tokenizer.decode(res.next_observation.tokens).endswith(
        "Say a number from 0 to 31.<|im_end|>\n<|im_start|>assistant\n"
    )
    cut = env.step(r.tokenizer.encode("1", add_special_tokens=False))  # no <|im_end|>: truncated
    assert cut.episode_done and cut.metrics["truncated"] == 1 and cut.reward == 0 and cut.metrics["win"] == 0
    with pytest.raises(ValueError, match="outside"):
        GuessNumberEnv(32, r)


def test_shaped_rewards_rule_out_numbers_and_add_up_to_one_for_a_win(char_tokenizer):
    r = ChatMLRenderer(char_tokenizer)
    win = _play_scripted(GuessNumberEnv(21, r, shaped=True), r, GAME)  # 15, 23, 19, 21
    # 0-31 -> 16-31 rules out 16 of 32; -> 16-22 rules out 9; -> 20-22 rules out 4; the hit rules out the last 3
    assert [t.reward for t in win.transitions] == pytest.approx([16 / 32, 9 / 32, 4 / 32, 3 / 32])
    assert win.total_reward == pytest.approx(1.0) and win.transitions[-1].metrics["central"] == 1.0
    lost = _play_scripted(GuessNumberEnv(21, r, shaped=True), r, ["0", "31", "31", "x", "1"])
    # 0 rules out 1; 31 rules out 1; 31 again and "x" rule out nothing; 1 rules out 1: 29 numbers still possible
    assert [t.reward for t in lost.transitions] == pytest.approx([1 / 32, 1 / 32, 0, 0, 1 / 32])
    assert lost.total_reward == pytest.approx(1 - 29 / 32) and lost.transitions[-1].metrics["win"] == 0
    assert lost.transitions[-1].metrics["central"] == 0.0  # edges, repeats and no number: none in the middle
    # win_bonus puts the game's own reward back on the winning guess only
    bonus = _play_scripted(GuessNumberEnv(21, r, shaped=True, win_bonus=1.0), r, GAME)
    assert [t.reward for t in bonus.transitions] == pytest.approx([16 / 32, 9 / 32, 4 / 32, 3 / 32 + 1])
    lost_bonus = _play_scripted(GuessNumberEnv(21, r, shaped=True, win_bonus=1.0), r, ["0", "31", "31", "x", "1"])
    assert lost_bonus.total_reward == pytest.approx(lost.total_reward)
    with pytest.raises(ValueError, match="win_bonus"):
        GuessNumberEnv(21, r, win_bonus=1.0)  # without shaped=True the win is already worth 1


def test_scratchpad_ok_counts_replies_that_name_the_range_still_possible(char_tokenizer):
    r = ChatMLRenderer(char_tokenizer)
    # secret 21: right, right, a stale range (16-31 after "lower" at 23), then a wrong middle
    replies = ["0-31 mid 15: 15", "16-31 mid 23: 23", "16-31 mid 23: 19", "20-22 mid 20: 21"]
    t = _play_scripted(GuessNumberEnv(21, r), r, replies)
    assert [x.metrics["scratchpad_ok"] for x in t.transitions] == pytest.approx([1, 1, 2 / 3, 2 / 4])
    assert _play_scripted(GuessNumberEnv(21, r), r, GAME).transitions[-1].metrics["scratchpad_ok"] == 0  # no "mid"


def test_scratchpad_bonus_pays_each_reply_whose_scratchpad_is_right(char_tokenizer):
    r = ChatMLRenderer(char_tokenizer)
    # secret 21: right, right, a stale range, a wrong middle
    replies = ["0-31 mid 15: 15", "16-31 mid 23: 23", "16-31 mid 23: 19", "20-22 mid 20: 21"]
    plain = _play_scripted(GuessNumberEnv(21, r, shaped=True, relative=True), r, replies)
    paid = _play_scripted(GuessNumberEnv(21, r, shaped=True, relative=True, scratchpad_bonus=0.1), r, replies)
    extra = [b.reward - a.reward for a, b in zip(plain.transitions, paid.transitions, strict=True)]
    assert extra == pytest.approx([0.1, 0.1, 0.0, 0.0])
    # without shaping: 0 per guess and 1 for the win, plus the bonus on the right scratchpads
    win = _play_scripted(GuessNumberEnv(21, r, scratchpad_bonus=0.25), r, replies)
    assert [t.reward for t in win.transitions] == pytest.approx([0.25, 0.25, 0.0, 1.0])
    with pytest.raises(ValueError, match="scratchpad_bonus"):
        GuessNumberEnv(21, r, scratchpad_bonus=-0.1)


def test_relative_shaping_pays_the_share_of_what_was_still_possible(char_tokenizer):
    r = ChatMLRenderer(char_tokenizer)
    win = _play_scripted(GuessNumberEnv(21, r, shaped=True, relative=True), r, GAME)  # 15, 23, 19, 21
    # 16 of 32 ruled out; then 9 of the 16 left (16-31 -> 16-22); 4 of 7 (-> 20-22); the hit rules out the last 3
    assert [t.reward for t in win.transitions] == pytest.approx([16 / 32, 9 / 16, 4 / 7, 3 / 3])
    lost = _play_scripted(GuessNumberEnv(21, r, shaped=True, relative=True), r, ["0", "31", "31", "x", "1"])
    assert [t.reward for t in lost.transitions] == pytest.approx([1 / 32, 1 / 31, 0, 0, 1 / 30])
    with pytest.raises(ValueError, match="shaped=True"):
        GuessNumberEnv(21, r, relative=True)


def test_win_rates_are_exact():
    assert win_rate("bisect") == 31 / 32  # 5 guesses tell apart at most 31 numbers
    assert win_rate("random_blind") == 5 / 32
    rng = random.Random(0)
    n = 20000
    wins = sum(play(random_guess, rng.randrange(32), rng)[1] for _ in range(n))
    assert abs(wins / n - win_rate("random_in_range")) < 4 * (0.25 / n) ** 0.5
    assert all(play(bisect_guess, s, rng, tries=6)[1] for s in range(32))


# ---------------------------------------------------------------- the calculator


@pytest.mark.parametrize(
    "expr, value", [("123+456", 579), ("2*3+4", 10), ("2*(3+4)", 14), ("-5+2", -3), (" 7 - 10 ", -3), ("-(-5)", 5)]
)
def test_calculate(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize(
    "expr, why",
    [("", "empty"), ("1+", "too early"), ("(2", "missing"), ("2**3", "expected a number"), ("os.system", "unexpected")],
)
def test_calculate_rejects_malformed_expressions(expr, why):
    with pytest.raises(ToolError, match=why):
        calculate(expr)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_calculate_never_raises_anything_but_tool_error(text):
    try:
        assert isinstance(calculate(text), int)
    except ToolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789+-*() <>/calcx\\{}", max_size=40))
def test_calculator_env_survives_any_reply(text):
    from edurl.llm.tokenizer import build_char_tokenizer

    r = ChatMLRenderer(build_char_tokenizer())
    env = CalculatorEnv("123+456=?", "579", r)
    env.initial_observation()
    res = env.step(_encode(r, text))
    assert isinstance(res, StepResult)
    if not res.episode_done:
        shown = r.tokenizer.decode(res.next_observation.tokens)
        assert "<|im_start|>tool\n" in shown


def test_a_calculator_reply_cut_off_is_graded_as_chapter_7_grades_it(char_tokenizer):
    # a cut-off reply once scored 0, above every finished wrong answer and free of the tool's cost
    r = ChatMLRenderer(char_tokenizer)
    call = _encode(r, "<calc>123+456</calc>")
    cut = r._encode("\\boxed{1")  # no stop token: it ran out of max_tokens

    def total(*actions):
        return play_actions(CalculatorEnv("123+456=?", "579", r, tool_cost=0.2), list(actions)).total_reward

    assert total(call, cut) == pytest.approx(-0.1 - 0.2)  # format 0, not correct, one call
    assert total(call, cut) <= total(call, _encode(r, "I do not know")) < total(call, _encode(r, "\\boxed{1}"))
    right_but_cut = play_actions(CalculatorEnv("123+456=?", "579", r), [r._encode("\\boxed{579} and so")])
    assert right_but_cut.total_reward == pytest.approx(0.9)  # correct, format 0: Chapter 7's 0.9
    assert right_but_cut.transitions[-1].metrics["truncated"] == 1.0
    assert right_but_cut.transitions[-1].metrics["correct"] == 1.0


def test_calculator_episode(char_tokenizer):
    r = ChatMLRenderer(char_tokenizer)
    traj = _play_scripted(CalculatorEnv("123+456=?", "579", r), r, ["<calc>123+456</calc>", "\\boxed{579}"])
    shown = r.tokenizer.decode(traj.transitions[1].ob.tokens)
    assert "<|im_start|>tool\n579<|im_end|>" in shown and is_prefix_consistent(traj)
    assert traj.total_reward == 1 and traj.transitions[-1].metrics["used_tool"] == 1
    direct = _play_scripted(CalculatorEnv("123+456=?", "579", r), r, ["\\boxed{578}"])
    assert direct.total_reward == 0 and direct.transitions[-1].metrics["used_tool"] == 0
    off = _play_scripted(
        CalculatorEnv("123+456=?", "579", r, tool_enabled=False), r, ["<calc>1+1</calc>", "\\boxed{579}"]
    )
    assert "error: no calculator" in r.tokenizer.decode(off.transitions[1].ob.tokens)
    assert run_tool("<calc>1+</calc>").startswith("error: ") and run_tool("<calc>").startswith("error: ")
    many = _play_scripted(CalculatorEnv("1+1=?", "2", r, max_tool_calls=2), r, ["<calc>1+1</calc>"] * 5)
    assert many.num_turns == 3 and many.transitions[-1].metrics["tool_calls"] == 2


class _Quiz:
    """A MessageEnv that keeps asking until it hears an answer: -0.5 for a wrong one, 1 for the right one."""

    @staticmethod
    def make(renderer, max_turns=2):
        from edurl.llm.envs.base import MessageEnv

        class Quiz(MessageEnv):
            def initial_messages(self):
                return [{"role": "user", "content": "2+2=?"}]

            def reply(self, text):
                if text.startswith("answer "):
                    right = text == "answer 4"
                    return (1.0 if right else -0.5), True, [], {"correct": float(right)}
                return 0.0, False, [{"role": "user", "content": "go on"}], {}

            def truncated_metrics(self):
                return {"correct": 0.0}

            def truncated(self, text):
                return -1.0, self.truncated_metrics()

        env = Quiz(renderer)
        env.max_turns = max_turns
        return env


def test_running_out_of_turns_is_graded_as_a_cut_off_reply_and_flagged(char_tokenizer):
    """The max_turns safety net used to end the episode with the last reply's reward (0 here, above a wrong
    answer's -0.5), no turn_limit flag and none of truncated_metrics' keys."""
    r = ChatMLRenderer(char_tokenizer)
    wrong = play_actions(_Quiz.make(r), [_encode(r, "answer 5")])
    stalled = play_actions(_Quiz.make(r), [_encode(r, "hmm")] * 2)
    assert wrong.total_reward == -0.5 and stalled.num_turns == 2
    assert stalled.total_reward == -1.0 < wrong.total_reward  # the env's truncated() grade, added to the reply's 0
    assert stalled.transitions[-1].episode_done
    assert stalled.transitions[-1].metrics == {"truncated": 0.0, "turn_limit": 1.0, "correct": 0.0}
    assert stalled.transitions[0].metrics == {"truncated": 0.0, "turn_limit": 0.0}  # the first turn went on
    assert wrong.transitions[-1].metrics == {"truncated": 0.0, "turn_limit": 0.0, "correct": 0.0}
    # a reply that ends the episode on the last allowed turn is the env's own ending, not the safety net's
    last = play_actions(_Quiz.make(r), [_encode(r, "hmm"), _encode(r, "answer 4")])
    assert last.total_reward == 1.0 and last.transitions[-1].metrics["turn_limit"] == 0.0


def test_too_many_signs_are_not_called_parentheses():
    with pytest.raises(ToolError, match=r"nested too deep \(parentheses or signs\)"):
        calculate("-" * 12 + "1")
    with pytest.raises(ToolError, match="nested too deep"):
        calculate("(" * 12 + "1" + ")" * 12)


class ScriptedSampler:
    """Answers every prompt with the same tokens and stop_reason (a model whose generation config stops on
    <|endoftext|>, as Qwen2.5-Instruct's does, or one cut off by max_tokens)."""

    def __init__(self, tokens, stop_reason):
        self.tokens, self.stop_reason = tokens, stop_reason

    def sample_batch(self, prompts, num_samples=1, sampling_params=None):
        from edurl.llm.clients import SampledSequence, SampleResponse

        seq = SampledSequence(list(self.tokens), [-0.5] * len(self.tokens), self.stop_reason)
        return [SampleResponse([seq] * num_samples) for _ in prompts]


def test_a_message_env_grades_a_reply_by_the_samplers_stop_reason(char_tokenizer):
    """Env.step takes tokens only (Tinker's API), so a reply that a real chat model ended on <|endoftext|> (stop
    reason 'stop') was graded as cut off in an env: truncated = 1 and format 0, where GRPO and evaluate() grade
    it complete. do_group_rollouts now hands a MessageEnv the sampler's stop_reason; the same tokens with
    'length' stay cut off, and a scripted action's transition records whether it ended on the stop token."""
    r = ChatMLRenderer(char_tokenizer)
    reply = [*r._encode("\\boxed{579}"), char_tokenizer.convert_tokens_to_ids("<|endoftext|>")]

    def rollout(stop_reason):
        builder = ProblemGroupBuilder(lambda: CalculatorEnv("123+456=?", "579", r), group_size=2)
        (group,) = do_group_rollouts([builder], ScriptedSampler(reply, stop_reason), SamplingParams(max_tokens=16))
        return group.trajectories[0].transitions[-1]

    ended, cut = rollout("stop"), rollout("length")
    assert ended.metrics["truncated"] == 0.0 and ended.metrics["correct"] == 1.0 and ended.reward == pytest.approx(1)
    assert ended.ac.stop_reason == "stop"
    assert cut.metrics["truncated"] == 1.0 and cut.reward == pytest.approx(0.9) and cut.ac.stop_reason == "length"
    scripted = play_actions(CalculatorEnv("123+456=?", "579", r), [r._encode("\\boxed{57"), _encode(r, "x")])
    assert [t.ac.stop_reason for t in scripted.transitions] == ["length"]  # cut off: the episode ended there
    scripted = play_actions(CalculatorEnv("123+456=?", "579", r), [_encode(r, "\\boxed{579}")])
    assert [t.ac.stop_reason for t in scripted.transitions] == ["stop"]

    class TwoStops(Env):  # each id of a stop condition ends a turn on its own, as sampling treats it
        def initial_observation(self):
            return ModelInput.from_ints([1]), [5, 6]

        def step(self, action):
            return StepResult(0.0, False, ModelInput.from_ints([1, *action]), [5, 6], {})

    scripted = play_actions(TwoStops(), [[9, 5], [9, 6], [5, 6], [9]])
    assert [t.ac.stop_reason for t in scripted.transitions] == ["stop", "stop", "stop", "length"]

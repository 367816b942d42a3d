"""Multi-turn environments in the Tinker Cookbook's shapes, rollouts, and episodes as datums (Chapter 9).

An episode alternates between the model and the environment::

    ob_0, stop = env.initial_observation()            the prompt, as token ids
    ac_0       = sample(ob_0, stop)                   the model's turn (tokens + sampling log-probs)
    result     = env.step(ac_0)                       reward, episode_done, next_observation ob_1, ...
    ac_1       = sample(ob_1, stop)                   ob_1 is the whole conversation so far
    ...                                               until result.episode_done

Each (ob_k, ac_k, reward_k) is a :class:`Transition`; the list of them is a :class:`Trajectory`. An
:class:`EnvGroupBuilder` makes G environments for one problem, so that Chapter 7's group-relative advantages
apply to whole episodes: the advantage of an episode is its total reward minus its group's mean.

**Episodes as datums.** When every observation extends the previous observation and action token for token
(``ob_k+1[:len(ob_k) + len(ac_k)] == ob_k + ac_k``), the whole episode is one sequence ``ob_last + ac_last``, and
it becomes one datum: the model's tokens get mask 1 and the episode's advantage, and the environment's tokens
(its replies, the next turn's header) get mask 0, so they never receive a gradient. When a renderer re-encodes
an earlier turn differently (a non-canonical tokenization re-encoded, a reply trimmed), the prefix test fails
and the episode becomes one datum per turn instead: each turn is scored on the exact tokens it was sampled
from, never on misaligned ones. :func:`trajectory_to_datums` does both, and says which.

Every call that Tinker's ``Env`` makes async has a sync version here (``initial_observation``, ``step``) and an
async twin (``initial_observation_async``, ``step_async``), as in :mod:`edurl.llm.clients`.
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from edurl._checks import check_count
from edurl.llm.clients import SamplingClient
from edurl.llm.datum import Datum, ModelInput, build_datum
from edurl.llm.renderer import ChatMLRenderer, Message
from edurl.llm.sampling import PrefixCache, SamplingParams

StopCondition = list[int]
"""Token ids that end the model's turn (e.g. ``<|im_end|>``)."""


@dataclass
class TokensWithLogprobs:
    """The model's turn: the sampled tokens (the stop token included when it stopped) and their sampling log-probs."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str = "stop"
    """"stop" when the turn ended with a stop token, "length" when it hit max_tokens."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(
                f"{len(self.tokens)} tokens but {len(self.logprobs)} log-probs; pass one sampling log-prob per token"
            )


@dataclass
class StepResult:
    """What :meth:`Env.step` returns."""

    reward: float
    """The reward of this step (a shaped reward, or 0 until the end)."""
    episode_done: bool
    """True when the episode is over; then next_observation is empty."""
    next_observation: ModelInput
    """The whole conversation so far, ending where the model speaks next."""
    next_stop_condition: StopCondition
    """The stop tokens of the model's next turn."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers to log (e.g. ``{"win": 1.0, "guesses": 3}``), averaged over episodes with an ``env/`` prefix."""


@dataclass
class Transition:
    """One turn of an episode: what the model saw, what it did, and what it got."""

    ob: ModelInput
    ac: TokensWithLogprobs
    reward: float
    episode_done: bool
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One episode."""

    transitions: list[Transition]
    final_ob: ModelInput
    """The observation after the last step (empty when the episode ended)."""

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.transitions))

    @property
    def num_turns(self) -> int:
        return len(self.transitions)


class Env(ABC):
    """A multi-turn environment. Subclass it and write :meth:`initial_observation` and :meth:`step`.

    One ``Env`` object plays one episode: :meth:`initial_observation` starts it and :meth:`step` is called with
    each of the model's turns until it returns ``episode_done=True``.
    """

    @abstractmethod
    def initial_observation(self) -> tuple[ModelInput, StopCondition]:
        """The first prompt and the stop tokens of the model's first turn."""

    @abstractmethod
    def step(self, action: list[int]) -> StepResult:
        """Apply the model's turn (its sampled token ids) and return the reward and the next observation."""

    async def initial_observation_async(self) -> tuple[ModelInput, StopCondition]:
        return self.initial_observation()

    async def step_async(self, action: list[int]) -> StepResult:
        return self.step(action)


class EnvGroupBuilder(ABC):
    """Makes the G environments of one group: the same problem, played G times, so their episodes can be compared."""

    @abstractmethod
    def make_envs(self) -> Sequence[Env]:
        """G fresh environments for one problem."""

    def compute_group_rewards(self, trajectories: Sequence[Trajectory], envs: Sequence[Env]) -> list[float]:
        """A reward per episode that needs the whole group (e.g. a pairwise judge); added to each episode's
        step rewards. The default adds nothing."""
        return [0.0] * len(trajectories)

    def logging_tags(self) -> list[str]:
        """Names to group this builder's metrics under (e.g. ``["guess_number"]``)."""
        return []

    async def make_envs_async(self) -> Sequence[Env]:
        return self.make_envs()


class ProblemGroupBuilder(EnvGroupBuilder):
    """``group_size`` environments from ``make_env()``, each a fresh copy of the same problem."""

    def __init__(self, make_env: Callable[[], Env], group_size: int, tags: Sequence[str] = ()):
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if not callable(make_env):
            raise TypeError(f"make_env must be a function that returns a new Env, got {type(make_env).__name__}")
        self.make_env, self.group_size, self.tags = make_env, group_size, list(tags)

    def make_envs(self) -> list[Env]:
        envs = [self.make_env() for _ in range(self.group_size)]
        for i, env in enumerate(envs):
            if not isinstance(env, Env):
                raise TypeError(f"make_env() returned {type(env).__name__} (env {i}); it must return an edurl Env")
        if len({id(e) for e in envs}) < len(envs):
            raise ValueError("make_env() returned the same Env object twice; it must build a new one on every call")
        return envs

    def logging_tags(self) -> list[str]:
        return self.tags


@dataclass
class TrajectoryGroup:
    """The G episodes of one group and their total rewards (step rewards + group rewards)."""

    trajectories: list[Trajectory]
    group_rewards: list[float]
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.group_rewards) != len(self.trajectories):  # zip would drop the episodes past the shorter list
            raise ValueError(
                f"{len(self.group_rewards)} group rewards for {len(self.trajectories)} episodes: pass one per episode "
                "(0.0 where a group reward does not apply)"
            )

    @property
    def total_rewards(self) -> list[float]:
        return [t.total_reward + g for t, g in zip(self.trajectories, self.group_rewards)]

    def advantages(self) -> list[float]:
        """Each episode's total reward minus the group's mean (Chapter 7's centring, over whole episodes)."""
        r = self.total_rewards
        if _uniform(r):
            return [0.0] * len(r)
        mean = sum(r) / len(r)
        return [x - mean for x in r]

    def turn_advantages(self, discount: float = 1.0) -> list[list[float]]:
        """Per-turn credit: turn k's advantage is the reward from turn k to the end of its episode (group rewards
        included; a reward j turns later weighs ``discount ** j``) minus the mean of the same over the group's
        episodes that reached turn k. A turn is then credited only with what came after it, and compared with the
        other episodes at the same point. ``discount=0`` credits each turn with its own reward only."""
        if not 0 <= discount <= 1:
            raise ValueError(f"discount must be in [0, 1], got {discount!r}")
        to_go = []
        for i, (t, extra) in enumerate(zip(self.trajectories, self.group_rewards)):
            rewards = [x.reward for x in t.transitions]
            if not rewards:  # an IndexError from rewards[-1] once
                raise ValueError(f"trajectory {i} has no transitions; an episode needs at least one model turn")
            rewards[-1] += extra
            g, backwards = 0.0, []
            for r in reversed(rewards):
                g = r + discount * g
                backwards.append(g)
            to_go.append(backwards[::-1])
        longest = max((len(g) for g in to_go), default=0)
        uniform, means = [], []
        for k in range(longest):
            at_k = [g[k] for g in to_go if len(g) > k]
            uniform.append(_uniform(at_k))
            means.append(sum(at_k) / len(at_k))
        return [[0.0 if uniform[k] else g[k] - means[k] for k in range(len(g))] for g in to_go]


def _uniform(values: list[float]) -> bool:
    """True when the values are the same up to rounding (1e-9 of their size): their centred advantages are then
    exactly 0, so the group gives no datums. Equal rewards summed in another order can differ in the last bit
    (0.1 + 0 + 1.1 is 1.2000000000000002, 0.1 + 0.1 + 1.0 is 1.2), and the mean of eight 0.9s is not 0.9."""
    if not values:
        return True
    top = max(values)
    return top - min(values) <= 1e-9 * max(1.0, abs(top), abs(min(values)))


# ---------------------------------------------------------------- messages in, tokens out


class MessageEnv(Env):
    """An environment that speaks in chat messages. Subclass it and write :meth:`initial_messages` and
    :meth:`reply`; the renderer turns the conversation into token ids.

    Every observation is ``renderer.build_generation_prompt(conversation)``: the whole conversation re-rendered,
    as the cookbook's renderers do. Whether that extends the previous observation token for token is the
    renderer's business, and :func:`trajectory_to_datums` checks it. A turn cut off by ``max_tokens`` (no stop
    token) ends the episode with ``truncated = 1`` and the reward :meth:`truncated` gives (0 unless overridden).
    A turn that reaches ``max_turns`` while :meth:`reply` would go on ends it with ``turn_limit = 1``, its reply's
    reward plus :meth:`truncated`'s, and :meth:`truncated`'s metrics.
    """

    max_turns: int = 10
    """Safety net: the episode ends after this many model turns, whatever :meth:`reply` says."""

    stop_reason: str | None = None
    """The sampler's ``stop_reason`` for the action that the next :meth:`step` reads ("stop" or "length"), which
    :func:`do_group_rollouts` sets: ``step(action)`` takes tokens only, as in Tinker's API, and a real chat model
    may end its turn on an EOS that is not the renderer's stop token (Qwen2.5-Instruct's ``<|endoftext|>``). None
    (a scripted action) leaves the tokens to decide (:meth:`ChatMLRenderer.parse_response`)."""

    def __init__(self, renderer: ChatMLRenderer):
        self.renderer = renderer
        self.messages: list[Message] = []
        self.turns = 0

    @abstractmethod
    def initial_messages(self) -> list[Message]:
        """The conversation before the model's first turn (e.g. one user message)."""

    @abstractmethod
    def reply(self, text: str) -> tuple[float, bool, list[Message], dict[str, float]]:
        """React to the model's reply ``text``: ``(reward, episode_done, messages to add, metrics)``."""

    def truncated_metrics(self) -> dict[str, float]:
        """The metrics of an episode that a truncated turn ended (e.g. ``{"win": 0.0}``), so that every episode
        reports the same keys and averages are over all episodes."""
        return {}

    def truncated(self, text: str) -> tuple[float, dict[str, float]]:
        """The reward and metrics of a reply ``text`` cut off by ``max_tokens`` (or, added to its reply's reward,
        of the turn that reaches ``max_turns`` while :meth:`reply` would go on), which ends the episode: 0 and
        :meth:`truncated_metrics`. An env whose rewards can be negative overrides it, or running out of tokens
        becomes the best way to fail (the calculator grades it as Chapter 7 does)."""
        return 0.0, self.truncated_metrics()

    def stop_condition(self) -> StopCondition:
        return self.renderer.get_stop_sequences()

    def initial_observation(self) -> tuple[ModelInput, StopCondition]:
        self.messages = list(self.initial_messages())
        self.turns = 0
        return ModelInput.from_ints(self.renderer.build_generation_prompt(self.messages)), self.stop_condition()

    def step(self, action: list[int]) -> StepResult:
        if not self.messages:
            raise RuntimeError("step() before initial_observation(): start the episode with initial_observation()")
        message, complete = self.renderer.parse_response(action, self.stop_reason)
        self.stop_reason = None  # it was this action's
        self.messages.append(message)
        self.turns += 1
        if not complete:
            reward, metrics = self.truncated(message["content"])
            done, new, metrics = True, [], {"truncated": 1.0, "turn_limit": 0.0, **metrics}
        else:
            reward, done, new, metrics = self.reply(message["content"])
            metrics = {"truncated": 0.0, "turn_limit": 0.0, **metrics}
            if not done and self.turns >= self.max_turns:
                # the safety net ends an episode reply() kept going: graded as a cut-off reply, so that running out
                # of turns is not a better way to fail than a wrong answer, and with the same metric keys
                cut_reward, cut_metrics = self.truncated(message["content"])
                reward, done, new = reward + cut_reward, True, []
                metrics = {**metrics, **cut_metrics, "turn_limit": 1.0}
        self.messages += list(new)
        ob = [] if done else self.renderer.build_generation_prompt(self.messages)
        return StepResult(float(reward), bool(done), ModelInput.from_ints(ob), self.stop_condition(), metrics)


# ---------------------------------------------------------------- rollouts


def _not_a_coroutine(value, env, method: str):
    """``value`` unless ``env.method`` is an ``async def`` (Tinker's Env is async): its coroutine was unpacked as a
    result and failed with "cannot unpack non-iterable coroutine object"."""
    if inspect.iscoroutine(value):
        value.close()  # never awaited: closed, so Python does not warn about it
        raise TypeError(
            f"{type(env).__name__}.{method} is an async def (as in the Tinker Cookbook); here it is called without "
            f"await. Write it as a plain def; edurl's Env has the async twins ({method}_async) that call it"
        )
    return value


def _play(
    envs: Sequence[Env], sampler: SamplingClient, params: SamplingParams, max_turns: int, prefix_cache: bool = False
) -> list[Trajectory]:
    """Play every env to the end. Each round sends all envs that wait for the model to the sampler in one batch
    (one batch per distinct stop condition), then steps each of them. With ``prefix_cache`` the sampler keeps each
    episode's keys and values between its turns (:class:`edurl.llm.sampling.PrefixCache`)."""
    cache = {"prefix_cache": PrefixCache()} if prefix_cache else {}
    obs: list[ModelInput | None] = []
    stops: list[StopCondition] = []
    for env in envs:
        ob_stop = _not_a_coroutine(env.initial_observation(), env, "initial_observation")
        ob, stop = ob_stop
        obs.append(ob)
        stops.append(list(stop))
    transitions: list[list[Transition]] = [[] for _ in envs]
    for turn in range(max_turns + 1):
        waiting = [i for i, ob in enumerate(obs) if ob is not None]
        if not waiting:
            break
        if turn == max_turns:
            raise RuntimeError(
                f"{len(waiting)} episode(s) still running after {max_turns} model turns; an Env must end its "
                f"episode (episode_done=True), or raise max_turns"
            )
        by_stop: dict[tuple[int, ...], list[int]] = {}
        for i in waiting:
            by_stop.setdefault(tuple(stops[i]), []).append(i)
        for k, (stop, rows) in enumerate(by_stop.items()):
            # kept below 2**63 (as problem_seed keeps a step's seed): the sampler takes a seed as an int64
            seed = None if params.seed is None else (params.seed * 1009 + turn * 31 + k) % 2**63
            call = replace(params, stop=list(stop), seed=seed)
            keys = {"cache_keys": rows} if prefix_cache else {}
            responses = sampler.sample_batch([obs[i].tokens for i in rows], 1, call, **cache, **keys)
            for i, response in zip(rows, responses):
                seq = response.sequences[0]
                if isinstance(envs[i], MessageEnv):
                    envs[i].stop_reason = seq.stop_reason
                result = _not_a_coroutine(envs[i].step(list(seq.tokens)), envs[i], "step")
                if not isinstance(result, StepResult):
                    raise TypeError(f"{type(envs[i]).__name__}.step returned {type(result).__name__}, not a StepResult")
                ac = TokensWithLogprobs(list(seq.tokens), list(seq.logprobs), seq.stop_reason)
                transitions[i].append(Transition(obs[i], ac, result.reward, result.episode_done, dict(result.metrics)))
                obs[i] = None if result.episode_done else result.next_observation
                if not result.episode_done:  # an ended episode's stop condition is never used
                    stops[i] = list(result.next_stop_condition)
    return [Trajectory(t, ModelInput.from_ints([])) for t in transitions]


def play_actions(
    env: Env, actions: Sequence[Sequence[int]], turn_logprobs: Sequence[float] | None = None
) -> Trajectory:
    """Play ``env`` with fixed actions (token ids, each with its stop token) until the episode ends or the
    actions run out: a scripted player, for worked examples and tests. Turn k's tokens get the sampling
    log-prob ``turn_logprobs[k]`` each (0.0 by default: a made-up, certain sampler). The trajectory's
    ``final_ob`` is the next turn's observation when the actions ran out first, and empty when the episode
    ended, as in a rollout."""
    ob, stop = env.initial_observation()
    transitions = []
    for k, action in enumerate(actions):
        action = list(action)
        ended = bool(action) and action[-1] in set(stop)  # each id of a stop condition ends the turn
        if isinstance(env, MessageEnv) and ended:
            env.stop_reason = "stop"  # else the tokens decide (a scripted reply may end on the tokenizer's EOS)
        result = env.step(action)
        lp = 0.0 if turn_logprobs is None else float(turn_logprobs[k])
        ac = TokensWithLogprobs(action, [lp] * len(action), "stop" if ended else "length")
        transitions.append(Transition(ob, ac, result.reward, result.episode_done, dict(result.metrics)))
        if result.episode_done:
            return Trajectory(transitions, ModelInput.from_ints([]))  # an ended episode's observation is not read
        ob, stop = result.next_observation, result.next_stop_condition
    return Trajectory(transitions, ob)


def do_group_rollouts(
    builders: Sequence[EnvGroupBuilder],
    sampler: SamplingClient,
    params: SamplingParams,
    max_turns: int = 50,
    prefix_cache: bool = False,
) -> list[TrajectoryGroup]:
    """Play every group of ``builders`` to the end with ``sampler``, all groups' envs batched together.

    ``params`` gives max_tokens (per turn), temperature and the seed (each turn draws with its own seed derived
    from it); its ``stop`` is ignored, since each env names its own stop tokens. ``prefix_cache=True`` runs only
    each turn's new tokens through the model, on the keys and values of the episode's earlier turns (the same
    draws up to rounding; ``sampler.sample_batch`` must take ``prefix_cache`` and ``cache_keys``, as
    :class:`SamplingClient`'s does)."""
    check_count(max_turns, "max_turns", "model turns")  # -1 played no turn and returned empty episodes
    env_groups = [list(b.make_envs()) for b in builders]
    flat = [env for group in env_groups for env in group]
    seen: set[int] = set()
    for k, group in enumerate(env_groups):  # one env stepped twice a round played two episodes as one, silently
        for env in group:
            if id(env) in seen:
                raise ValueError(
                    f"builders[{k}] ({type(builders[k]).__name__}).make_envs() gave an Env object that is already in "
                    "this rollout; every episode needs an Env of its own (build a new one for each, e.g. "
                    "[make_env() for _ in range(G)], not [env] * G)"
                )
            seen.add(id(env))
    trajectories = _play(flat, sampler, params, max_turns, prefix_cache)
    groups, k = [], 0
    for builder, envs in zip(builders, env_groups):
        trajs = trajectories[k : k + len(envs)]
        k += len(envs)
        extra = [float(x) for x in builder.compute_group_rewards(trajs, envs)]
        if len(extra) != len(trajs):
            raise ValueError(
                f"{type(builder).__name__}.compute_group_rewards returned {len(extra)} rewards for {len(trajs)} "
                "episodes; return one per episode"
            )
        groups.append(TrajectoryGroup(trajs, extra, builder.logging_tags()))
    return groups


def do_group_rollout(builder: EnvGroupBuilder, sampler: SamplingClient, params: SamplingParams) -> TrajectoryGroup:
    """One group's episodes (see :func:`do_group_rollouts`)."""
    return do_group_rollouts([builder], sampler, params)[0]


async def do_group_rollouts_async(
    builders, sampler, params, max_turns: int = 50, prefix_cache: bool = False
) -> list[TrajectoryGroup]:
    """The async twin of :func:`do_group_rollouts` (the sampler is local, so it runs in a worker thread)."""
    return await asyncio.to_thread(do_group_rollouts, builders, sampler, params, max_turns, prefix_cache)


# ---------------------------------------------------------------- episodes as datums


def extends(previous: Sequence[int], following: Sequence[int]) -> bool:
    """True when ``following`` starts with ``previous``, token for token."""
    return len(following) >= len(previous) and list(following[: len(previous)]) == list(previous)


def is_prefix_consistent(trajectory: Trajectory) -> bool:
    """True when each observation extends the previous observation and action: the episode is one sequence."""
    ts = trajectory.transitions
    return all(extends(a.ob.to_ints() + a.ac.tokens, b.ob.to_ints()) for a, b in zip(ts, ts[1:]))


def _per_turn(trajectory: Trajectory, advantage: float | Sequence[float]) -> list[float]:
    if isinstance(advantage, numbers.Real) or (isinstance(advantage, torch.Tensor) and advantage.dim() == 0):
        return [float(advantage)] * len(trajectory.transitions)  # a Python, NumPy or 0-d tensor number
    advantage = [float(a) for a in advantage]
    if len(advantage) != len(trajectory.transitions):
        raise ValueError(
            f"{len(advantage)} advantages for {len(trajectory.transitions)} turns; pass one number, or one per turn"
        )
    return advantage


def merged_datum(trajectory: Trajectory, advantage: float | Sequence[float]) -> Datum:
    """The whole episode as one datum (it must be prefix-consistent): the model's tokens get mask 1, their
    sampling log-probs and ``advantage`` (one number, or one per turn); the environment's tokens get mask 0 and
    advantage 0."""
    if not trajectory.transitions:
        raise ValueError("the trajectory has no transitions; an episode needs at least one model turn")
    if not is_prefix_consistent(trajectory):
        raise ValueError(
            "the observations do not extend each other token for token, so the episode is not one sequence; "
            "use trajectory_to_datums, which falls back to one datum per turn"
        )
    tokens: list[int] = []
    is_action: list[bool] = []
    logprobs: list[float] = []
    advantages: list[float] = []
    for t, a in zip(trajectory.transitions, _per_turn(trajectory, advantage)):
        ob = t.ob.to_ints()
        new_env = ob[len(tokens) :]  # the environment's tokens since the last action
        tokens += new_env + t.ac.tokens
        is_action += [False] * len(new_env) + [True] * len(t.ac.tokens)
        logprobs += [0.0] * len(new_env) + list(t.ac.logprobs)
        advantages += [0.0] * len(new_env) + [a] * len(t.ac.tokens)
    # position i predicts tokens[i + 1]: its fields are those of the target token
    mask = torch.tensor(is_action[1:], dtype=torch.float32, device="cpu")
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": torch.tensor(tokens[1:], dtype=torch.long, device="cpu"),
            "logprobs": torch.tensor(logprobs[1:], device="cpu") * mask,
            "advantages": torch.tensor(advantages[1:], device="cpu") * mask,
            "mask": mask,
        },
    )


def per_turn_datums(trajectory: Trajectory, advantage: float | Sequence[float]) -> list[Datum]:
    """One datum per turn: each action scored on the observation it was sampled from (Chapter 7's layout)."""
    return [
        build_datum(t.ob.to_ints(), t.ac.tokens, t.ac.logprobs, a)
        for t, a in zip(trajectory.transitions, _per_turn(trajectory, advantage))
    ]


def trajectory_to_datums(trajectory: Trajectory, advantage: float | Sequence[float]) -> tuple[list[Datum], bool]:
    """The episode's datums and whether they were merged: one datum when the episode is prefix-consistent,
    else one per turn. Both give the same loss and gradient with ``sum`` or ``token_mean`` aggregation."""
    if is_prefix_consistent(trajectory):
        return [merged_datum(trajectory, advantage)], True
    return per_turn_datums(trajectory, advantage), False


def groups_to_datums(
    groups: Sequence[TrajectoryGroup], per_turn_credit: bool = False, discount: float = 1.0
) -> tuple[list[Datum], dict[str, float]]:
    """Every episode of every group as datums, with its group-centred advantage (or, with ``per_turn_credit``,
    :meth:`TrajectoryGroup.turn_advantages`). Groups whose advantages are all 0 give no datums. Also returns
    ``env/all/merged_fraction``: the share of episodes that became one datum."""
    datums: list[Datum] = []
    merged = episodes = 0
    for group in groups:
        advantages = group.turn_advantages(discount) if per_turn_credit else group.advantages()
        flat = [a for turns in advantages for a in turns] if per_turn_credit else advantages
        if all(a == 0 for a in flat):
            continue
        for trajectory, advantage in zip(group.trajectories, advantages):
            ds, was_merged = trajectory_to_datums(trajectory, advantage)
            datums += ds
            merged += was_merged
            episodes += 1
    return datums, {"env/all/merged_fraction": merged / episodes if episodes else 1.0}


def rollout_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """Means over every episode: total reward, turns, action tokens, and each env metric (the last step's value,
    which for a game is the episode's outcome), as ``env/all/...``; also the share of groups with mixed rewards."""
    trajs = [t for g in groups for t in g.trajectories]
    totals = [r for g in groups for r in g.total_rewards]
    n = max(len(trajs), 1)
    row = {
        "env/all/reward/total": sum(totals) / n,
        "env/all/turns_per_episode": sum(t.num_turns for t in trajs) / n,
        "env/all/ac_tokens_per_turn": sum(len(x.ac.tokens) for t in trajs for x in t.transitions)
        / max(sum(t.num_turns for t in trajs), 1),
        "env/all/by_group/frac_mixed": sum(not _uniform(g.total_rewards) for g in groups) / max(len(groups), 1),
    }
    keys = sorted({k for t in trajs for x in t.transitions for k in x.metrics})
    for key in keys:
        values = [_last(t, key) for t in trajs]
        values = [v for v in values if v is not None]
        if values:
            row[f"env/all/{key}"] = sum(values) / len(values)
    return row


def _last(trajectory: Trajectory, key: str) -> float | None:
    for t in reversed(trajectory.transitions):
        if key in t.metrics:
            return float(t.metrics[key])
    return None

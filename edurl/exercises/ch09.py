"""Checkers for Chapter 9's exercises: the mask of an episode merged into one datum (9.1), and an environment
written by the learner, which the harness plays (9.2)."""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Sequence

from edurl.exercises._core import (
    FAILED,
    NOT_ATTEMPTED,
    PASSED,
    Case,
    Diagnosis,
    Hints,
    Verdict,
    _where_it_raised,
    run_checker,
    with_hints,
)
from edurl.exercises.solutions import ch09 as _solutions
from edurl.llm.datum import ModelInput
from edurl.llm.envs import Env, MessageEnv, StepResult, Trajectory, Transition, extends, merged_datum
from edurl.llm.envs.base import TokensWithLogprobs

__all__ = ["check_episode_mask", "check_env"]


# ================================================================ 9.1 episode_mask


def _library_mask(observations, actions):
    """The library's answer: :func:`edurl.llm.envs.merged_datum`'s mask."""
    transitions = [
        Transition(ModelInput.from_ints(ob), TokensWithLogprobs(list(ac), [0.0] * len(ac)), 0.0, False)
        for ob, ac in zip(observations, actions)
    ]
    return merged_datum(Trajectory(transitions, ModelInput.from_ints([])), 1.0).loss_fn_inputs["mask"].tolist()


def _sampled(observations, actions):
    tokens = observations[-1] + actions[-1]
    flags = [0.0] * len(tokens)
    for ob, ac in zip(observations, actions):
        flags[len(ob) : len(ob) + len(ac)] = [1.0] * len(ac)
    return flags


def _on_tokens(observations, actions):
    return _sampled(observations, actions)[:-1]  # the flag of the token read, not of the token predicted


def _after_first_action(observations, actions):
    flags = _sampled(observations, actions)
    first = flags.index(1.0)
    return [0.0 if i < first else 1.0 for i in range(1, len(flags))]


def _last_turn_only(observations, actions):
    return _library_mask(observations[-1:], actions[-1:])


def _without_stop_token(observations, actions):
    return _library_mask(observations, [ac[:-1] for ac in actions]) + [0.0]


def _full_length(observations, actions):
    return _sampled(observations, actions)  # one entry per token, not per prediction


_MASK_DIAGNOSES = [
    Diagnosis(
        _on_tokens,
        "the mask is one position late: you marked the positions that read a sampled token. Position i predicts "
        "token i + 1, so it is 1 when token i + 1 was sampled.",
    ),
    Diagnosis(
        _after_first_action,
        "the environment's tokens are in the mask: everything after the first reply counts. Only the model's own "
        "replies are actions; the environment's answers and the next turn's header must get 0.",
    ),
    Diagnosis(_last_turn_only, "only the last reply is in the mask; every turn's reply is an action of the episode."),
    Diagnosis(
        _without_stop_token,
        "the stop token of each reply is missing. The model sampled it too (it chose to end its turn), so it is an "
        "action and gets 1.",
    ),
    Diagnosis(
        _full_length,
        "the mask has one entry per token; a datum has one position per prediction, one fewer than the tokens.",
    ),
]


def _turns(rng: random.Random, sizes: list[tuple[int, int]], first: int) -> dict:
    """An episode with ``first`` prompt tokens, then (reply, environment) token counts per turn."""
    tokens = [rng.randrange(5, 99) for _ in range(first)]
    observations, actions = [], []
    for reply, env in sizes:
        observations.append(list(tokens))
        ac = [rng.randrange(5, 99) for _ in range(reply - 1)] + [4]  # 4: the stop token
        actions.append(ac)
        tokens += ac + [rng.randrange(5, 99) for _ in range(env)]
    return dict(observations=observations, actions=actions)


def _mask_cases() -> list[Case]:
    rng = random.Random(9)
    return [
        Case(
            "worked example: prompt [1, 2], reply [7], environment [3, 4], reply [8, 9] -> [0, 1, 0, 0, 1, 1]",
            dict(observations=[[1, 2], [1, 2, 7, 3, 4]], actions=[[7], [8, 9]]),
        ),
        Case("one turn: a single-turn episode is Chapter 7's datum", _turns(rng, [(4, 0)], 5)),
        Case("three turns, environment replies of 3 and 6 tokens", _turns(rng, [(3, 3), (5, 6), (2, 0)], 4)),
        Case(
            "five turns, replies of 1 token (the stop token alone)",
            _turns(rng, [(1, 2), (2, 4), (1, 1), (3, 2), (1, 0)], 3),
        ),
    ]


_HINTS_MASK = Hints(
    idea=(
        "Lay the episode out as one sequence: the last observation followed by the last reply. Each reply sits right "
        "after the observation it answered. The datum predicts every token from the ones before it, and only the "
        "predictions of tokens the model sampled are actions."
    ),
    formula="tokens = observations[-1] + actions[-1]; sampled[t] = 1 for len(observations[k]) <= t < "
    "len(observations[k]) + len(actions[k]), for each turn k; mask = sampled[1:].",
    solution=_solutions.episode_mask,
)


@with_hints(_HINTS_MASK)
def check_episode_mask(fn, *, verbose: bool = True) -> Verdict:
    """Check a learner's ``episode_mask(observations, actions) -> list of 0.0/1.0``, one per position of the
    merged datum (one fewer than the episode's tokens)."""

    def compare(got, expected):
        if got is None:
            return "expected a list of numbers, got None (did you forget the `return mask` statement?)"
        if (
            isinstance(got, tuple)
            and got
            and getattr(got[0], "ndim", 1 if isinstance(got[0], (list, tuple)) else 0) >= 1
        ):
            return f"expected a list of numbers, got a tuple of {len(got)} things: return just the mask"
        try:
            got = [float(x) for x in got]
        except (TypeError, ValueError):
            return f"expected a list of numbers, got {type(got).__name__}"
        if len(got) != len(expected):
            return (
                f"expected {len(expected)} entries (one per position: the episode's tokens minus one), got {len(got)}"
            )
        return None if got == expected else "the mask differs from the expected one"

    return run_checker(
        "Exercise 9.1 episode_mask",
        fn,
        _library_mask,
        _mask_cases(),
        diagnoses=_MASK_DIAGNOSES,
        compare=compare,
        verbose=verbose,
        hints=_HINTS_MASK,
    )


# ================================================================ 9.2 an environment of your own


_HINTS_ENV = Hints(
    idea=(
        "Subclass edurl.llm.envs.MessageEnv: write initial_messages() (the conversation before the model's first "
        "turn) and reply(text) (what the environment does with the model's reply). MessageEnv turns messages into "
        "tokens, so every observation extends the previous one, and it ends an episode whose reply was cut off."
    ),
    formula="reply(text) returns (reward, episode_done, new_messages, metrics): for example (1.0, True, [], "
    '{"win": 1.0}) for a right answer, and (0.0, False, [{"role": "user", "content": "no, again"}], {"win": 0.0}) '
    "for a wrong one while tries are left. Count the tries with self.turns, which MessageEnv keeps.",
    solution=_solutions.ReverseWordEnv,
)


class _Problem(Exception):
    pass


def _random_reply(rng: random.Random, tokenizer, stop: list[int]) -> list[int]:
    """A reply as a sampler might produce one: random text, sometimes cut off before its stop token."""
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz +-*<>{}\\/"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids if rng.random() < 0.1 else ids + list(stop)


def _stop_ids(stop, where: str) -> list[int]:
    """``stop`` as a list, if it is what the sampler needs to end the model's next turn: a non-empty list of ids."""
    if not (isinstance(stop, (list, tuple)) and stop and all(isinstance(t, int) for t in stop)):
        raise _Problem(
            f"{where} gave the stop condition {stop!r}; while the episode goes on it must be a non-empty list of "
            "token ids as Python ints (the sampler ends the model's next turn on them), e.g. "
            "renderer.get_stop_sequences(), or [int(t) for t in ids]"
        )
    return list(stop)


def _play(env, rng, tokenizer, max_turns: int) -> list[tuple[list[int], list[int], StepResult]]:
    start = env.initial_observation()
    if not (isinstance(start, tuple) and len(start) == 2 and isinstance(start[0], ModelInput)):
        raise _Problem(
            f"initial_observation() returned {type(start).__name__}; it must return (ModelInput, stop tokens), "
            "e.g. (ModelInput.from_ints(renderer.build_generation_prompt(messages)), renderer.get_stop_sequences())"
        )
    ob, stop = start
    if ob.length == 0:
        raise _Problem("initial_observation() returned an empty observation; the model needs a prompt to read")
    stop = _stop_ids(stop, "initial_observation()")
    turns = []
    for _ in range(max_turns):
        action = _random_reply(rng, tokenizer, stop)
        try:
            before = _sent(env)
            result = env.step(list(action))
        except NotImplementedError:
            raise
        except Exception as err:
            raise _Problem(
                f"step() raised {type(err).__name__}: {err}, on the reply {tokenizer.decode(action)!r}. An environment "
                "must answer any reply, however malformed (a model will write them), with a message, never a crash"
            ) from None
        if not isinstance(result, StepResult):
            raise _Problem(f"step() returned {type(result).__name__}; it must return a StepResult")
        if not isinstance(result.reward, (int, float)) or not math.isfinite(result.reward):
            raise _Problem(f"step() returned the reward {result.reward!r}; a reward must be a finite number")
        turns.append((ob.to_ints(), list(action), result))
        _check_roles(env, tokenizer.decode(action), before)
        if result.episode_done:
            return turns
        nxt = result.next_observation
        if not isinstance(nxt, ModelInput) or not extends(ob.to_ints() + list(action), nxt.to_ints()):
            raise _Problem(
                "the next observation does not extend the previous observation and the model's reply token for token, "
                f"so the episode cannot be one datum; after the reply {tokenizer.decode(action)!r} the observation "
                "must start with everything the model has seen and said (re-render the whole conversation, the "
                "model's reply included)"
            )
        ob, stop = nxt, _stop_ids(result.next_stop_condition, "step()'s next_stop_condition")
    raise _Problem(
        f"the episode did not end within {max_turns} turns of random replies (the checker plays at most "
        f"max_turns={max_turns}); end it (episode_done=True) after a fixed number of tries. If your environment "
        "allows more tries on purpose, check it with check_env(make_env, max_turns=...) above that number"
    )


def _sent(env) -> int | None:
    """How many messages a MessageEnv's conversation holds (None for another Env): taken before a step, so that
    :func:`_check_roles` can read what the step added."""
    return len(env.messages) if isinstance(env, MessageEnv) and isinstance(env.messages, list) else None


def _check_roles(env, reply: str, before: int | None) -> None:
    """``MessageEnv.step`` appends the model's reply to the conversation itself, then the messages ``reply``
    returns: an env whose ``reply`` returns the model's reply again shows the model its own answer twice. (No
    message at all, to let the model try again without a word, is allowed.)"""
    if before is None or not isinstance(env.messages, list):
        return
    added = [m.get("role") if isinstance(m, dict) else None for m in env.messages[before + 1 :]]
    if "assistant" in added:
        raise _Problem(
            f"after the reply {reply!r}, reply(text) returned an assistant message (it added the roles {added}): "
            "MessageEnv.step appends the model's reply to self.messages itself, so reply(text) must return only "
            "the new messages from the environment (a user or tool message), never the model's reply again"
        )


def _replay(env, replies: list[list[int]], beside: tuple | None = None) -> list[tuple]:
    """What ``env`` answers to ``replies`` (each closed with the env's stop tokens) in turn, until its episode ends:
    (reward, done, next observation) per turn. ``beside=(other_env, other_replies)`` plays another env turn by turn
    with it, each started and stepped right after ``env``."""
    _, stop = env.initial_observation()
    if beside is not None:
        other, other_replies = beside
        _, other_stop = other.initial_observation()
        other_live = True
    out = []
    for k, action in enumerate(replies):
        result = env.step(list(action) + list(stop))
        # an ended episode's observation is never read (the rollout keeps None), so it need not be a ModelInput
        out.append(
            (result.reward, result.episode_done, None if result.episode_done else result.next_observation.to_ints())
        )
        if beside is not None and other_live and k < len(other_replies):
            other_result = other.step(list(other_replies[k]) + list(other_stop))
            other_live = not other_result.episode_done
            if other_live:  # each turn closed with the stop condition the rollout would sample with
                other_stop = _stop_ids(other_result.next_stop_condition, "step()'s next_stop_condition")
        if result.episode_done:
            break
        stop = _stop_ids(result.next_stop_condition, "step()'s next_stop_condition")
    return out


def check_env(
    make_env: Callable[[], Env],
    *,
    right_reply: str | Sequence[str] | None = None,
    episodes: int = 30,
    max_turns: int = 20,
    verbose: bool = True,
) -> Verdict:
    """Play ``episodes`` episodes of ``make_env()`` with random replies (some cut off) and check that the
    environment follows the rules of :class:`edurl.llm.envs.Env`: the right return types, finite rewards,
    episodes that end, observations that extend each other token for token, no crash on any reply, and no
    state shared between two environments. The verdict's ``implementation`` is ``make_env`` on a pass, else a
    factory of the worked solution's environment (reverse the word "stop").

    Random replies rarely earn a reward, so ``right_reply``, a reply the environment should reward (``"pots"``
    for the reversed "stop"), or a list of replies that wins an episode turn by turn, is played too, on a new
    environment from ``make_env()``: it must be answered without a crash, and its total reward must be finite and
    above what a random wrong reply got on a turn that left the episode going (or, if none did, the lowest a random
    first reply got)."""
    from edurl.llm.renderer import ChatMLRenderer
    from edurl.llm.tokenizer import build_char_tokenizer

    name = "Exercise 9.2 an environment of your own"
    tokenizer = build_char_tokenizer()

    def reference() -> Env:  # the worked solution, as a factory like make_env
        return _solutions.ReverseWordEnv("stop", ChatMLRenderer(tokenizer))

    def verdict(status: str, message: str) -> Verdict:
        v = Verdict(name, status, message, make_env if status == PASSED else reference, hints=_HINTS_ENV)
        if verbose:
            print(v)
        return v

    if not callable(make_env):
        return verdict(FAILED, f"expected a function that returns a new Env, got {type(make_env).__name__}")
    right_script = [right_reply] if isinstance(right_reply, str) else right_reply
    if right_reply is not None and not (
        isinstance(right_script, (list, tuple)) and right_script and all(isinstance(r, str) for r in right_script)
    ):
        return verdict(
            FAILED,
            "right_reply must be the text of a reply (a str), a list of replies that win an episode turn by turn, "
            f"or None; got {right_reply!r}",
        )
    rng = random.Random(92)
    try:
        first = make_env()
    except NotImplementedError:
        return verdict(NOT_ATTEMPTED, "make_env still raises NotImplementedError; the notebook uses the reference.")
    except Exception as err:
        return verdict(FAILED, f"make_env() raised {type(err).__name__}: {err}")
    if not isinstance(first, Env):
        return verdict(
            FAILED, f"make_env() returned {type(first).__name__}; subclass edurl.llm.envs.Env (or MessageEnv)"
        )
    try:
        if make_env() is first:
            return verdict(
                FAILED,
                "make_env() returned the same Env object twice; it must build a new one on every call (a group's "
                "episodes are played side by side, each by its own environment). Make the environment inside "
                "make_env, e.g. return ReverseWordEnv(...), not an environment made once outside it",
            )
    except Exception as err:
        return verdict(FAILED, f"make_env() raised {type(err).__name__} on its second call: {err}")
    try:
        # the same three envs, started before and after the others play: an env that draws its problem when it is
        # made (a random word) starts the same both times, and one whose conversation lives on the class grows
        # (comparing three other fresh envs after play once failed correct envs whose prompts differ in length)
        probes = [make_env() for _ in range(3)]
        try:  # started after play as copies made now, so that no env's initial_observation is called twice
            late_probes = copy.deepcopy(probes)
        except Exception:
            late_probes = probes
        # and one env twice, as made (a deep copy): the same replies to both, one before the others play and one
        # after, must get the same answers (state kept on the class once let an env end after one wrong reply
        # once three others had been played, and only the prompt's length was compared)
        script_rng = random.Random(29)
        script = [_random_reply(script_rng, tokenizer, [])[:8] for _ in range(max_turns)]
        twin, pair = make_env(), make_env()
        try:
            twin_copy, pair_alone = copy.deepcopy(twin), copy.deepcopy(pair)
            replayed = _replay(twin, script)
        except NotImplementedError:
            raise
        except Exception:  # an env that cannot be copied, or a broken one (the episodes below name what is wrong)
            replayed = None
        fresh = [p.initial_observation()[0].length for p in probes]
        rewards, first_rewards, going_rewards = [], [], []
        for _ in range(episodes):
            turns = _play(make_env(), rng, tokenizer, max_turns)
            rewards.append(sum(r.reward for _, _, r in turns))
            first_rewards.append(turns[0][2].reward)
            going_rewards += [r.reward for _, _, r in turns if not r.episode_done]  # wrong, with tries left
        after = [p.initial_observation()[0].length for p in late_probes]
        grew = [(a, b) for a, b in zip(fresh, after) if b > a]
        if grew:
            raise _Problem(
                f"an environment's first observation grew from {grew[0][0]} to {grew[0][1]} tokens when it started "
                "after other episodes were played: the environments share state (a list defined on the class, not "
                "in __init__?)"
                + (
                    ", or initial_observation() adds to the conversation each time it is called instead of "
                    "starting it afresh"
                    if late_probes is probes
                    else ""
                )
                + ". Each Env must keep its own conversation"
            )
        if replayed is not None:
            again = _replay(twin_copy, script)
            if again != replayed:
                raise _Problem(
                    f"two copies of one new environment answered the same {len(script)} replies differently, one "
                    f"played before the other episodes and one after ({len(replayed)} turns, then {len(again)}): the "
                    "environments share state (a list or a counter defined on the class, not in __init__?), or "
                    "draw from a global random generator (give each env its own, e.g. random.Random(seed) in "
                    "__init__). Each Env must keep its own conversation"
                )
            # and a new env played turn by turn beside another, as a group's episodes are played, against its copy
            # played alone: state that envs share and each resets when it starts (a mutable default argument,
            # messages=[], which a copy does not share) shows only here
            other_script = [_random_reply(script_rng, tokenizer, [])[:8] for _ in range(max_turns)]
            alone = _replay(pair_alone, script)
            try:
                beside = _replay(pair, script, beside=(make_env(), other_script))
            except NotImplementedError:
                raise
            except Exception as err:
                beside = f"{type(err).__name__}: {err}"
            if beside != alone:
                raise _Problem(
                    "one new environment answered the same replies differently when another environment was played "
                    "beside it, turn by turn, as a group's episodes are played"
                    + (f" (it raised {beside})" if isinstance(beside, str) else "")
                    + ": the environments share state (a list defined on the class, or a mutable default argument "
                    "such as messages=[] in __init__, which every env made without it shares), or draw from a "
                    "random generator they share (give each env its own, e.g. random.Random(seed) in __init__). "
                    "Each Env must keep its own conversation"
                )
    except NotImplementedError:
        return verdict(
            NOT_ATTEMPTED, "your environment still raises NotImplementedError; the notebook uses the reference."
        )
    except _Problem as err:
        return verdict(
            FAILED,
            f"{err}.\n  The notebook continues with the reference environment. Ask for help with verdict.hint(1).",
        )
    except Exception as err:
        return verdict(FAILED, f"your environment raised {type(err).__name__}: {err}")
    played = ""
    if right_reply is not None:
        # what a right answer must beat: a wrong reply that left the episode going (its reward is not a loss's
        # penalty for a malformed reply, which even a broken winning branch that pays 0 would beat)
        bar, bar_is = (
            (max(going_rewards), "a random wrong reply got on a turn that left the episode going")
            if going_rewards
            else (min(first_rewards), "the lowest a random first reply got")
        )
        # and a reply that cannot be right, complete (not cut off), every turn: a reward that pays any reply it can
        # read (a bar taken from random replies alone is the cut-off ones' 0, which any reply beats)
        said = {r.strip() for r in right_script}  # one of len(said) + 1 candidates is not among them
        wrong = next(w for w in ("zzzz", "qqqq", *("z" * k for k in range(5, 6 + len(said)))) if w not in said)
        total, turns, ended, wrong_total, doing, phase = 0.0, 0, False, 0.0, "make_env()", "right"
        paid = []  # (reply, reward) per turn of the right script
        try:
            env = make_env()
            doing = "initial_observation()"
            _, stop = env.initial_observation()
            doing = "step()"
            for reply in right_script:
                before = _sent(env)
                result = env.step(tokenizer.encode(reply, add_special_tokens=False) + list(stop))
                turns += 1
                if not isinstance(result.reward, (int, float)) or not math.isfinite(result.reward):
                    total = result.reward  # named below
                    break
                total += result.reward
                paid.append((reply.strip(), result.reward))
                _check_roles(env, reply, before)
                if result.episode_done:
                    ended = True
                    break
                stop = _stop_ids(
                    result.next_stop_condition, f"step()'s next_stop_condition after the right reply {reply!r}"
                )
            phase, doing = "wrong", "make_env()"
            env = make_env()
            doing = "initial_observation()"
            _, stop = env.initial_observation()
            doing = "step()"
            for _ in range(max_turns):
                result = env.step(tokenizer.encode(wrong, add_special_tokens=False) + list(stop))
                if not isinstance(result.reward, (int, float)) or not math.isfinite(result.reward):
                    raise _Problem(f"the reply {wrong!r} got the reward {result.reward!r}; a reward must be finite")
                wrong_total += result.reward
                if result.episode_done:
                    break
                stop = _stop_ids(result.next_stop_condition, f"step()'s next_stop_condition after {wrong!r}")
        except NotImplementedError:
            return verdict(
                NOT_ATTEMPTED, "your environment still raises NotImplementedError; the notebook uses the reference."
            )
        except _Problem as err:
            return verdict(FAILED, f"{err}.\n  The notebook continues with the reference environment.")
        except Exception as err:
            if phase == "wrong":
                where = f"on the reply {wrong!r}" if doing == "step()" else f"before the reply {wrong!r}"
                why = "An environment must answer any reply, a wrong one too, without a crash"
            else:
                where = f"on the right reply {right_script[turns]!r}" if doing == "step()" else "before the right reply"
                why = "The branch of your environment that rewards a right answer must run too"
            return verdict(FAILED, f"{doing} raised {type(err).__name__}{_where_it_raised(err)} {where}: {err}. {why}")
        shown = repr(right_reply)
        if not isinstance(total, (int, float)) or not math.isfinite(total):
            return verdict(
                FAILED, f"the right reply {shown} got the reward {total!r}: a reward must be a finite number"
            )
        if total <= bar:
            return verdict(
                FAILED,
                f"the right reply {shown} got {total:g} in all, no more than {bar_is} ({bar:g}): does reply() "
                "recognise a right answer (compare the reply's text, stripped of spaces, with the answer)? It is "
                "played on a new environment from make_env(), so it must win whatever make_env builds; if your "
                "environment pays only later in the episode, pass the replies of a whole winning episode as a list; "
                "if make_env draws its problem at random, no fixed reply wins, so check with right_reply=None",
            )
        if total <= wrong_total:
            return verdict(
                FAILED,
                f"the right reply {shown} got {total:g} in all, no more than the reply {wrong!r}, which cannot be "
                f"right, got in an episode of it ({wrong_total:g}): reply() pays a reply whatever it says. Compare "
                "the reply's text, stripped of spaces, with the answer, and pay only a match (e.g. `if text.strip() "
                "== answer:`, not `if answer:`)",
            )
        # a win that leaves the episode going, played again by a script of repeats (["pots"] * 3) whose episode ends
        # only when the tries run out: each turn but the last was paid above the bar, and the same reply again
        again = next(
            (
                (j, k)
                for k, (text, reward) in enumerate(paid)
                for j, (earlier, paid_then) in enumerate(paid[:k])
                if earlier == text and reward > bar and paid_then > bar
            ),
            None,
        )
        if again is not None:
            j, k = again
            return verdict(
                FAILED,
                f"the right reply {paid[k][0]!r} was paid {paid[j][1]:g} on turn {j + 1} and the episode went on, then "
                f"paid {paid[k][1]:g} again for the same reply on turn {k + 1}: a right answer must end the episode "
                "(episode_done=True), or the model is paid again for the same answer on every turn left",
            )
        if not ended:
            return verdict(
                FAILED,
                f"the episode went on after the right reply {shown} ({turns} turn{'s' if turns > 1 else ''}, "
                f"{total:g} in all): a right answer must end it (episode_done=True), or the model is paid again "
                "for the same answer on every turn left. If your environment wins only after several turns, pass "
                "the replies of a whole winning episode as a list",
            )
        played = f" The right reply {shown} got {total:g} in {turns} turn{'s' if turns > 1 else ''}."
    elif min(rewards) == max(rewards):
        played = (
            f" Every episode scored {min(rewards):g}: random replies never earned a reward, so the part of your "
            "environment that rewards a right answer was not run. Pass one, check_env(make_env, right_reply=...), "
            "to play it too."
        )
    return verdict(
        PASSED,
        f"{episodes} episodes of random replies played by the rules (total rewards from {min(rewards):g} to "
        f"{max(rewards):g}).{played} The notebook now uses your environment.",
    )


check_env.hints = _HINTS_ENV

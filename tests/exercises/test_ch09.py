"""Chapter 9 checkers: pass the worked solutions, reject realistic buggy versions by name."""

import random

import numpy as np
import pytest
import torch

from edurl import exercises
from edurl.exercises import FAILED, NOT_ATTEMPTED, PASSED
from edurl.exercises.solutions import ch09
from edurl.llm.datum import ModelInput
from edurl.llm.envs import Env, MessageEnv, StepResult
from edurl.llm.renderer import ChatMLRenderer
from edurl.llm.tokenizer import build_char_tokenizer

from .conftest import assert_rejected

# ---------------------------------------------------------------- 9.1 episode_mask (written as a learner would)


def _sampled(observations, actions):
    flags = [0.0] * (len(observations[-1]) + len(actions[-1]))
    for ob, ac in zip(observations, actions):
        for i in range(len(ob), len(ob) + len(ac)):
            flags[i] = 1.0
    return flags


def mask_on_tokens(observations, actions):
    return _sampled(observations, actions)[:-1]


def mask_everything_after_the_prompt(observations, actions):
    n = len(observations[-1]) + len(actions[-1])
    return [1.0 if i >= len(observations[0]) else 0.0 for i in range(1, n)]


def mask_last_reply(observations, actions):
    n = len(observations[-1]) + len(actions[-1])
    return [1.0 if i >= len(observations[-1]) else 0.0 for i in range(1, n)]


def mask_without_stop(observations, actions):
    flags = [0.0] * (len(observations[-1]) + len(actions[-1]))
    for ob, ac in zip(observations, actions):
        for i in range(len(ob), len(ob) + len(ac) - 1):
            flags[i] = 1.0
    return flags[1:]


def mask_per_token(observations, actions):
    return _sampled(observations, actions)


def test_episode_mask_passes_the_solution():
    assert exercises.check_episode_mask(ch09.episode_mask, verbose=False).status == PASSED


def test_a_mask_the_checker_passes_also_passes_the_notebooks_next_cell():
    """A tensor or a tuple of the right floats passes 9.1; the notebook's next cell once compared it with a list by ==
    and failed right after the "passed"."""
    import json
    from pathlib import Path

    from edurl.llm.envs import Trajectory, Transition, merged_datum
    from edurl.llm.envs.base import TokensWithLogprobs

    notebook = Path(__file__).resolve().parents[2] / "notebooks/09_multiturn_tools.ipynb"
    sources = ["".join(c["source"]) for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    (cell,) = [source for source in sources if "v_mask.implementation" in source]
    obs, acts = [[1, 2], [1, 2, 7, 3, 4]], [[7], [8, 9]]
    transitions = [
        Transition(ModelInput.from_ints(o), TokensWithLogprobs(a, [0.0] * len(a)), 0.0, False)
        for o, a in zip(obs, acts)
    ]
    episode = Trajectory(transitions, ModelInput.from_ints([]))
    f = merged_datum(episode, 1.0).loss_fn_inputs
    for as_returned in (torch.tensor, tuple, list):
        v_mask = exercises.check_episode_mask(
            lambda o, a, as_returned=as_returned: as_returned(ch09.episode_mask(o, a)), verbose=False
        )
        assert v_mask.status == PASSED, v_mask.message
        exec(cell, {"v_mask": v_mask, "episode": episode, "f": f})


def test_episode_mask_stub_is_not_attempted():
    def stub(observations, actions):
        raise NotImplementedError

    assert exercises.check_episode_mask(stub, verbose=False).status == NOT_ATTEMPTED


@pytest.mark.parametrize(
    "buggy, hint",
    [
        (mask_on_tokens, "one position late"),
        (mask_everything_after_the_prompt, "environment's tokens are in the mask"),
        (mask_last_reply, "only the last reply"),
        (mask_without_stop, "stop token"),
        (mask_per_token, "one entry per token"),
    ],
)
def test_episode_mask_rejects_buggy_versions_by_name(buggy, hint):
    assert_rejected(exercises.check_episode_mask, buggy, hint)


def test_episode_mask_names_a_missing_return_and_a_returned_tuple():
    def no_return(observations, actions):
        mask = ch09.episode_mask(observations, actions)  # noqa: F841 (the mistake under test)

    def with_count(observations, actions):
        mask = ch09.episode_mask(observations, actions)
        return mask, sum(mask)

    assert_rejected(exercises.check_episode_mask, no_return, "forget the `return mask`")
    assert_rejected(exercises.check_episode_mask, with_count, "return just the mask")

    def tuple_of_numbers(observations, actions):  # a tuple of 0-d tensors is a mask, not a (mask, count) pair
        return tuple(torch.tensor(ch09.episode_mask(observations, actions)))

    assert exercises.check_episode_mask(tuple_of_numbers, verbose=False).status == PASSED


# ---------------------------------------------------------------- 9.2 an environment of your own

R = ChatMLRenderer(build_char_tokenizer())


def test_check_env_passes_the_solution_and_the_library_games():
    from edurl.llm.envs import CalculatorEnv, GuessNumberEnv

    assert exercises.check_env(lambda: ch09.ReverseWordEnv("cat", R), verbose=False).status == PASSED
    assert exercises.check_env(lambda: GuessNumberEnv(7, R), verbose=False).status == PASSED
    assert exercises.check_env(lambda: CalculatorEnv("123+456=?", "579", R), verbose=False).status == PASSED
    # a word drawn per environment: prompts of different lengths are not shared state (once failed at random)
    words = random.Random(0)
    pool = ["ox", "cat", "stop", "banana", "elephant", "reinforcement"]
    for _ in range(5):
        verdict = exercises.check_env(lambda: ch09.ReverseWordEnv(words.choice(pool), R), verbose=False)
        assert verdict.status == PASSED, verdict.message


class NeverEnds(ch09.ReverseWordEnv):
    def __init__(self, word, renderer):
        super().__init__(word, renderer)
        self.max_turns = 10**6  # and reply never says done

    def reply(self, text):
        return 0.0, False, [{"role": "user", "content": "again"}], {}


class ForgetsTheReply(ch09.ReverseWordEnv):
    """Builds the next observation from the environment's messages only: the model's reply is not in it."""

    def step(self, action):
        result = super().step(action)
        if result.episode_done:
            return result
        shown = [m for m in self.messages if m["role"] != "assistant"]
        return StepResult(0.0, False, ModelInput.from_ints(R.build_generation_prompt(shown)), [4], {})


class CrashesOnGarbage(ch09.ReverseWordEnv):
    def reply(self, text):
        int(text)  # assumes the model writes a number
        return super().reply(text)


class NanReward(ch09.ReverseWordEnv):
    def reply(self, text):
        reward, done, new, metrics = super().reply(text)
        return float("nan") if done else reward, done, new, metrics


class SharedHistory(Env):
    """A list on the class: every instance appends to the same conversation."""

    messages, tries = [], 2

    def __init__(self):
        self.turns = 0

    def initial_observation(self):
        self.messages.append({"role": "user", "content": "Reverse: cat"})
        return ModelInput.from_ints(R.build_generation_prompt(self.messages)), [4]

    def step(self, action):
        self.turns += 1
        message, _ = R.parse_response(action)
        self.messages += [message, {"role": "user", "content": "no"}]
        done = self.turns >= self.tries
        ob = [] if done else R.build_generation_prompt(self.messages)
        return StepResult(0.0, done, ModelInput.from_ints(ob), [4], {})


class TriesOnTheClass(ch09.ReverseWordEnv):
    """The wrong replies counted in a list on the class: once three have been played anywhere, every new env ends
    after one wrong reply. Its prompt never grows, so only replaying the same replies catches it."""

    wrong = []

    def reply(self, text):
        if text.strip() == self.word[::-1]:
            return 1.0, True, [], {"win": 1.0}
        self.wrong.append(text)
        done = len(self.wrong) >= self.tries
        return 0.0, done, [] if done else [{"role": "user", "content": "no, again"}], {"win": 0.0}


class ReturnsATuple(ch09.ReverseWordEnv):
    def step(self, action):
        r = super().step(action)
        return r.reward, r.episode_done, r.next_observation


@pytest.mark.parametrize(
    "make_env, hint",
    [
        (lambda: NeverEnds("cat", R), "did not end"),
        (lambda: ForgetsTheReply("cat", R), "does not extend"),
        (lambda: CrashesOnGarbage("cat", R), "never a crash"),
        (lambda: NanReward("cat", R), "finite number"),
        (SharedHistory, "share state"),
        (lambda: TriesOnTheClass("cat", R), "answered the same 20 replies differently"),
        (lambda: ReturnsATuple("cat", R), "must return a StepResult"),
        (lambda: "not an env", "subclass"),
    ],
)
def test_check_env_rejects_broken_environments_by_name(make_env, hint):
    verdict = exercises.check_env(make_env, verbose=False)
    assert verdict.status == FAILED and hint in verdict.message, verdict.message
    assert isinstance(verdict.implementation(), ch09.ReverseWordEnv)  # the notebook goes on with the reference


class DefaultArgumentHistory(SharedHistory):
    """A mutable default argument: every env made without ``messages`` shares one list, which each empties when it
    starts (SharedHistory's step). Played one after another the episodes look right; played side by side, as a
    group's are, they mix (from the third turn: one env's second reply is in the other's third observation)."""

    tries = 3

    def __init__(self, messages=[]):  # noqa: B006 (the mistake under test)
        self.messages, self.turns = messages, 0

    def initial_observation(self):
        self.messages[:] = [{"role": "user", "content": "Reverse: cat"}]
        return ModelInput.from_ints(R.build_generation_prompt(self.messages)), [4]


class StartsByAppending(DefaultArgumentHistory):
    """Correct: its own list, to which initial_observation appends the first message (it is called once per
    episode). The checker once called it twice on one env and blamed state shared on the class."""

    def __init__(self):
        super().__init__(messages=[])

    def initial_observation(self):
        self.messages.append({"role": "user", "content": "Reverse: cat"})
        return ModelInput.from_ints(R.build_generation_prompt(self.messages)), (4,)  # a tuple of stop ids, too


class CrashesOnTheRightAnswer(ch09.ReverseWordEnv):
    def reply(self, text):
        if text.strip() == self.word[::-1]:
            return 1.0, True, [], {"win": self.wins + 1}  # no such attribute: random replies never get here
        return super().reply(text)


class NoRewardForTheRightAnswer(ch09.ReverseWordEnv):
    def reply(self, text):
        reward, done, new, metrics = super().reply(text[::-1])  # reverses the reply, not the word
        return reward, done, new, metrics


class PenaltyAndABrokenWin(ch09.ReverseWordEnv):
    """A malformed reply costs 0.1, and the winning branch compares with the word, not the word reversed: the right
    reply gets 0, above the penalty, which a rule that only asked to beat the worst random reply let pass."""

    def reply(self, text):
        if text.strip() == self.word:
            return 1.0, True, [], {"win": 1.0}
        done = self.turns >= self.tries
        return 0.0 if text.strip().isalpha() else -0.1, done, [] if done else [{"role": "user", "content": "no"}], {}


class TextRewardOnTheRightAnswer(ch09.ReverseWordEnv):
    def reply(self, text):
        reward, done, new, metrics = super().reply(text)
        return ("win" if reward else reward), done, new, metrics  # random replies never get here


class PaysAfterConfirming(ch09.ReverseWordEnv):
    """Correct: a right answer is asked to confirm ("yes"), and only that pays."""

    def __init__(self, word, renderer):
        super().__init__(word, renderer)
        self.max_turns, self.got = 4, False

    def reply(self, text):
        if self.got:
            return float(text.strip() == "yes"), True, [], {}
        if text.strip() == self.word[::-1]:
            self.got = True
            return 0.0, False, [{"role": "user", "content": "sure? say yes"}], {}
        done = self.turns >= self.tries
        return 0.0, done, [] if done else [{"role": "user", "content": "no"}], {}


def test_check_env_plays_envs_side_by_side_and_makes_a_new_one_per_call():
    verdict = exercises.check_env(DefaultArgumentHistory, verbose=False)
    assert verdict.status == FAILED and "played beside it" in verdict.message, verdict.message
    assert "mutable default argument" in verdict.message
    one = ch09.ReverseWordEnv("cat", R)
    verdict = exercises.check_env(lambda: one, verbose=False)
    assert verdict.status == FAILED and "the same Env object twice" in verdict.message, verdict.message
    verdict = exercises.check_env(StartsByAppending, verbose=False)
    assert verdict.status == PASSED, verdict.message


class NoStopAfterTheFirstTurn(ch09.ReverseWordEnv):
    """Forgets the stop condition while the episode goes on: the rollout's sampler would get None."""

    def step(self, action):
        r = super().step(action)
        return r if r.episode_done else StepResult(r.reward, False, r.next_observation, None, r.metrics)


class NothingAfterTheEnd(ch09.ReverseWordEnv):
    """Correct: None for an ended episode's observation and stop condition, which nothing reads."""

    def step(self, action):
        r = super().step(action)
        return StepResult(r.reward, True, None, None, r.metrics) if r.episode_done else r


class DefaultArgumentHistoryNothingAfterTheEnd(DefaultArgumentHistory):
    """DefaultArgumentHistory's mistake, with None as an ended episode's observation: reading that observation once
    made the checker skip its side-by-side play, and pass."""

    def step(self, action):
        r = super().step(action)
        return StepResult(r.reward, True, None, None, r.metrics) if r.episode_done else r


class LaterStopShared(ch09.ReverseWordEnv):
    """Counts steps on the class, and after 40 of them anywhere puts an id before its stop condition: shared state that
    shows only in a later turn's stop condition, with which the rollout closes the next reply."""

    steps = 0

    def step(self, action):
        r = super().step(action)
        type(self).steps += 1
        if r.episode_done:
            return r
        extra = R.tokenizer.encode("x", add_special_tokens=False) if type(self).steps > 40 else []
        return StepResult(r.reward, False, r.next_observation, extra + list(r.next_stop_condition), r.metrics)


class RightBranchBadStop(ch09.ReverseWordEnv):
    """A right first reply earns 0.5 and one more turn, whose stop condition is ``bad`` (random replies never get
    there)."""

    bad = None

    def reply(self, text):
        if text.strip() == "pots" and self.turns == 1:
            return 0.5, False, [{"role": "user", "content": "again"}], {}
        return super().reply(text)

    def step(self, action):
        r = super().step(action)
        if not r.episode_done and r.reward == 0.5:
            return StepResult(r.reward, False, r.next_observation, self.bad, r.metrics)
        return r


class RightBranchNumpyStop(RightBranchBadStop):
    bad = [np.int64(4)]


def test_check_env_needs_a_stop_condition_only_while_the_episode_goes_on():
    verdict = exercises.check_env(lambda: NoStopAfterTheFirstTurn("stop", R), verbose=False)
    assert verdict.status == FAILED and "next_stop_condition gave the stop condition None" in verdict.message
    verdict = exercises.check_env(lambda: NothingAfterTheEnd("stop", R), right_reply="pots", verbose=False)
    assert verdict.status == PASSED, verdict.message
    verdict = exercises.check_env(DefaultArgumentHistoryNothingAfterTheEnd, verbose=False)
    assert verdict.status == FAILED and "played beside it" in verdict.message, verdict.message
    LaterStopShared.steps = 0
    verdict = exercises.check_env(lambda: LaterStopShared("stop", R), verbose=False)
    assert verdict.status == FAILED and "answered the same 20 replies differently" in verdict.message, verdict.message
    # the right reply's branch: the checker's own list(None) was once reported as a crash of step()
    for env, said in ((RightBranchBadStop, "gave the stop condition None"), (RightBranchNumpyStop, "Python ints")):
        verdict = exercises.check_env(lambda env=env: env("stop", R), right_reply=["pots", "pots"], verbose=False)
        assert (
            verdict.status == FAILED and said in verdict.message and "after the right reply 'pots'" in verdict.message
        )
        assert "step() raised" not in verdict.message, verdict.message


def test_check_env_plays_the_right_reply():
    make = lambda: ch09.ReverseWordEnv("stop", R)  # noqa: E731
    verdict = exercises.check_env(make, verbose=False)
    assert verdict.status == PASSED and "was not run" in verdict.message, verdict.message
    verdict = exercises.check_env(make, right_reply="pots", verbose=False)
    assert verdict.status == PASSED and "'pots' got 1" in verdict.message, verdict.message
    crashes = exercises.check_env(lambda: CrashesOnTheRightAnswer("stop", R), right_reply="pots", verbose=False)
    assert crashes.status == FAILED and "raised AttributeError (at line" in crashes.message, crashes.message
    ignored = exercises.check_env(lambda: NoRewardForTheRightAnswer("stop", R), right_reply="pots", verbose=False)
    assert ignored.status == FAILED and "recognise a right answer" in ignored.message, ignored.message
    assert exercises.check_env(lambda: NoRewardForTheRightAnswer("stop", R), verbose=False).status == PASSED
    wrong_type = exercises.check_env(make, right_reply=[4, 5], verbose=False)
    assert wrong_type.status == FAILED and "must be the text of a reply" in wrong_type.message
    text = exercises.check_env(lambda: TextRewardOnTheRightAnswer("stop", R), right_reply="pots", verbose=False)
    assert text.status == FAILED and "'win'" in text.message, text.message  # MessageEnv's float() names it
    # the bar is a wrong reply with tries left, not a malformed reply's penalty
    broken = exercises.check_env(lambda: PenaltyAndABrokenWin("stop", R), right_reply="pots", verbose=False)
    assert broken.status == FAILED and "recognise a right answer" in broken.message, broken.message
    # a reward that comes later in the episode: a whole winning episode, as a list
    later = lambda: PaysAfterConfirming("stop", R)  # noqa: E731
    verdict = exercises.check_env(later, right_reply="pots", verbose=False)
    assert verdict.status == FAILED and "as a list" in verdict.message, verdict.message
    verdict = exercises.check_env(later, right_reply=["pots", "yes"], verbose=False)
    assert verdict.status == PASSED and "got 1 in 2 turns" in verdict.message, verdict.message


class PaysAnyReply(ch09.ReverseWordEnv):
    """``if answer:`` for ``if text.strip() == answer:``: every complete reply wins. Only the cut-off random replies
    (MessageEnv ends those at 0) scored less, so the right reply once beat the bar and passed."""

    def reply(self, text):
        if self.word[::-1]:
            return 1.0, True, [], {"win": 1.0}
        return 0.0, True, [], {"win": 0.0}


class WinDoesNotEnd(ch09.ReverseWordEnv):
    def reply(self, text):
        win = text.strip() == self.word[::-1]
        done = self.turns >= self.tries  # a right answer should end the episode too
        return float(win), done, [] if done else [{"role": "user", "content": "again"}], {"win": float(win)}


class RepeatsTheReply(ch09.ReverseWordEnv):
    def reply(self, text):
        reward, done, new, metrics = super().reply(text)
        return reward, done, ([{"role": "assistant", "content": text}] + new if new else new), metrics


class SilentRetry(ch09.ReverseWordEnv):
    def reply(self, text):
        if text.strip() == self.word[::-1]:
            return 1.0, True, [], {"win": 1.0}
        return 0.0, self.turns >= self.tries, [], {"win": 0.0}


class CrashesOnZ(ch09.ReverseWordEnv):
    def reply(self, text):
        if text.strip() == "zzzz":  # random replies never say it: only the checker's wrong reply reaches this
            raise KeyError("z")
        return super().reply(text)


def test_check_env_refuses_a_reward_for_any_reply_a_win_that_goes_on_and_a_reply_shown_twice():
    verdict = exercises.check_env(lambda: PaysAnyReply("stop", R), right_reply="pots", verbose=False)
    assert verdict.status == FAILED and "pays a reply whatever it says" in verdict.message, verdict.message
    assert "'zzzz'" in verdict.message
    verdict = exercises.check_env(lambda: WinDoesNotEnd("stop", R), right_reply="pots", verbose=False)
    assert verdict.status == FAILED and "a right answer must end it" in verdict.message, verdict.message
    # played until the tries run out, the same env once passed: its episode ended, on the third win
    verdict = exercises.check_env(lambda: WinDoesNotEnd("stop", R), right_reply=["pots"] * 3, verbose=False)
    assert verdict.status == FAILED and "paid 1 again for the same reply on turn 2" in verdict.message, verdict.message
    verdict = exercises.check_env(lambda: ch09.ReverseWordEnv("stop", R), right_reply=["pots"] * 3, verbose=False)
    assert verdict.status == PASSED, verdict.message  # the first win ends the episode: the repeats are never played
    verdict = exercises.check_env(lambda: RepeatsTheReply("stop", R), right_reply="pots", verbose=False)
    assert verdict.status == FAILED and "reply(text) returned an assistant message" in verdict.message, verdict.message
    # a right answer that is the checker's own wrong reply is not held against the environment
    verdict = exercises.check_env(lambda: ch09.ReverseWordEnv("zzzz", R), right_reply="zzzz", verbose=False)
    assert verdict.status == PASSED, verdict.message
    verdict = exercises.check_env(lambda: ch09.ReverseWordEnv("qqqq", R), right_reply=["zzzz", "qqqq"], verbose=False)
    assert verdict.status == PASSED, verdict.message  # was a StopIteration: no wrong reply left to play
    # a wrong try answered with no message at all (the model tries again) is allowed
    verdict = exercises.check_env(lambda: SilentRetry("stop", R), right_reply="pots", verbose=False)
    assert verdict.status == PASSED, verdict.message
    verdict = exercises.check_env(lambda: CrashesOnZ("stop", R), right_reply="pots", verbose=False)
    assert verdict.status == FAILED and "on the reply 'zzzz'" in verdict.message, verdict.message
    assert "a wrong one too, without a crash" in verdict.message and "right answer must run" not in verdict.message


def test_check_env_names_its_turn_limit_and_how_to_raise_it():
    """A valid environment with more tries than the checker plays was once told to end "after a fixed number of
    tries", which it does."""
    many_tries = lambda: ch09.ReverseWordEnv("stop", R, tries=25)  # noqa: E731
    verdict = exercises.check_env(many_tries, verbose=False)
    assert verdict.status == FAILED and "max_turns=20" in verdict.message, verdict.message
    assert "check_env(make_env, max_turns=" in verdict.message, verdict.message
    assert exercises.check_env(many_tries, max_turns=30, verbose=False).status == PASSED


def test_check_env_stub_is_not_attempted():
    class Stub(MessageEnv):
        def initial_messages(self):
            raise NotImplementedError

        def reply(self, text):
            raise NotImplementedError

    class HalfStub(ch09.ReverseWordEnv):  # the prompt is written, the reply is not yet
        def reply(self, text):
            raise NotImplementedError

    assert exercises.check_env(lambda: Stub(R), verbose=False).status == NOT_ATTEMPTED
    assert exercises.check_env(lambda: HalfStub("cat", R), verbose=False).status == NOT_ATTEMPTED

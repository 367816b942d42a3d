"""Guess the number: a multi-turn game for RL (Chapter 9).

The environment picks a secret in [low, high] (0..31 by default). The model has ``max_guesses`` turns; each
reply's last integer is its guess, and the environment answers "higher", "lower" or "correct". A win is worth 1,
minus ``guess_penalty`` per guess used.

The model's reply may carry a scratchpad before the guess. The course's demonstrations write the range that is
still possible, its middle, and then a random guess in the range, e.g. ``16-31 mid 23: 20``: the model's own
tokens carry the game's state, the way a chain of thought does, and every guess is legal. The warm start thus
knows where the middle is but does not use it; that guessing the middle wins is what RL has to find out.

Reference points, exact (:func:`win_rate`): bisection wins 31 of the 32 secrets in 5 guesses (5 guesses can
tell apart at most 2**5 - 1 = 31 numbers, so one secret needs a sixth); guessing 5 distinct numbers at random,
ignoring the answers, wins 5/32; a uniformly random guess inside the remaining range wins 53.3 %.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from functools import cache

from edurl._checks import is_whole
from edurl.llm.envs.base import MessageEnv, ProblemGroupBuilder
from edurl.llm.renderer import ChatMLRenderer, Message

_INT = re.compile(r"-?[0-9]+")  # ASCII digits: \d also matches other scripts' digits


def parse_guess(text: str) -> int | None:
    """The last integer in ``text`` (the guess), or None when there is none. ASCII digits only ("٤٦" is no guess,
    as :func:`edurl.llm.rewards.grade` reads it); a number of more than 18 digits is outside any game's range, and
    is returned as one just past 10**18 with its sign, so that a reply of thousands of digits is a wrong guess, not
    an error from int()."""
    found = _INT.findall(text)
    if not found:
        return None
    digits = found[-1].lstrip("-").lstrip("0") or "0"
    value = int(digits) if len(digits) <= 18 else 10**18 + 1
    return -value if found[-1].startswith("-") else value


def intro(low: int, high: int, max_guesses: int) -> str:
    return f"Guess my number, {low} to {high}. {max_guesses} tries."


def check_reward_settings(
    max_guesses: int = 5,
    guess_penalty: float = 0.0,
    shaped: bool = False,
    win_bonus: float = 0.0,
    relative: bool = False,
    scratchpad_bonus: float = 0.0,
    num_values: int = 32,
) -> None:
    """Refuse reward settings of :class:`GuessNumberEnv` that do not make sense together (also called by
    ``MultiTurnConfig``, so that a run is refused before its warm start, not at its first rollout)."""
    if not isinstance(max_guesses, int) or max_guesses < 1:
        raise ValueError(f"max_guesses must be a positive int, got {max_guesses!r}")
    if not 0 <= guess_penalty < 1 / max_guesses:
        raise ValueError(
            f"guess_penalty must be in [0, 1/max_guesses) so that a win always beats a loss, got {guess_penalty!r}"
        )
    # shaped, a loss that leaves one number earns 1 - 1/num_values and a win 1 + win_bonus, less the penalty (charged
    # on a win only): the win stays ahead while guess_penalty * max_guesses < win_bonus + 1/num_values
    room = win_bonus + 1 / num_values
    if guess_penalty and shaped and (relative or guess_penalty * max_guesses >= room):
        raise ValueError(
            f"guess_penalty={guess_penalty!r} with shaped=True pays a narrow loss more than a late win: the penalty "
            f"is charged on a win only, and a shaped loss that leaves one number already earns 1 - 1/{num_values}, "
            + (
                "and with relative=True the rewards do not add up to the share ruled out, so no penalty is safe"
                if relative
                else f"so a win needs guess_penalty * max_guesses < win_bonus + 1/{num_values} = {room:.4g}"
            )
            + "; lower it, or favour winning with win_bonus"
        )
    if win_bonus < 0 or (win_bonus and not shaped):
        raise ValueError(f"win_bonus must be >= 0, and is used only with shaped=True; got {win_bonus!r}")
    if relative and not shaped:
        raise ValueError("relative=True changes the shaped reward; set shaped=True as well")
    if not 0 <= scratchpad_bonus <= 1:
        raise ValueError(f"scratchpad_bonus must be in [0, 1], got {scratchpad_bonus!r}")


def _check_range(low, high) -> None:
    """The game's range: whole numbers (guesses are), low <= high."""
    if not (is_whole(low) and is_whole(high)):
        raise ValueError(f"low and high must be whole numbers (guesses are), got low={low!r}, high={high!r}")
    if high < low:
        raise ValueError(f"the range [{low}, {high}] is empty: high must be >= low")


class GuessNumberEnv(MessageEnv):
    """One game of guess-the-number against ``secret``. Metrics: ``win``, ``guesses``, ``illegal`` (the last reply
    had no number, or was cut off), ``central`` (the share of guesses so far that fell in the middle half of
    the numbers still possible: 1.0 for bisection, about 0.5 for a random guess in the range) and
    ``scratchpad_ok`` (the share of replies so far that began with the range still possible and its middle, as
    the demonstrations do, :func:`scratchpad`: RL can corrupt that state while the guesses still look central).

    ``shaped=True`` pays each guess the share of all the numbers that its answer rules out (a right guess rules
    out everything left), instead of 1 for a win at the end. The rewards add up to 1 - (numbers still possible
    at the end) / 32: 1 for any win, and nearly as much for a loss that came close. That is pure shaping (the
    change of the potential -remaining/32, Ng et al. 1999) with the game's own reward left out, so it pays for
    narrowing the range, not for winning. ``win_bonus`` adds the game's reward back: a win then earns
    ``win_bonus`` more than the share it ruled out. (Ng et al.'s guarantee that shaping leaves the best policy
    unchanged also needs the potential to be the same at every end of the game; -remaining/32 is not, since a
    loss ends with numbers still possible.)

    ``relative=True`` (with ``shaped``) pays the share of the numbers *still possible* that the answer rules out,
    instead of the share of all of them: a middle guess earns about 1/2 at every turn, where the share of all 32
    shrinks by half each turn (1/2, 1/4, 1/8, ...), so that late guesses, which decide the win, are paid on the
    same scale as the first. The rewards then no longer add up to the share ruled out.

    ``scratchpad_bonus`` adds that much to a turn's reward when its reply begins with the right scratchpad (what
    ``scratchpad_ok`` counts): a process reward for keeping the game's state, which RL otherwise lets drift because
    no outcome reward looks at it. It pays for the bookkeeping, never for the guess, so bisection stays the best
    policy."""

    def __init__(
        self,
        secret: int,
        renderer: ChatMLRenderer,
        low: int = 0,
        high: int = 31,
        max_guesses: int = 5,
        guess_penalty: float = 0.0,
        shaped: bool = False,
        win_bonus: float = 0.0,
        relative: bool = False,
        scratchpad_bonus: float = 0.0,
    ):
        super().__init__(renderer)
        _check_range(low, high)
        if not is_whole(secret):  # 3.5 made a game no guess wins
            raise ValueError(f"secret must be a whole number (guesses are), got {secret!r}")
        if not low <= secret <= high:
            raise ValueError(f"secret {secret} is outside [{low}, {high}]")
        check_reward_settings(max_guesses, guess_penalty, shaped, win_bonus, relative, scratchpad_bonus, high - low + 1)
        self.win_bonus, self.relative, self.scratchpad_bonus = float(win_bonus), relative, float(scratchpad_bonus)
        self.secret, self.low, self.high = secret, low, high
        self.max_guesses, self.guess_penalty, self.shaped = max_guesses, guess_penalty, shaped
        self.max_turns = max_guesses
        self.possible = (low, high)  # the numbers the answers so far still allow
        self.central = 0  # guesses in the middle half of what was still possible
        self.scratchpad_ok = 0  # replies whose scratchpad named the range still possible and its middle

    def initial_messages(self) -> list[Message]:
        self.possible = (self.low, self.high)
        self.central = self.scratchpad_ok = 0
        return [{"role": "user", "content": intro(self.low, self.high, self.max_guesses)}]

    def _ruled_out(self, guess: int | None) -> float:
        """The shaped reward of a guess: the share of all numbers that its answer rules out."""
        lo, hi = self.possible
        if guess is None or not lo <= guess <= hi:
            return 0.0
        self.central += abs(guess - (lo + hi) / 2) <= (hi - lo + 1) / 4
        if guess == self.secret:
            new = (1, 0)  # nothing left
        else:
            new = (guess + 1, hi) if guess < self.secret else (lo, guess - 1)
        self.possible = new
        before, after = hi - lo + 1, max(new[1] - new[0] + 1, 0)
        return (before - after) / (before if self.relative else self.high - self.low + 1)

    def _metrics(self, win: bool, illegal: bool) -> dict[str, float]:
        used = self.turns
        return {
            "win": float(win),
            "guesses": float(used),
            "illegal": float(illegal),
            "central": self.central / used,
            "scratchpad_ok": self.scratchpad_ok / used,
        }

    def truncated_metrics(self) -> dict[str, float]:
        return self._metrics(win=False, illegal=True)

    def reply(self, text: str) -> tuple[float, bool, list[Message], dict[str, float]]:
        guess = parse_guess(text)
        used = self.turns
        lo, hi = self.possible
        kept = text.strip().startswith(f"{lo}-{hi} mid {(lo + hi) // 2}:")
        self.scratchpad_ok += kept
        process = self.scratchpad_bonus * kept
        shaped = self._ruled_out(guess)
        if guess == self.secret:
            reward = (shaped + self.win_bonus if self.shaped else 1.0) - self.guess_penalty * used + process
            return reward, True, [], self._metrics(win=True, illegal=False)
        done = used >= self.max_guesses
        metrics = self._metrics(win=False, illegal=guess is None)
        if guess is None:
            answer = f"Say a number from {self.low} to {self.high}."
        else:
            answer = "higher" if guess < self.secret else "lower"
        reward = (shaped if self.shaped else 0.0) + process
        return reward, done, [] if done else [{"role": "user", "content": answer}], metrics


class GuessNumberGroupBuilder(ProblemGroupBuilder):
    """``group_size`` games against the same secret."""

    def __init__(self, secret: int, renderer: ChatMLRenderer, group_size: int, **env_kwargs):
        super().__init__(lambda: GuessNumberEnv(secret, renderer, **env_kwargs), group_size, tags=["guess_number"])
        self.secret = secret


# ---------------------------------------------------------------- scripted players and exact win rates


def bisect_guess(low: int, high: int, rng: random.Random | None = None) -> int:
    """The middle of the range (rounding down)."""
    return (low + high) // 2


def random_guess(low: int, high: int, rng: random.Random) -> int:
    """A uniformly random number in the range: legal and consistent with every answer, but unskilled."""
    return rng.randint(low, high)


def scratchpad(low: int, high: int, guess: int) -> str:
    """A demonstrated reply: the range still possible, its middle, then the guess (``"16-31 mid 23: 20"``)."""
    return f"{low}-{high} mid {(low + high) // 2}: {guess}"


def play(policy: Callable[[int, int, random.Random], int], secret: int, rng: random.Random, low=0, high=31, tries=5):
    """Play one game with a scripted ``policy(low, high, rng) -> guess`` that sees the remaining range.
    Returns the conversation's assistant replies (:func:`scratchpad`) and whether it won."""
    replies = []
    for _ in range(tries):
        guess = policy(low, high, rng)
        replies.append(scratchpad(low, high, guess))
        if guess == secret:
            return replies, True
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
    return replies, False


def demonstration(secret: int, rng: random.Random, policy=random_guess, low=0, high=31, tries=5) -> list[Message]:
    """A whole game as messages, played by ``policy``: the warm start's training data."""
    replies, won = play(policy, secret, rng, low, high, tries)
    messages: list[Message] = [{"role": "user", "content": intro(low, high, tries)}]
    for i, r in enumerate(replies):
        messages.append({"role": "assistant", "content": r})
        guess = parse_guess(r)
        if i + 1 < len(replies):
            messages.append({"role": "user", "content": "higher" if guess < secret else "lower"})
    return messages


@cache
def _random_win(n: int, tries: int) -> float:
    """P(win) with a uniform guess in a range of n numbers and ``tries`` guesses left, the secret uniform in it."""
    if n <= 0 or tries <= 0:
        return 0.0
    # guess position g (0-based) is right with prob 1/n; else the secret is in the n-1 others, g below or above
    total = 0.0
    for g in range(n):
        total += 1 / n + (g / n) * _random_win(g, tries - 1) + ((n - 1 - g) / n) * _random_win(n - 1 - g, tries - 1)
    return total / n


def win_rate(player: str, low: int = 0, high: int = 31, tries: int = 5) -> float:
    """Exact win rate over a uniform secret: ``"bisect"``, ``"random_in_range"`` or ``"random_blind"`` (distinct
    random guesses that ignore the answers: tries / n)."""
    _check_range(low, high)  # high < low divided by zero or gave a rate above 0 for an empty range
    if not is_whole(tries) or tries < 0:
        raise ValueError(f"tries must be an int >= 0, got {tries!r}")
    n = high - low + 1
    if player == "bisect":
        return sum(play(bisect_guess, s, random.Random(0), low, high, tries)[1] for s in range(low, high + 1)) / n
    if player == "random_in_range":
        return _random_win(n, tries)
    if player == "random_blind":
        return min(tries, n) / n
    raise ValueError(f"player must be 'bisect', 'random_in_range' or 'random_blind', got {player!r}")

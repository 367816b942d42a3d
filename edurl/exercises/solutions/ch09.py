"""Worked solutions for Chapter 9. Open them with ``edurl.exercises.show_solution(name)``, name one of
"episode_mask" and "env" (the environment of exercise 9.2, ReverseWordEnv)."""

from edurl.llm.envs import MessageEnv


def episode_mask(observations, actions):
    """Exercise 9.1: the mask of an episode merged into one datum.

    ``observations[k]`` and ``actions[k]`` are the token ids of turn k's observation and of the model's reply
    (its stop token included). Each observation extends the previous observation and action, so the whole
    episode is ``observations[-1] + actions[-1]``. Position i of the datum predicts token i + 1, so the mask has
    one entry fewer than the episode has tokens: 1.0 where the predicted token is one the model sampled, 0.0
    where the environment wrote it (the prompt, the replies, the next turn's header).
    Example: observations [[1, 2], [1, 2, 7, 3, 4]], actions [[7], [8, 9]] -> tokens 1 2 7 3 4 8 9, and the
    targets 2 7 3 4 8 9 get the mask [0, 1, 0, 0, 1, 1].
    """
    tokens = observations[-1] + actions[-1]
    sampled = [False] * len(tokens)
    for ob, ac in zip(observations, actions):
        start = len(ob)  # the reply starts right after the observation it answered
        for i in range(start, start + len(ac)):
            sampled[i] = True
    return [1.0 if s else 0.0 for s in sampled[1:]]  # position i is about token i + 1


class ReverseWordEnv(MessageEnv):
    """Exercise 9.2: the model must write ``word`` backwards, with up to 3 tries. Reward 1 for a right answer."""

    def __init__(self, word, renderer, tries=3):
        super().__init__(renderer)
        self.word, self.tries = word, tries
        self.max_turns = tries

    def initial_messages(self):
        return [{"role": "user", "content": f"Reverse: {self.word}"}]

    def truncated_metrics(self):  # a reply cut off by max_tokens ends the episode: a loss
        return {"win": 0.0}

    def reply(self, text):
        if text.strip() == self.word[::-1]:
            return 1.0, True, [], {"win": 1.0}
        done = self.turns >= self.tries  # self.turns counts the model's replies so far
        return 0.0, done, [] if done else [{"role": "user", "content": "no, again"}], {"win": 0.0}

"""Renderers: chat messages <-> token ids, the way a trainer needs them (Chapter 6).

A chat template (Jinja in the tokenizer) turns messages into text. An RL loop
needs three more things, which is what a renderer adds:

* ``build_generation_prompt(messages)``: the prompt as token ids, ending where
  the assistant starts speaking;
* ``get_stop_sequences()``: the token(s) that end the assistant's turn;
* ``parse_response(tokens, stop_reason)``: the sampled tokens back to a message,
  and whether the turn ended properly (a reply cut off by ``max_tokens`` is not
  ``ok``).

``ChatMLRenderer`` builds ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``) from
token pieces itself, so the test suite can check it against
``tokenizer.apply_chat_template`` for the course tokenizer and for Qwen-style
ones. Special tokens are inserted by id, never parsed out of user text.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

from transformers import PreTrainedTokenizerBase

from edurl.utils import warn_at_caller

ROLES = ("system", "user", "assistant", "tool")  # the roles whose names a ChatML turn writes as text

Message = dict[str, str]


def require_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise a helpful error if ``tokenizer`` has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{type(tokenizer).__name__} has no chat template, so there is no way to turn messages into a prompt. "
            "Use an instruct/chat checkpoint (e.g. Qwen2.5-0.5B-Instruct), or set tokenizer.chat_template, "
            "e.g. to edurl.llm.tokenizer.CHATML_TEMPLATE."
        )


FROM_TEMPLATE = "<the chat template's>"
"""``ChatMLRenderer``'s default ``default_system``: read it from the tokenizer's chat template."""


def template_default_system(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The system message that ``tokenizer``'s chat template inserts into a conversation that has none (Qwen2.5's
    "You are Qwen, created by Alibaba Cloud. ..."), or None when it inserts none."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tokenize=False)
    if not isinstance(text, str):
        return None
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):  # a template that opens with BOS
        text = text[len(bos) :]
    head = "<|im_start|>system\n"
    end = text.find("<|im_end|>", len(head)) if text.startswith(head) else -1
    return text[len(head) : end] if end >= 0 else None


def template_wraps_tool_results(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer``'s chat template writes a tool message as Qwen2.5's does: inside a user turn, between
    ``<tool_response>`` tags (consecutive tool messages share one turn), rather than as a ``tool`` turn."""
    probe = "tool-result-probe"
    conversation = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": "!"},
        {"role": "tool", "content": probe},
    ]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the tool role: the plain ChatML turn
        return False
    return isinstance(text, str) and f"<|im_start|>user\n<tool_response>\n{probe}\n</tool_response>" in text


class ChatMLRenderer:
    """ChatML prompts and replies as token ids.

    Args:
        tokenizer: a tokenizer whose vocabulary has ``<|im_start|>`` and ``<|im_end|>``.
        default_system: a system message inserted when the conversation has none; by default the one the
            tokenizer's chat template inserts (Qwen2.5's "You are Qwen, ...", none for the course's tokenizer), so
            that prompts match the model's own template; None for none.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, default_system: str | None = FROM_TEMPLATE):
        require_chat_template(tokenizer)
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        missing = [t for t in ("<|im_start|>", "<|im_end|>") if t not in vocab]
        if missing:
            raise ValueError(f"ChatMLRenderer needs the special tokens {missing} in the tokenizer's vocabulary")
        self.im_start = vocab["<|im_start|>"]
        self.im_end = vocab["<|im_end|>"]
        # every turn spells its role and a newline as text: a tokenizer that has no ids for them (a character
        # tokenizer built on digits alone) turned them into its unknown token, and the renderer wrote prompts no
        # model could tell apart, with no error until a later check blamed something else
        unk = tokenizer.unk_token_id
        unspelled = [] if unk is None else [s for s in (*ROLES, "\n") if unk in self._encode(s)]
        if unspelled:
            raise ValueError(
                f"the tokenizer cannot spell {unspelled} (it encodes them with its unknown token "
                f"{tokenizer.unk_token!r}), which every ChatML turn writes as text. Build the character tokenizer "
                "with an alphabet that has the role names' letters and '\\n' (build_char_tokenizer()'s default "
                "does), or use a byte-level tokenizer such as build_bpe_tokenizer's"
            )
        # the tokenizer's end of sequence when it is not <|im_end|>: sample() stops on the model's EOS too, and a base
        # Qwen2.5 ends its replies with <|endoftext|>, its tokenizer's EOS. Not every <|endoftext|>: a tokenizer whose
        # EOS is <|im_end|> may pad with it (the course's build_bpe_tokenizer does; its character tokenizer pads with
        # <|pad|>), and a reply cut off on one would be graded complete
        eos = tokenizer.eos_token_id
        self.eos_ids = frozenset() if eos is None or eos == self.im_end else frozenset({int(eos)})
        self._special_ids = frozenset(tokenizer.all_special_ids) | {self.im_start, self.im_end}
        self._num_ids = len(tokenizer)  # ids from here up are embedding rows with no token (Qwen2.5 has 271 of them)
        if default_system == FROM_TEMPLATE:
            default_system = template_default_system(tokenizer)
        # a tool message as the model's own template writes it: Qwen2.5's puts it in a user turn, inside
        # <tool_response> tags; the course's template (and plain ChatML) writes a "tool" turn
        self.tool_results_in_user_turn = template_wraps_tool_results(tokenizer)
        self.default_system = default_system

    def _encode(self, text: str, split_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special_tokens)

    def _turn(self, message: Message) -> list[int]:
        """``<|im_start|>role\\ncontent<|im_end|>\\n`` as ids."""
        # split_special_tokens for every role but the model's: a "<|im_end|>" written in a user's, a tool's or the
        # system's text is text, encoded as its characters, so it cannot end a turn or open a forged one. The
        # assistant's text was decoded from the model's own ids, special ones included, and re-encodes to them
        # (the prefix property of Chapter 9)
        return [
            self.im_start,
            *self._encode(message["role"] + "\n" + message["content"], message["role"] != "assistant"),
            self.im_end,
            *self._encode("\n"),
        ]

    def _check(self, messages: Sequence[Message]) -> list[Message]:
        if not messages:
            raise ValueError("messages is empty; pass at least one {'role': 'user', 'content': ...} message")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        messages = list(messages)
        if self.default_system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.default_system}, *messages]
        return messages

    def build_generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of ``messages`` followed by the opening of an assistant turn."""
        ids: list[int] = []
        wrapped = lambda m: m["role"] == "tool" and self.tool_results_in_user_turn  # noqa: E731
        for in_user_turn, run in groupby(self._check(messages), key=wrapped):
            if in_user_turn:  # consecutive tool results share one user turn
                ids += self._tool_results(list(run))
            else:
                for m in run:
                    ids += self._turn(m)
        return ids + [self.im_start, *self._encode("assistant\n")]

    def _tool_results(self, messages: Sequence[Message]) -> list[int]:
        """Consecutive tool messages in Qwen2.5's form: one user turn, each result inside ``<tool_response>``
        tags. Encoded as a user turn is (a special token's text in a result is text)."""
        body = "".join(f"\n<tool_response>\n{m['content']}\n</tool_response>" for m in messages)
        return [self.im_start, *self._encode("user" + body, True), self.im_end, *self._encode("\n")]

    def build_supervised_example(self, messages: Sequence[Message]) -> tuple[list[int], list[float]]:
        """Tokens of a whole conversation and a weight per token: 1 on the final
        assistant reply (its ``<|im_end|>`` included), 0 elsewhere. For SFT."""
        messages = self._check(messages)
        if messages[-1]["role"] != "assistant":
            raise ValueError("the last message must be the assistant's reply to learn from")
        prompt = self.build_generation_prompt(messages[:-1])
        reply = [*self._encode(messages[-1]["content"]), self.im_end]
        return prompt + reply, [0.0] * len(prompt) + [1.0] * len(reply)

    def get_stop_sequences(self) -> list[int]:
        """The assistant's turn ends with ``<|im_end|>``."""
        return [self.im_end]

    def parse_response(self, tokens: Sequence[int], stop_reason: str | None = None) -> tuple[Message, bool]:
        """Sampled tokens -> (assistant message, ok). ``ok`` is True when the reply ended, False when it was cut off
        by ``max_tokens``.

        A reply that holds an ``<|im_end|>`` ended there: the message is what comes before it. Otherwise pass the
        sampler's ``stop_reason`` ("stop" or "length") when you have it. A real chat model may stop on an end token
        other than ``<|im_end|>`` (Qwen2.5-Instruct's generation config also stops on ``<|endoftext|>``, which its
        tokenizer does not call its EOS), and the tokens alone cannot tell that from a reply cut off on the same
        token. With "stop" the reply ended, and its last token, when it is a special one, is left out of the
        message (a text stop sequence is kept); with "length" it was cut off.

        Without ``stop_reason``, a last token that is the tokenizer's own end of sequence ends the reply
        (``eos_ids``: a base Qwen2.5's ``<|endoftext|>``), and is left out of the message."""
        if stop_reason not in (None, "stop", "length"):
            raise ValueError(f"stop_reason must be 'stop', 'length' or None, got {stop_reason!r}")
        tokens = list(tokens)
        if tokens and max(tokens) >= self._num_ids:
            warn_at_caller(  # one text per tokenizer, so Python's filter shows it once, not on every reply
                f"a reply holds ids past the tokenizer's {self._num_ids} tokens; they decode to nothing. "
                "A real checkpoint's embedding has spare rows past its tokenizer (Qwen2.5: 151936 "
                "for 151665 tokens), and a model that puts probability on them can draw them: common early in "
                "training from random weights, rare from a trained checkpoint.",
            )
        ok = self.im_end in tokens
        if ok:
            tokens = tokens[: tokens.index(self.im_end)]
        elif stop_reason == "stop":
            ok = True
            if tokens and tokens[-1] in self._special_ids:
                tokens = tokens[:-1]
        elif stop_reason is None and tokens and tokens[-1] in self.eos_ids:
            tokens, ok = tokens[:-1], True
        return {"role": "assistant", "content": self.tokenizer.decode(tokens)}, ok

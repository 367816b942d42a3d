"""A character-level tokenizer with a ChatML chat template (Chapter 6).

One character is one token, so a learner can read every action the policy
takes. It is built with the `tokenizers` library and wrapped as a transformers
``PreTrainedTokenizerFast``, so ``save_pretrained`` / ``AutoTokenizer.from_pretrained``
work exactly as they do for Qwen or Llama tokenizers.

Special tokens follow ChatML, the format Qwen2.5 uses:
``<|im_start|>role\\ncontent<|im_end|>\\n``.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
EOS = "<|endoftext|>"
UNK = "<|unk|>"
SPECIAL_TOKENS = (PAD, EOS, UNK, IM_START, IM_END)

#: Printable ASCII (letters, digits, punctuation, space) plus newline.
DEFAULT_ALPHABET = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", "")

#: ChatML without a default system message. Jinja, rendered by transformers.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level ``PreTrainedTokenizerFast`` with ChatML special tokens.

    Ids 0..4 are the special tokens (``<|pad|>``, ``<|endoftext|>``, ``<|unk|>``,
    ``<|im_start|>``, ``<|im_end|>``); then one id per character of ``alphabet``,
    in order. Characters outside the alphabet encode to ``<|unk|>``.
    """
    chars = list(dict.fromkeys(alphabet))  # de-duplicate, keep order
    if not chars:
        raise ValueError("alphabet is empty; pass the characters the tokenizer should know")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every single character (newline included) is its own pre-token.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # join tokens with no separator
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=IM_END,  # a chat turn ends with <|im_end|>, as in Qwen2.5-Instruct
        unk_token=UNK,
        bos_token=None,
        additional_special_tokens=[IM_START, EOS],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok

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

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
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


#: Qwen2's pre-tokenizer split: a run of letters, one digit, punctuation, whitespace (as its tokenizer.json has it)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_bpe_tokenizer(corpus: list[str], vocab_size: int = 400, *, split: str = "gpt2") -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``corpus`` here (no hub), with the ChatML special tokens: the kind
    of tokenizer Qwen and Llama use, small enough to train in a second. Unlike the character tokenizer, it can
    spell one text several ways (``"ab"`` as one merged token or as ``"a"``, ``"b"``), which is what breaks the
    prefix property of Chapter 9.

    ``split`` is how text is cut into words before the merges: ``"gpt2"`` (GPT-2's rule: a run of digits stays
    one word, so ``"12"`` can merge) or ``"qwen2"`` (Qwen2's: every digit a token of its own). A model of
    ``arch='qwen2'`` needs ``"qwen2"``: transformers reads the tokenizer saved beside it as Qwen2's tokenizer
    class, which cuts text Qwen2's way whatever the file says, and ``load_policy`` refuses the other."""
    if not corpus or not all(isinstance(t, str) for t in corpus):
        raise ValueError("corpus must be a non-empty list of strings to learn the merges from")
    if split not in ("gpt2", "qwen2"):
        raise ValueError(f"split must be 'gpt2' or 'qwen2', got {split!r}")
    core = Tokenizer(models.BPE())
    if split == "gpt2":
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        core.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    core.decoder = decoders.ByteLevel()
    specials = [EOS, IM_START, IM_END]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    core.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token=EOS, additional_special_tokens=[IM_START]
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok

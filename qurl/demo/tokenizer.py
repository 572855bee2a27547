"""Byte-level BPE tokenizer for the demo, built exactly like Qwen2's so every loader agrees.

transformers rebuilds a qwen2-typed tokenizer from its vocab and merges with Qwen2's normalizer,
pre-tokenizer and decoder; a tokenizer trained with those same components round-trips unchanged
through ``AutoTokenizer`` (and SGLang), keeping spaces and newlines, with one token per digit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_SPECIAL_SPLIT = re.compile("|".join(map(re.escape, SPECIAL_TOKENS)))
# Words the data pipeline and users put around problems, so they do not spell out byte by byte.
EXTRA_TEXT = [
    "system",
    "user",
    "assistant",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    'Let\'s think step by step and output the final answer after "####".',
    "The answer is",
]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 384) -> Tokenizer:
    """Train a Qwen2-style byte-level BPE on texts (chat-formatted examples; specials allowed)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer does not isolate special tokens, so it must never see them.
    pieces = [p for t in texts for p in _SPECIAL_SPLIT.split(t) if p]
    tok.train_from_iterator(pieces + EXTRA_TEXT * 4, trainer=trainer)
    return tok


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer: Qwen chat template, <|im_end|> ends a turn, <|endoftext|> pads."""
    from transformers import PreTrainedTokenizerFast  # heavy; callers that only read names skip it

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def save_tokenizer(tok: Tokenizer, folder: str | Path) -> PreTrainedTokenizerFast:
    """Write tokenizer files (with the chat template) that AutoTokenizer.from_pretrained loads."""
    hf = wrap(tok)
    hf.save_pretrained(str(folder))
    return hf

"""A tiny Whisper tokenizer for speech-model tests and benchmarks: no download, real `WhisperTokenizerFast` behaviour.

`tiny_whisper_tokenizer(special_tokens, added_tokens)` trains a byte-level BPE of a few hundred tokens on one
sentence (with `tokenizers`, as Whisper's own vocabulary is byte-level BPE), then adds `special_tokens` (the first is
end-of-text, also BOS, UNK and PAD, as in Whisper's) and `added_tokens` as plain tokens (Whisper's timestamp tokens
are such: decoding keeps them unless asked not to). With `WhisperFeatureExtractor` it makes the real
`WhisperProcessor` of a tiny random checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from transformers import WhisperTokenizerFast

__all__ = ["tiny_whisper_tokenizer"]


def tiny_whisper_tokenizer(special_tokens: Sequence[str], added_tokens: Sequence[str] = ()) -> WhisperTokenizerFast:
    """A byte-level BPE of a few hundred tokens, then `special_tokens` (end-of-text first), then `added_tokens`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import WhisperTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4, trainer)
    eot = special_tokens[0]
    tokenizer = WhisperTokenizerFast(tokenizer_object=bpe, unk_token=eot, bos_token=eot, eos_token=eot, pad_token=eot)
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens[1:])})
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))
    return tokenizer

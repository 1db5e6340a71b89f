"""LLM.transcribe against transformers' Whisper generation, on a tiny random Whisper whose generation_config holds
Whisper's rules (suppress_tokens, begin_suppress_tokens, timestamps) and whose tokenizer has the timestamp tokens.

Each window's tokens must equal `WhisperForConditionalGeneration.generate` (float32, greedy, one pass per window)
with the folder's own generation_config, with and without timestamps, on a clip longer than one window; segments must
be the ones transformers' `return_segments` cuts from those tokens (plus the text a window cut off).
"""

from __future__ import annotations

import numpy as np
import pytest

from llmplug import LLM, SamplingParams
from llmplug.core.errors import InvalidRequestError
from tests.audio.conftest import noise, tone
from tests.audio.whisper_fixtures import (
    RATE,
    SUPPRESSED,
    reference,
    reference_text,
)

CLIP = np.concatenate([tone(30.0, RATE, hz=330.0), noise(12.0, RATE, seed=1)])  # 42 s: two windows
SHORT = tone(3.0, RATE)


@pytest.fixture(scope="module")
def llm(timed_whisper) -> LLM:
    return LLM(str(timed_whisper.path), dtype="float32", block_size=4, device={"num_threads": 1},
               num_gpu_blocks_override=2048)


def test_suppress_rules_keep_the_tokens_of_transformers_generate(timed_whisper, llm) -> None:
    tokenizer = timed_whisper.processor.tokenizer
    suppressed = set(tokenizer.convert_tokens_to_ids(SUPPRESSED))
    result = llm.transcribe(SHORT)
    tokens = list(result.outputs[0].outputs[0].token_ids)
    assert tokens == timed_whisper.generate(SHORT, timestamps=False)
    assert not suppressed & set(tokens)
    # the rules matter: the same prompt without them samples suppressed tokens
    plain = llm.generate({"prompt": "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>",
                          "multi_modal_data": {"audio": (SHORT, RATE)}},
                         SamplingParams(temperature=0.0, max_tokens=60))
    assert suppressed & set(plain[0].outputs[0].token_ids)
    assert result.text == reference_text(timed_whisper, SHORT)


def test_timestamp_tokens_equal_transformers_per_window_of_a_long_clip(timed_whisper, llm) -> None:
    result = llm.transcribe(CLIP, timestamps=True)
    tokens, expected = reference(timed_whisper, CLIP)
    assert [list(o.outputs[0].token_ids) for o in result.outputs] == tokens and len(tokens) == 2
    assert len(expected) > 3 and any(start >= 30.0 for start, _, _ in expected)  # segments in both windows
    assert [(s.start, s.end, s.text) for s in result.segments] == [
        (pytest.approx(a, abs=1e-3), pytest.approx(b, abs=1e-3), text) for a, b, text in expected]
    assert [s.id for s in result.segments] == list(range(len(expected)))
    assert all(s.avg_logprob is not None and s.avg_logprob <= 0 for s in result.segments)
    silence = [timed_whisper.no_speech_prob(CLIP[:30 * RATE]), timed_whisper.no_speech_prob(CLIP[30 * RATE:])]
    assert [s.no_speech_prob for s in result.segments] == [
        pytest.approx(silence[s.seek // 3000], rel=1e-4) for s in result.segments]
    texts = ["".join(s.text for s in result.segments if s.seek == seek).strip() for seek in (0, 3000)]
    assert result.text == " ".join(t for t in texts if t)


def test_text_without_timestamps_of_a_long_clip_a_prompt_and_a_translation_equal_transformers(timed_whisper, llm) -> None:
    assert llm.transcribe(CLIP).text == reference_text(timed_whisper, CLIP)
    prompt = "the quick brown fox"
    result = llm.transcribe(SHORT, prompt=prompt)
    assert list(result.outputs[0].outputs[0].token_ids) == timed_whisper.generate(SHORT, timestamps=False, prompt=prompt)
    translated = llm.transcribe(SHORT, task="translate")
    assert list(translated.outputs[0].outputs[0].token_ids) == timed_whisper.generate(SHORT, timestamps=False, task="translate")


@pytest.mark.parametrize("kwargs, named", [
    ({"language": "xx"}, "language"),
    ({"task": "summarize"}, "task"),
    ({"temperature": 3.0}, "temperature"),
    ({"audio": b"not audio"}, "audio"),
])
def test_bad_options_are_refused_by_name_and_the_next_transcription_works(timed_whisper, llm, kwargs, named) -> None:
    audio = kwargs.pop("audio", SHORT)
    with pytest.raises(InvalidRequestError) as refused:
        llm.transcribe(audio, **kwargs)
    assert refused.value.param == named
    assert llm.transcribe(SHORT).text == reference_text(timed_whisper, SHORT)


def test_a_model_that_is_not_whisper_is_refused_by_name(tmp_path) -> None:
    from transformers import LlamaConfig

    from llmplug.testing.tiny import save_tiny_checkpoint, tiny_config

    config = tiny_config(LlamaConfig, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=128, max_position_embeddings=64)
    path = save_tiny_checkpoint(config, tmp_path / "llama").path
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32")
    with pytest.raises(InvalidRequestError, match="needs a speech model .Whisper.*not an encoder-decoder model"):
        llm.transcribe(SHORT)

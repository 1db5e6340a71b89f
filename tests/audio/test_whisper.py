"""Whisper through the whole engine against transformers, on a tiny random checkpoint with the real WhisperProcessor.

The checkpoint (d_model 64, 2 encoder + 2 decoder layers) and its processor (a byte-level BPE tokenizer with
Whisper's special tokens, transformers' WhisperFeatureExtractor) are written by transformers; clips are tones and
noise of different lengths. Greedy tokens must equal transformers' `generate` (float32) on the same processor output:
one by one, as one batch of 16 clips, under preemption, with a KV cache that holds the cross blocks of only a few
requests, and through the prefix cache with the same and another clip.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import WhisperForConditionalGeneration, WhisperProcessor

from llmplug import LLM, AsyncLLM, SamplingParams
from llmplug.core.errors import InvalidRequestError
from tests.audio.conftest import WHISPER_PROMPT as DECODER_PROMPT
from tests.audio.conftest import WHISPER_RATE as RATE
from tests.audio.conftest import encode, noise, tone, whisper_reference

# Whisper's prompt conditioning (previous text): several full blocks, so a second request can hit the prefix cache
LONG_PROMPT = "<|startofprev|> the quick brown fox jumps over the lazy dog" + DECODER_PROMPT
MAX_TOKENS = 6
ENGINE = dict(dtype="float32", block_size=4, device={"num_threads": 1})
CROSS_BLOCKS = 1500 // 4  # each request's cross blocks: its encoder's 1500 states, in blocks of 4


@pytest.fixture(scope="module")
def whisper(tiny_whisper) -> tuple[Path, WhisperForConditionalGeneration, WhisperProcessor]:
    """(folder, transformers' model, processor) of the tiny random Whisper of tests/audio/conftest.py."""
    return tiny_whisper


def _clips() -> list[np.ndarray]:
    """16 clips of 0.5 to 28 s: tones of several pitches and noise of several seeds."""
    lengths = np.linspace(0.5, 28.0, 16)
    return [tone(s, RATE, hz=220.0 * (1 + i % 5)) if i % 2 else noise(s, RATE, seed=i) for i, s in enumerate(lengths)]


def _reference(model: WhisperForConditionalGeneration, processor: WhisperProcessor, clip: np.ndarray,
               text: str = DECODER_PROMPT, max_new_tokens: int = MAX_TOKENS) -> list[int]:
    return whisper_reference(model, processor, clip, max_new_tokens, text)


@pytest.fixture(scope="module")
def references(whisper) -> list[list[int]]:
    _, model, processor = whisper
    return [_reference(model, processor, clip) for clip in _clips()]


@pytest.fixture(scope="module")
def llm(whisper) -> LLM:
    return LLM(str(whisper[0]), num_gpu_blocks_override=16 * (CROSS_BLOCKS + 8), **ENGINE)  # 16 requests at once


def _prompt(clip: np.ndarray) -> dict:
    return {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (clip, RATE)}},
            "decoder_prompt": DECODER_PROMPT}


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def test_batch_of_16_clips_equals_transformers_one_by_one(llm, references) -> None:
    outputs = llm.generate([_prompt(clip) for clip in _clips()], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == references
    assert len({tuple(r) for r in references}) > 4  # the audio decides the tokens


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _encoder_calls(llm: LLM) -> int:
    return _runner(llm).encoder_cache.num_encoder_calls


def test_shorthand_prompt_and_prefix_cache_hit_keep_the_tokens(whisper, llm) -> None:
    _, model, processor = whisper
    clips = [noise(2.0, RATE, seed=99), tone(3.0, RATE, hz=990.0)]  # clips no other test sends
    expected = [_reference(model, processor, clip, LONG_PROMPT) for clip in clips]
    assert expected[0] != expected[1]
    # the same clip again: its decoder blocks and its cross blocks (no encoder run) hit the prefix cache; another
    # clip: neither may
    for clip, tokens, hit in ((clips[0], expected[0], False), (clips[0], expected[0], True),
                              (clips[1], expected[1], False)):
        calls = _encoder_calls(llm)
        out = llm.generate({"prompt": LONG_PROMPT, "multi_modal_data": {"audio": (clip, RATE)}}, GREEDY)
        assert list(out[0].outputs[0].token_ids) == tokens
        assert (out[0].num_cached_tokens > 0) == hit
        assert _encoder_calls(llm) == calls + (not hit)


def test_chunked_prefill_and_preemption_keep_the_tokens(whisper, references) -> None:
    clips = _clips()[:8]
    # a request of 4 + 6 tokens needs 3 blocks of 4 beside its cross blocks: the cross blocks of two and 4 more force
    # preemption; steps of 6 tokens split prompts
    small = LLM(str(whisper[0]), num_gpu_blocks_override=2 * CROSS_BLOCKS + 4, max_num_batched_tokens=6, **ENGINE)
    outputs = small.generate([_prompt(clip) for clip in clips], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == references[:8]
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_a_clip_whose_encoder_fails_ends_only_its_own_request(llm, references) -> None:
    from llmplug.engine.multimodal import MultiModalFeature

    good = llm.llm_engine.processor.process_multimodal(_prompt(_clips()[0]))  # processed as AsyncLLM sends it
    frames = {"input_features": torch.zeros(1, 7, 3000)}  # 7 mel bins: the encoder's first convolution refuses them
    bad = {**good, "encoder_feature": MultiModalFeature("audio", "seven-mel-bins", frames, 0, 1500)}
    failed, answered = llm.generate([bad, good], GREEDY)
    assert failed.outputs[0].finish_reason == "abort" and "encoding its audio failed" in failed.outputs[0].error
    assert list(answered.outputs[0].token_ids) == references[0] and answered.outputs[0].error is None


def _cross_bytes(whisper) -> int:
    """What transformers keeps for one request's cross-attention: its K/V cache's bytes (float32)."""
    _, model, processor = whisper
    features = processor.feature_extractor(_clips()[0], sampling_rate=RATE, return_tensors="pt").input_features
    with torch.no_grad():
        cache = model(input_features=features, decoder_input_ids=torch.tensor([[1]]), use_cache=True).past_key_values
    return sum(layer.keys.numel() + layer.values.numel() for layer in cache.cross_attention_cache.layers) * 4


def _record_running(llm: LLM) -> list[int]:
    """The number of running requests after each schedule() of the engine, recorded from now on."""
    scheduler, counts = llm.llm_engine.engine_core.scheduler, []
    schedule = scheduler.schedule

    def recorded():
        output = schedule()
        counts.append(len(scheduler.running))
        return output

    scheduler.schedule = recorded
    return counts


def test_a_kv_cache_for_the_cross_blocks_of_three_requests_serves_16_clips_three_at_a_time(whisper,
                                                                                           references) -> None:
    block_bytes = 2 * 2 * 4 * 64 * 4  # decoder layers, K and V, block_size tokens, d_model, float32
    assert _cross_bytes(whisper) == CROSS_BLOCKS * block_bytes  # a request's cross blocks hold transformers' cache
    # room for the cross blocks of 3 requests and 30 decoder blocks; max_num_seqs is not what limits it
    llm = LLM(str(whisper[0]), kv_cache_memory=3 * _cross_bytes(whisper) + 30 * block_bytes, max_num_seqs=16,
              **ENGINE)
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_blocks == 3 * CROSS_BLOCKS + 30 and kv.num_free_blocks == kv.num_blocks
    running = _record_running(llm)
    outputs = llm.generate([_prompt(clip) for clip in _clips()], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == references
    assert max(running) == 3  # admitted as the cross blocks of finished requests come free
    assert kv.num_free_blocks == kv.num_blocks and not kv.cross_block_tables and not kv.block_tables


def test_preemption_frees_both_block_lists_and_the_resumed_request_encodes_again(whisper, references) -> None:
    # without prefix caching a preempted request's cross blocks are plain free blocks: its encoder runs again
    small = LLM(str(whisper[0]), num_gpu_blocks_override=2 * CROSS_BLOCKS + 4, max_num_batched_tokens=6,
                enable_prefix_caching=False, **ENGINE)
    scheduler, kv = small.llm_engine.engine_core.scheduler, small.llm_engine.engine_core.kv_cache_manager
    preempt, freed = scheduler._preempt, []

    def checked(request):
        held = len(kv.get_block_ids(request)) + len(kv.get_cross_blocks(request)[0])
        free = kv.num_free_blocks
        preempt(request)
        assert request.request_id not in kv.block_tables and request.request_id not in kv.cross_block_tables
        freed.append((held, kv.num_free_blocks - free))

    scheduler._preempt = checked
    outputs = small.generate([_prompt(clip) for clip in _clips()[:6]], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outputs] == references[:6]
    assert freed and all(held == gained and held > CROSS_BLOCKS for held, gained in freed)
    assert _encoder_calls(small) == 6 + len(freed)  # once per admission: every resumed request encodes again
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("prompt, named", [
    ({"prompt": DECODER_PROMPT}, "needs audio|transcribes audio"),
    ({"prompt": DECODER_PROMPT, "multi_modal_data": {"audio": (tone(1.0, RATE), "16000")}}, "positive integer rate"),
    ({"prompt": DECODER_PROMPT, "multi_modal_data": {"audio": (tone(31.0, RATE), RATE)}}, "31.0 s long"),
    ({"prompt": DECODER_PROMPT, "multi_modal_data": {"image": tone(1.0, RATE)}}, "needs audio"),
    ({"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (tone(1.0, RATE), RATE)}},
      "decoder_prompt": {"prompt_token_ids": [1, "x"]}}, "prompt_token_ids must be a list of integers"),
], ids=["no-audio", "rate-not-int", "longer-than-window", "image", "bad-decoder-ids"])
def test_bad_input_is_refused_by_name_and_the_next_request_works(llm, references, prompt, named) -> None:
    with pytest.raises(InvalidRequestError, match=named):
        llm.generate(prompt, GREEDY)
    out = llm.generate(_prompt(_clips()[0]), GREEDY)
    assert list(out[0].outputs[0].token_ids) == references[0]


def _server_reference(model, processor, samples: np.ndarray, text: str = DECODER_PROMPT) -> list[str]:
    """transformers' text of each 30 s window of `samples`, generated as far as the server does (EOS or the
    decoder's context)."""
    windows = [samples[i : i + 30 * RATE] for i in range(0, len(samples), 30 * RATE)]
    room = model.config.max_target_positions - len(processor.tokenizer(text, add_special_tokens=False).input_ids)
    return [processor.tokenizer.decode(_reference(model, processor, w, text, room), skip_special_tokens=True).strip()
            for w in windows]


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the openai client's audio.translations
def test_transcriptions_endpoint_over_the_openai_client_equals_transformers_per_window(whisper) -> None:
    import openai
    import soundfile as sf

    from tests.entrypoints.openai.conftest import serve

    path, model, processor = whisper
    clip = np.concatenate([tone(30.0, RATE, hz=330.0), noise(30.0, RATE, seed=7), tone(15.0, RATE, hz=550.0)])
    data = encode(clip, RATE, "WAV", "PCM_16")  # 75 s: three windows
    decoded = sf.read(io.BytesIO(data), dtype="float32")[0]  # the samples the server decodes
    windows = _server_reference(model, processor, decoded)
    assert len(set(windows)) > 1
    short = encode(_clips()[5], RATE, "WAV", "PCM_16")
    short_decoded = sf.read(io.BytesIO(short), dtype="float32")[0]
    conditioned = _server_reference(model, processor, short_decoded, LONG_PROMPT)
    translated = _server_reference(model, processor, short_decoded, DECODER_PROMPT.replace("transcribe", "translate"))
    engine = AsyncLLM(str(path), num_gpu_blocks_override=8 * (CROSS_BLOCKS + 8), **ENGINE)
    try:
        with serve(engine) as server:
            client = server.client()
            create = lambda fmt, file=data, language="en", **kw: client.audio.transcriptions.create(  # noqa: E731
                model=server.model, file=("clip.wav", file, "audio/wav"), response_format=fmt, temperature=0.0,
                language=language, **kw)
            assert create("json").text == " ".join(windows)
            assert create("text").strip() == " ".join(windows)
            srt = create("srt")
            assert "1\n00:00:00,000 --> 00:00:30,000\n" in srt and "3\n00:01:00,000 --> 00:01:15,000\n" in srt
            assert [line for line in srt.splitlines()[2::4]] == windows
            vtt = create("vtt")
            assert vtt.startswith("WEBVTT") and "00:00:30.000 --> 00:01:00.000\n" + windows[1] in vtt
            verbose = create("verbose_json")
            assert [(s.start, s.end, s.text) for s in verbose.segments] == [
                (0.0, 30.0, windows[0]), (30.0, 60.0, windows[1]), (60.0, 75.0, windows[2])]
            assert create("json", file=short, prompt="the quick brown fox jumps over the lazy dog").text == \
                conditioned[0]
            translation = client.audio.translations.create(model=server.model, file=("clip.wav", short, "audio/wav"),
                                                           response_format="json", temperature=0.0)
            assert translation.text == translated[0] != conditioned[0]
            with pytest.raises(openai.BadRequestError) as refused:
                create("json", file=b"not audio at all")
            assert refused.value.body["param"] == "file" and "not audio" in refused.value.body["message"]
            with pytest.raises(openai.BadRequestError) as refused:
                create("json", language="xx")
            assert refused.value.body["param"] == "language"
            assert create("json").text == " ".join(windows)  # the next request is served
    finally:
        engine.shutdown()


def _cross_heads(worker) -> tuple[int, int]:
    """A worker's heads of the first decoder layer's cross-attention, and of the cache tensor its blocks are in."""
    from llmplug.layers.attention.cross_attention import paged_view

    layer = worker.model_runner.model.model.decoder.layers[0]
    return layer.encoder_attn.num_heads, paged_view(layer.self_attn.attn).shape[1]


@pytest.mark.slow
def test_tensor_parallel_2_keeps_the_tokens_with_each_rank_caching_its_heads(whisper, references) -> None:
    """Two worker processes, each with half of the encoder's and the decoder's heads: each writes and reads its heads'
    cross-attention keys and values in its own cache; steps of 6 tokens and preemption as above."""
    llm = LLM(str(whisper[0]), tensor_parallel_size=2, num_gpu_blocks_override=2 * CROSS_BLOCKS + 4,
              max_num_batched_tokens=6, **ENGINE)
    try:
        outputs = llm.generate([_prompt(clip) for clip in _clips()[:6]], GREEDY)
        heads = llm.llm_engine.engine_core.executor.collective_rpc(_cross_heads)
        preemptions = llm.llm_engine.engine_core.scheduler.num_preemptions
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outputs] == references[:6]
    assert heads == [(2, 2), (2, 2)] and preemptions > 0  # 4 heads halved

"""Audio-language families against transformers on tiny random checkpoints saved with their real processors
(WhisperFeatureExtractor over 2 s windows of 16 mel bins): greedy tokens equal and log-probabilities within 1e-4
(float32) for one and two clips per prompt and a clip of several windows, under chunked prefill, with the encoder
cache and prefix caching; `input_audio` chat parts through the real `openai` client against the server equal the
offline chat; bad audio is refused by name and the next request is served."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.errors import InvalidRequestError
from tests.audio.conftest import encode, noise, tone
from tests.models.tiny_models import train_llama_tokenizer

MAX_TOKENS = 6
RATE = 16000
WINDOW_SECONDS = 2  # the feature extractor's chunk_length: 200 frames, 100 encoder states, 50 tokens


@dataclass
class TinyAudioLM:
    path: Path
    processor: object
    hf_model: torch.nn.Module
    placeholder: str  # what a text prompt holds once per clip

    def prompt(self, num_clips: int) -> str:
        clips = " and ".join([self.placeholder] * num_clips)
        return f"User: {clips} what is it?\nAssistant:"


def _tokenizer(path: Path, special: list[str]):
    from transformers import LlamaTokenizer

    train_llama_tokenizer(path / "tokenizer").save_pretrained(path / "tokenizer")
    tokenizer = LlamaTokenizer.from_pretrained(path / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.pad_token = tokenizer.eos_token  # AudioFlamingo3's processor pads its text
    return tokenizer


def _feature_extractor():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=16, sampling_rate=RATE, hop_length=160, chunk_length=WINDOW_SECONDS,
                                   n_fft=400)


ENCODER = dict(num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
               max_source_positions=50 * WINDOW_SECONDS)
DECODER = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512)


def _louder_audio(model: torch.nn.Module) -> None:
    """transformers' init leaves the tiny projector's rows small: make the clips matter to the answer."""
    with torch.no_grad():
        for name, param in model.model.multi_modal_projector.named_parameters():
            if name.endswith("weight"):
                param.normal_(0, 0.5)


def save_qwen2_audio(path: Path) -> TinyAudioLM:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor

    tokenizer = _tokenizer(path, ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"])
    config = Qwen2AudioConfig(audio_config=ENCODER, text_config={**DECODER, "vocab_size": len(tokenizer)},
                              audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    _louder_audio(model)
    model.save_pretrained(path)
    processor = Qwen2AudioProcessor(feature_extractor=_feature_extractor(), tokenizer=tokenizer)
    processor.save_pretrained(path)
    return TinyAudioLM(path, processor, model, "<|audio_bos|><|AUDIO|><|audio_eos|>")


def save_audio_flamingo3(path: Path) -> TinyAudioLM:
    from transformers import AudioFlamingo3Config, AudioFlamingo3ForConditionalGeneration, AudioFlamingo3Processor

    tokenizer = _tokenizer(path, ["<sound>"])
    encoder = dict(num_mel_bins=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   max_source_positions=ENCODER["max_source_positions"])
    config = AudioFlamingo3Config(audio_config=encoder, text_config={**DECODER, "vocab_size": len(tokenizer)},
                                  audio_token_id=tokenizer.convert_tokens_to_ids("<sound>"))
    torch.manual_seed(0)
    model = AudioFlamingo3ForConditionalGeneration(config).eval()
    _louder_audio(model)
    model.save_pretrained(path)
    processor = AudioFlamingo3Processor(feature_extractor=_feature_extractor(), tokenizer=tokenizer, max_audio_len=8)
    processor.save_pretrained(path)
    return TinyAudioLM(path, processor, model, "<sound>")


@pytest.fixture(scope="module")
def qwen2_audio(tmp_path_factory) -> TinyAudioLM:
    return save_qwen2_audio(tmp_path_factory.mktemp("tiny_qwen2_audio"))


@pytest.fixture(scope="module")
def audio_flamingo3(tmp_path_factory) -> TinyAudioLM:
    return save_audio_flamingo3(tmp_path_factory.mktemp("tiny_audio_flamingo3"))


CLIPS = {
    "tone": tone(1.0, RATE, hz=440),
    "noise": noise(0.5, RATE),
    "long": tone(3.0, RATE, hz=300) + noise(3.0, RATE, seed=1, amplitude=0.1),  # two windows
    "too long": tone(9.0, RATE, hz=200),  # five windows, AudioFlamingo3's processor keeps max_audio_len's four
}


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def make_llm(tiny: TinyAudioLM, **kwargs) -> LLM:
    return LLM(str(tiny.path), **{"dtype": "float32", "block_size": 4, "num_gpu_blocks_override": 128,
                                  "limit_mm_per_prompt": {"audio": 2}, "device": {"num_threads": 1}, **kwargs})


def assert_matches_hf(tiny: TinyAudioLM, output, text: str, clips: list[np.ndarray]) -> None:
    """transformers' greedy tokens from the same processor output, and its log-probabilities of ours."""
    inputs = tiny.processor(text=[text], audio=clips, sampling_rate=RATE, return_tensors="pt")
    with torch.inference_mode():
        full = tiny.hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0]
        audio = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        logits = tiny.hf_model(input_ids=full[None, :-1], **audio).logits[0]
    log_probs = torch.log_softmax(logits.float(), -1)
    completion = output.outputs[0]
    prompt_len = inputs["input_ids"].shape[1]
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()  # the processor's expansion
    assert list(completion.token_ids) == full[prompt_len:].tolist()
    for t, position in enumerate(completion.logprobs):
        for token, logprob in position.items():
            assert logprob.logprob == pytest.approx(float(log_probs[prompt_len - 1 + t, token]), abs=1e-4)


FAMILY_CASES = {
    "qwen2_audio": [["tone"], ["noise"], ["tone", "noise"]],
    "audio_flamingo3": [["tone"], ["noise"], ["long"], ["too long"]],  # its processor takes one clip per text
}


def check_family(tiny: TinyAudioLM, family: str, **engine) -> LLM:
    """FAMILY_CASES[family] in one batch through the engine (make_llm's settings and `engine`), each against
    transformers; the first two clips must answer differently. Returns the engine, still running."""
    cases = FAMILY_CASES[family]
    llm = make_llm(tiny, **engine)
    prompts = [{"prompt": tiny.prompt(len(names)), "multi_modal_data": {"audio": [(CLIPS[n], RATE) for n in names]}}
               for names in cases]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    for names, output in zip(cases, outputs):
        assert_matches_hf(tiny, output, tiny.prompt(len(names)), [CLIPS[n] for n in names])
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # the clip matters
    return llm


@pytest.mark.parametrize("family", ["qwen2_audio", "audio_flamingo3"])
def test_greedy_tokens_and_logprobs_match_transformers(family, request):
    check_family(request.getfixturevalue(family), family).shutdown()


def audio_shard_shapes(worker) -> dict[str, tuple[int, ...]]:
    """A worker's shapes of the encoder's first fused q/k/v, MLP and convolution weights and the projector's."""
    model = worker.model_runner.model
    layer = model.audio_tower.layers[0]
    tensors = {"qkv": layer.self_attn.qkv_proj.weight, "mlp_up": layer.mlp.up_proj.weight,
               "conv1": model.audio_tower.conv1.weight}
    tensors.update({name: p for name, p in model.multi_modal_projector.named_parameters() if name.endswith("weight")})
    return {name: tuple(tensor.shape) for name, tensor in tensors.items()}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_audio", "audio_flamingo3"])
def test_tensor_parallel_2_matches_transformers(family, request):
    """Two worker processes, each with half of the encoder's heads and MLP (its convolutions and positions
    replicated), half of the decoder's, and the projector sharded (AudioFlamingo3) or replicated (Qwen2-Audio);
    steps of 8 tokens split each clip's placeholders."""
    llm = check_family(request.getfixturevalue(family), family, tensor_parallel_size=2, max_num_batched_tokens=8)
    shapes = llm.llm_engine.engine_core.executor.collective_rpc(audio_shard_shapes)
    llm.shutdown()
    width, ffn = ENCODER["d_model"], ENCODER["encoder_ffn_dim"]
    assert shapes[0] == shapes[1]
    assert shapes[0]["qkv"] == (3 * width // 2, width) and shapes[0]["mlp_up"] == (ffn // 2, width)
    assert shapes[0]["conv1"] == (width, ENCODER["num_mel_bins"], 3)  # replicated
    projector = {"qwen2_audio": {"linear.weight": (DECODER["hidden_size"], width)},
                 "audio_flamingo3": {"linear_1.weight": (DECODER["hidden_size"] // 2, width),
                                     "linear_2.weight": (DECODER["hidden_size"], DECODER["hidden_size"] // 2)}}
    assert {k: v for k, v in shapes[0].items() if k.startswith("linear")} == projector[family]


def test_chunked_prefill_encodes_each_clip_once_and_caches_it_and_its_prefix(qwen2_audio):
    llm = make_llm(qwen2_audio, max_num_batched_tokens=8)  # a 1 s clip's 25 placeholders take four chunks
    cache = llm.llm_engine.engine_core.executor.worker.model_runner.encoder_cache
    text, resampled = qwen2_audio.prompt(1), (tone(1.0, 8000, hz=440), 8000)  # an 8 kHz clip, resampled
    first = llm.generate({"prompt": text, "multi_modal_data": {"audio": resampled}}, greedy(), use_tqdm=False)[0]
    assert cache.num_encoder_calls == 1
    again = llm.generate({"prompt": text, "multi_modal_data": {"audio": resampled}}, greedy(), use_tqdm=False)[0]
    other = llm.generate({"prompt": text, "multi_modal_data": {"audio": CLIPS["tone"]}}, greedy(), use_tqdm=False)[0]
    clip_start = first.prompt_token_ids.index(qwen2_audio.hf_model.config.audio_token_id)
    assert again.num_cached_tokens > clip_start + 25  # the blocks holding the clip, named by its content
    assert other.num_cached_tokens <= clip_start  # another clip: only the text before it
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert cache.num_encoder_calls == 2  # the first clip's rows were not needed again, the other's computed
    both = llm.generate({"prompt": qwen2_audio.prompt(2), "multi_modal_data": {"audio": [resampled, CLIPS["tone"]]}},
                        greedy(), use_tqdm=False)[0]
    assert cache.num_encoder_calls == 2  # both clips' rows from the encoder cache
    import soxr  # the reference resamples with the library itself

    at_16k = soxr.resample(resampled[0], 8000, RATE, quality="HQ")
    assert_matches_hf(qwen2_audio, first, text, [at_16k])
    assert_matches_hf(qwen2_audio, other, text, [CLIPS["tone"]])
    assert_matches_hf(qwen2_audio, both, qwen2_audio.prompt(2), [at_16k, CLIPS["tone"]])
    llm.shutdown()


def wav_data(samples: np.ndarray) -> str:
    return base64.b64encode(encode(samples, RATE, "WAV", "PCM_16")).decode()


def audio_chat(data: str, text: str = "What is it?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                                         {"type": "text", "text": text}]}]


def test_input_audio_over_the_openai_client_equals_offline_chat(qwen2_audio):
    import openai

    from llmplug.engine.async_llm import AsyncLLM
    from tests.entrypoints.openai.conftest import serve

    llm = make_llm(qwen2_audio)
    data = wav_data(CLIPS["tone"])
    offline = llm.chat(audio_chat(data), greedy(), use_tqdm=False)[0]
    text = qwen2_audio.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is it?"}]}],
        tokenize=False, add_generation_prompt=True)
    decoded = np.round(CLIPS["tone"] * 32767) / 32768  # the 16-bit WAV's samples, as soundfile reads them
    assert_matches_hf(qwen2_audio, offline, text, [decoded.astype(np.float32)])
    engine = AsyncLLM(str(qwen2_audio.path), dtype="float32", block_size=4, num_gpu_blocks_override=128,
                      limit_mm_per_prompt={"audio": 2}, device={"num_threads": 1})
    try:
        with serve(engine) as server:
            client = server.client()
            answer = client.chat.completions.create(model=server.model, messages=audio_chat(data),
                                                    max_tokens=MAX_TOKENS, temperature=0,
                                                    extra_body={"ignore_eos": True})
            assert answer.choices[0].message.content == offline.outputs[0].text
            assert answer.usage.prompt_tokens == len(offline.prompt_token_ids)  # the clip's placeholders counted
            truncated = base64.b64encode(base64.b64decode(data)[:5000]).decode()
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=server.model, messages=audio_chat(truncated), max_tokens=2)
            error = refused.value.body
            assert "messages[0].content[0]" in error["message"] and "truncated" in error["message"]
            assert error["param"] == "messages[0].content[0]"
            again = client.chat.completions.create(model=server.model, messages=audio_chat(data),
                                                   max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body={"ignore_eos": True})
            assert again.choices[0].message.content == offline.outputs[0].text
    finally:
        engine.shutdown()
        llm.shutdown()


def test_bad_audio_is_refused_by_name_and_the_next_request_works(qwen2_audio):
    llm = make_llm(qwen2_audio)
    one = qwen2_audio.prompt(1)
    clip = CLIPS["tone"]
    with pytest.raises(InvalidRequestError, match="3 audio clips, but at most 2.*limit-mm-per-prompt"):
        llm.generate({"prompt": qwen2_audio.prompt(3), "multi_modal_data": {"audio": [clip] * 3}}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"multi_modal_data\['audio'\]\[0\] is a str"):
        llm.generate({"prompt": one, "multi_modal_data": {"audio": "clip.wav"}}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"this model takes \['audio'\]"):
        llm.generate({"prompt": one, "multi_modal_data": {"image": clip}}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="content\\[0\\].input_audio: the data is not audio"):
        llm.chat(audio_chat(base64.b64encode(b"plain text, not a sound " * 20).decode()), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    output = llm.generate({"prompt": one, "multi_modal_data": {"audio": clip}}, greedy(), use_tqdm=False)[0]
    assert_matches_hf(qwen2_audio, output, one, [clip])
    llm.shutdown()

"""Ultravox against a reference composed of independent parts on the same random weights, since transformers has
no Ultravox: transformers' WhisperEncoder modules run on each window's frames (as Ultravox's modified encoder
does), the stacking projector written out below from the published architecture, and transformers'
LlamaForCausalLM on `inputs_embeds`. The tiny checkpoint is written in Ultravox's own format (config.json,
tensor names, a tokenizer with `<|audio|>`, a WhisperFeatureExtractor's preprocessor_config.json). Greedy tokens
equal and log-probabilities within 1e-4 in float32: one and two clips per prompt, a clip of two windows, a token-id
prompt, chats with input_audio and audio_url parts, chunked prefill with each clip encoded once, tensor parallelism;
bad input and configs the family does not run refused by name, the next request served."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmplug import LLM, SamplingParams
from llmplug.core.errors import InvalidRequestError, ModelLoadError
from tests.audio.conftest import encode, noise, tone
from tests.models.tiny_models import SENTENCEPIECE_TEXT

MAX_TOKENS = 6
RATE = 16000
WINDOW_SECONDS = 2  # the feature extractor's chunk_length: 200 frames, the encoder's 100 positions
PLACEHOLDER = "<|audio|>"
STACK = 8
ENCODER = dict(num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
               max_source_positions=50 * WINDOW_SECONDS)
DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
               initializer_range=0.2)  # a sharper random decoder: the clips change its answers
PROJECTOR_HIDDEN = 48  # linear_1's output; SwiGLU halves it
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CLIPS = {
    "tone": tone(1.0, RATE, hz=440),  # 100 frames: 7 tokens
    "noise": noise(0.5, RATE),  # 50 frames: 4 tokens
    "long": tone(3.0, RATE, hz=300) + noise(3.0, RATE, seed=1, amplitude=0.1),  # windows of 200 and 100 frames
}


@dataclass
class TinyUltravox:
    path: Path
    tokenizer: object
    extractor: object
    encoder: torch.nn.Module  # transformers' WhisperEncoder
    projector: dict[str, torch.Tensor]
    llm: torch.nn.Module  # transformers' LlamaForCausalLM
    audio_token_id: int

    @staticmethod
    def prompt(num_clips: int) -> str:
        return "User: " + " and ".join([PLACEHOLDER] * num_clips) + " what is it?\nAssistant:"


def byte_level_tokenizer():
    """A byte-level BPE tokenizer as Llama 3's (no prefix space, a BOS first), with `<|audio|>` and a chat
    template, trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[bos, eos, PLACEHOLDER], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(SENTENCEPIECE_TEXT.splitlines(), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos,
                                   additional_special_tokens=[PLACEHOLDER])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _projector_weights(encoder_hidden: int, text_hidden: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    dim_in = encoder_hidden * STACK
    return {
        "ln_pre.weight": 0.5 + torch.rand(dim_in, generator=g),
        "linear_1.weight": torch.randn(PROJECTOR_HIDDEN, dim_in, generator=g) * 0.3,
        "ln_mid.weight": 0.5 + torch.rand(PROJECTOR_HIDDEN // 2, generator=g),  # projector_ln_mid: Ultravox 0.5
        "linear_2.weight": torch.randn(text_hidden, PROJECTOR_HIDDEN // 2, generator=g) * 0.5,
    }


def save_tiny_ultravox(path: Path) -> TinyUltravox:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, WhisperConfig, WhisperFeatureExtractor
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    tokenizer = byte_level_tokenizer()
    tokenizer.save_pretrained(path)
    extractor = WhisperFeatureExtractor(feature_size=16, sampling_rate=RATE, hop_length=160,
                                        chunk_length=WINDOW_SECONDS, n_fft=400)
    extractor.save_pretrained(path)
    audio_config = WhisperConfig(**ENCODER, decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64)
    text_config = LlamaConfig(**DECODER, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    encoder = WhisperEncoder(audio_config).eval()
    llm = LlamaForCausalLM(text_config).eval()
    projector = _projector_weights(ENCODER["d_model"], DECODER["hidden_size"])
    tensors = {f"audio_tower.{k}": v for k, v in encoder.state_dict().items()}
    tensors |= {f"multi_modal_projector.{k}": v for k, v in projector.items()}
    tensors |= {f"language_model.{k}": v for k, v in llm.state_dict().items()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    audio_token_id = tokenizer.convert_tokens_to_ids(PLACEHOLDER)
    config = {  # Ultravox's config.json (fixie-ai's UltravoxConfig fields)
        "architectures": ["UltravoxModel"], "model_type": "ultravox", "audio_config": audio_config.to_dict(),
        "text_config": text_config.to_dict(), "audio_token_index": audio_token_id, "hidden_size": PROJECTOR_HIDDEN,
        "stack_factor": STACK, "projector_act": "swiglu", "projector_ln_mid": True, "norm_init": 0.4,
        "ignore_index": -100, "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    return TinyUltravox(path, tokenizer, extractor, encoder, projector, llm, audio_token_id)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyUltravox:
    return save_tiny_ultravox(tmp_path_factory.mktemp("tiny_ultravox"))


# ---- the reference: published steps over transformers' parts -----------------------------------------------


def reference_windows(tiny: TinyUltravox, clip: np.ndarray) -> list[torch.Tensor]:
    """Each 200-frame window's valid log-mel frames [n_mels, frames] of one clip (two hops at least)."""
    clip = np.pad(clip, (0, max(0, 320 - len(clip))))
    out = tiny.extractor(clip, sampling_rate=RATE, padding="longest", pad_to_multiple_of=160, truncation=False,
                         return_attention_mask=True, return_tensors="pt")
    frames = out["input_features"][0][:, : int(out["attention_mask"].sum())]
    return list(frames.split(2 * ENCODER["max_source_positions"], dim=1))


def reference_encoder(tiny: TinyUltravox, frames: torch.Tensor) -> torch.Tensor:
    """Ultravox's modified Whisper encoder on [n_mels, frames]: positions cut to the states, nothing masked."""
    enc = tiny.encoder
    x = F.gelu(enc.conv2(F.gelu(enc.conv1(frames[None])))).transpose(1, 2)
    x = x + enc.embed_positions.weight[: x.shape[1]]
    for layer in enc.layers:
        x = layer(x, attention_mask=None)
    return enc.layer_norm(x)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def plain_projector(w: dict[str, torch.Tensor], states: torch.Tensor) -> torch.Tensor:
    """Stack 8 states a row (zero-padded), RMSNorm, linear_1, SwiGLU (gate second), then RMSNorm before linear_2
    (`ln_mid`, Ultravox 0.5) or after it (`ln_post`, 0.4)."""
    pad = -len(states) % STACK
    x = F.pad(states, (0, 0, 0, pad)).reshape(-1, states.shape[1] * STACK)
    x = rms_norm(x, w["ln_pre.weight"]) @ w["linear_1.weight"].T
    half, gate = x.chunk(2, dim=-1)
    x = F.silu(gate) * half
    if "ln_mid.weight" in w:
        return rms_norm(x, w["ln_mid.weight"]) @ w["linear_2.weight"].T
    return rms_norm(x @ w["linear_2.weight"].T, w["ln_post.weight"])


def reference_projector(tiny: TinyUltravox, states: torch.Tensor) -> torch.Tensor:
    return plain_projector(tiny.projector, states)


def reference_prompt(tiny: TinyUltravox, text: str, clips: list[np.ndarray],
                     bos: bool = True) -> tuple[list[int], torch.Tensor]:
    """(token ids, input embeddings): BOS (a plain prompt's, not a rendered chat's), the text's parts around each
    placeholder tokenized apart, each clip's rows (ceil(frames / 16) per window) in its placeholder's place."""
    parts = text.split(PLACEHOLDER)
    assert len(parts) == len(clips) + 1
    ids: list[int] = [tiny.tokenizer.bos_token_id] if bos else []
    rows = []
    for i, part in enumerate(parts):
        ids += tiny.tokenizer.encode(part, add_special_tokens=False) if part else []
        if i < len(clips):
            clip_rows = torch.cat([reference_projector(tiny, reference_encoder(tiny, w))
                                   for w in reference_windows(tiny, clips[i])])
            assert len(clip_rows) == sum(-(-w.shape[1] // 16) for w in reference_windows(tiny, clips[i]))
            ids += [tiny.audio_token_id] * len(clip_rows)
            rows.append(clip_rows)
    embeds = tiny.llm.get_input_embeddings()(torch.tensor(ids))
    if rows:
        embeds[torch.tensor(ids) == tiny.audio_token_id] = torch.cat(rows)
    return ids, embeds


def reference_greedy(tiny: TinyUltravox, embeds: torch.Tensor) -> list[int]:
    """transformers' LlamaForCausalLM's greedy tokens after the prompt's input embeddings."""
    generated: list[int] = []
    for _ in range(MAX_TOKENS):
        new = tiny.llm.get_input_embeddings()(torch.tensor(generated, dtype=torch.long))
        generated.append(int(tiny.llm(inputs_embeds=torch.cat([embeds, new])[None]).logits[0, -1].argmax()))
    return generated


def assert_matches_reference(tiny: TinyUltravox, output, text: str, clips: list[np.ndarray],
                             bos: bool = True) -> None:
    """The reference's token ids, greedy tokens, and log-probabilities of ours."""
    with torch.inference_mode():
        ids, embeds = reference_prompt(tiny, text, clips, bos)
        generated = reference_greedy(tiny, embeds)
        new = tiny.llm.get_input_embeddings()(torch.tensor(generated[:-1]))
        log_probs = torch.log_softmax(tiny.llm(inputs_embeds=torch.cat([embeds, new])[None]).logits[0].float(), -1)
    completion = output.outputs[0]
    assert output.prompt_token_ids == ids
    assert list(completion.token_ids) == generated
    for t, position in enumerate(completion.logprobs):
        for token, logprob in position.items():
            assert logprob.logprob == pytest.approx(float(log_probs[len(ids) - 1 + t, token]), abs=1e-4)


# ---- the engine -------------------------------------------------------------------------------------------


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def llm(tiny):
    engine = LLM(str(tiny.path), dtype="float32", block_size=4, num_gpu_blocks_override=128,
                 limit_mm_per_prompt={"audio": 2}, device={"num_threads": 1})
    yield engine
    engine.shutdown()


CASES = [["tone"], ["noise"], ["long"], ["tone", "noise"]]


def test_greedy_tokens_and_logprobs_match_the_composed_reference(tiny, llm):
    prompts = [{"prompt": tiny.prompt(len(names)), "multi_modal_data": {"audio": [(CLIPS[n], RATE) for n in names]}}
               for names in CASES]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    for names, output in zip(CASES, outputs):
        assert_matches_reference(tiny, output, tiny.prompt(len(names)), [CLIPS[n] for n in names])
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # the clip matters
    assert outputs[2].prompt_token_ids.count(tiny.audio_token_id) == 13 + 7  # windows of 200 and 100 frames


def encoder_and_projector_shapes(worker) -> tuple[int, tuple[int, ...]]:
    """A worker's rows of the encoder's first fused q/k/v weight, and its projector's linear_1 shape."""
    model = worker.model_runner.model
    return (model.audio_tower.layers[0].self_attn.qkv_proj.weight.shape[0],
            tuple(model.multi_modal_projector.linear_1.weight.shape))


@pytest.mark.slow
def test_tensor_parallel_2_matches_the_composed_reference(tiny):
    """Two worker processes, each with half of the encoder's and the decoder's heads and MLP (the projector
    replicated); steps of 8 tokens split each clip's placeholders."""
    llm = LLM(str(tiny.path), dtype="float32", block_size=4, num_gpu_blocks_override=128, tensor_parallel_size=2,
              limit_mm_per_prompt={"audio": 2}, device={"num_threads": 1}, max_num_batched_tokens=8)
    cases = [["long"], ["tone", "noise"]]
    prompts = [{"prompt": tiny.prompt(len(names)), "multi_modal_data": {"audio": [CLIPS[n] for n in names]}}
               for names in cases]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    shapes = llm.llm_engine.engine_core.executor.collective_rpc(encoder_and_projector_shapes)
    llm.shutdown()
    width = ENCODER["d_model"]
    assert shapes == [(3 * width // 2, (PROJECTOR_HIDDEN, width * STACK))] * 2  # heads halved, projector whole
    for names, output in zip(cases, outputs):
        assert_matches_reference(tiny, output, tiny.prompt(len(names)), [CLIPS[n] for n in names])


def test_a_token_id_prompt_with_one_placeholder_per_clip_equals_the_text_prompt(tiny, llm):
    before, after = tiny.prompt(1).split(PLACEHOLDER)
    encode_part = lambda part: tiny.tokenizer.encode(part, add_special_tokens=False)  # noqa: E731
    ids = [tiny.tokenizer.bos_token_id, *encode_part(before), tiny.audio_token_id, *encode_part(after)]
    output = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"audio": CLIPS["long"]}}, greedy(),
                          use_tqdm=False)[0]
    assert_matches_reference(tiny, output, tiny.prompt(1), [CLIPS["long"]])


@pytest.mark.parametrize("part", ["input_audio", "audio_url"])
def test_chat_with_an_audio_part(tiny, llm, part):
    data = base64.b64encode(encode(CLIPS["tone"], RATE, "WAV", "PCM_16")).decode()
    clip = ({"type": "input_audio", "input_audio": {"data": data, "format": "wav"}} if part == "input_audio" else
            {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{data}"}})
    chat = [{"role": "user", "content": [clip, {"type": "text", "text": "What is it?"}]}]
    output = llm.chat(chat, greedy(), use_tqdm=False)[0]
    text = tiny.tokenizer.apply_chat_template([{"role": "user", "content": f"{PLACEHOLDER}What is it?"}],
                                              tokenize=False, add_generation_prompt=True)
    decoded = (np.round(CLIPS["tone"] * 32767) / 32768).astype(np.float32)  # the 16-bit WAV's samples
    assert_matches_reference(tiny, output, text, [decoded], bos=False)  # the template's text, as it is


def test_an_audio_url_part_over_the_openai_client_equals_the_reference(tiny):
    from llmplug.engine.async_llm import AsyncLLM
    from tests.entrypoints.openai.conftest import serve

    data = base64.b64encode(encode(CLIPS["noise"], RATE, "WAV", "PCM_16")).decode()
    clip = {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{data}"}}
    messages = [{"role": "user", "content": [clip, {"type": "text", "text": "What is it?"}]}]
    engine = AsyncLLM(str(tiny.path), dtype="float32", block_size=4, num_gpu_blocks_override=128,
                      limit_mm_per_prompt={"audio": 2}, device={"num_threads": 1})
    try:
        with serve(engine) as server:
            answer = server.client().chat.completions.create(
                model=server.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True})
    finally:
        engine.shutdown()
    text = tiny.tokenizer.apply_chat_template([{"role": "user", "content": f"{PLACEHOLDER}What is it?"}],
                                              tokenize=False, add_generation_prompt=True)
    decoded = (np.round(CLIPS["noise"] * 32767) / 32768).astype(np.float32)
    with torch.inference_mode():
        ids, embeds = reference_prompt(tiny, text, [decoded], bos=False)
    assert answer.usage.prompt_tokens == len(ids)
    expected = tiny.tokenizer.decode(reference_greedy(tiny, embeds), skip_special_tokens=True)
    assert answer.choices[0].message.content == expected


def test_chunked_prefill_encodes_each_clip_once(tiny):
    llm = LLM(str(tiny.path), dtype="float32", block_size=4, num_gpu_blocks_override=128,
              limit_mm_per_prompt={"audio": 2}, device={"num_threads": 1}, max_num_batched_tokens=8,
              encoder_cache_size=64)  # room for both clips: the long one stays cached
    cache = llm.llm_engine.engine_core.executor.worker.model_runner.encoder_cache
    text = tiny.prompt(1)
    first = llm.generate({"prompt": text, "multi_modal_data": {"audio": CLIPS["long"]}}, greedy(), use_tqdm=False)[0]
    assert cache.num_encoder_calls == 1  # 20 placeholders over three steps, the clip encoded once
    both = llm.generate({"prompt": tiny.prompt(2), "multi_modal_data": {"audio": [CLIPS["long"], CLIPS["tone"]]}},
                        greedy(), use_tqdm=False)[0]
    assert cache.num_encoder_calls == 2  # the long clip's rows from the cache, the tone's computed
    llm.shutdown()
    assert_matches_reference(tiny, first, text, [CLIPS["long"]])
    assert_matches_reference(tiny, both, tiny.prompt(2), [CLIPS["long"], CLIPS["tone"]])


def test_bad_audio_is_refused_by_name_and_the_next_request_works(tiny, llm):
    clip = CLIPS["tone"]
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate({"prompt": "User: what is it?", "multi_modal_data": {"audio": clip}}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="at most 2"):
        llm.generate({"prompt": tiny.prompt(3), "multi_modal_data": {"audio": [clip] * 3}}, use_tqdm=False)
    output = llm.generate({"prompt": tiny.prompt(1), "multi_modal_data": {"audio": clip}}, greedy(),
                          use_tqdm=False)[0]
    assert_matches_reference(tiny, output, tiny.prompt(1), [clip])


@pytest.mark.parametrize("field, value", [("text_model_id", "meta-llama/Llama-3.2-1B"), ("projector_act", "nope")])
def test_a_config_the_family_does_not_run_is_refused_by_name(field, value):
    from llmplug.plugins.models.ultravox import UltravoxConfig, UltravoxModel

    fields = {"audio_config": {**ENCODER, "model_type": "whisper"}, "text_config": {**DECODER, "vocab_size": 400},
              "audio_token_index": 2, field: value}
    with pytest.raises(ModelLoadError, match=f"{field}.*{value}"):
        UltravoxModel(config=UltravoxConfig(**fields))


def test_the_projector_before_0_5_norms_after_linear_2():
    from llmplug.layers.audio.stacking_projector import StackingProjector, StackingProjectorConfig

    weights = _projector_weights(ENCODER["d_model"], DECODER["hidden_size"])
    weights["ln_post.weight"] = weights.pop("ln_mid.weight")[:1].repeat(DECODER["hidden_size"]) + torch.linspace(
        0, 1, DECODER["hidden_size"])
    projector = StackingProjector(StackingProjectorConfig(
        encoder_hidden=ENCODER["d_model"], text_hidden=DECODER["hidden_size"], hidden_size=PROJECTOR_HIDDEN,
        stack_factor=STACK, activation="swiglu", norm_mid=False))
    assert projector.load_weights(weights.items()) == {n for n, _ in projector.named_parameters()}
    states = torch.randn(13, ENCODER["d_model"], generator=torch.Generator().manual_seed(1))  # 13: one row padded
    with torch.inference_mode():
        torch.testing.assert_close(projector(states), plain_projector(weights, states), rtol=1e-5, atol=1e-5)

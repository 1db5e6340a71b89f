"""LLM: the offline entry point, with vLLM's names (`from llmplug import LLM, SamplingParams`)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from tqdm.auto import tqdm

from llmplug.core.config import EngineConfig, load_config
from llmplug.core.errors import InvalidRequestError, RequestFailedError
from llmplug.core.outputs import (
    BeamSearchOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from llmplug.core.params import BeamSearchParams, PoolingParams, RequestOutputKind, SamplingParams
from llmplug.engine.beam_search import next_token_logprobs, start_search, step_params
from llmplug.engine.data_parallel import DataParallelEngine, build_engine
from llmplug.engine.input_processor import PromptType
from llmplug.engine.llm_engine import LLMEngine
from llmplug.engine.pooling import pair_prompt, score_pairs
from llmplug.engine.transcription import (
    Transcription,
    TranscriptionOptions,
    decoder_prompt,
    load_clip,
    no_speech_params,
    no_speech_prompt,
    sampling_params,
    transcript,
    windows,
)
from llmplug.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

Conversation = list[dict[str, Any]]


class LLM:
    """Generate completions for batches of prompts with continuous batching and a paged KV cache.

    `LLM(model=..., **engine_kwargs)` takes vLLM's engine keywords (dtype, max_model_len, max_num_seqs,
    block_size, enable_prefix_caching, ...) or nested sections (`cache={"block_size": 32}`);
    `LLM(config="engine.yaml")` reads a config file, with keyword arguments overriding it.
    """

    def __init__(self, model: str | None = None, *, config: str | Path | EngineConfig | None = None, **kwargs: Any):
        if model is not None:
            kwargs["model"] = model
        if isinstance(config, EngineConfig):
            engine_config = config
        else:
            # keyword arguments given to LLM override the file they come with
            resolved = load_config(kwargs=kwargs, file=config, order=("file", "kwargs", "cli"))
            engine_config = resolved.config
        self._start(build_engine(engine_config))  # with data_parallel_size > 1: replicas behind one front end

    @classmethod
    def from_engine(cls, llm_engine: LLMEngine) -> "LLM":
        """Wrap an existing LLMEngine, e.g. one built with a plugin registry of the caller's making."""
        self = cls.__new__(cls)
        self._start(llm_engine)
        return self

    def _start(self, llm_engine: LLMEngine | DataParallelEngine) -> None:
        self.llm_engine = llm_engine
        self._ids = itertools.count()

    @property
    def config(self) -> EngineConfig:
        """The resolved engine configuration."""
        return self.llm_engine.config

    def stats(self) -> dict[str, Any]:
        """The engine's counters: running and waiting requests, KV-cache usage, prefix-cache hit rate, preemptions,
        and with speculative decoding `spec_decode_acceptance_rate`, `spec_decode_mean_accepted_length` and
        the draft counts."""
        return self.llm_engine.engine_core.stats()

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of the prompts.

        `lora_request`: one LoRA adapter for every prompt, or one (or None: the base model) per prompt.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        loras = self._per_prompt(lora_request, len(prompts), "lora_request")
        ids = self._add_requests(prompts, params, priority, loras)
        return self._run(ids, use_tqdm)

    def transcribe(
        self,
        audio: Any,
        *,
        language: str = "en",
        task: str = "transcribe",
        prompt: str | None = None,
        temperature: float = 0.0,
        timestamps: bool = False,
        max_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> Transcription:
        """Transcribe (task "translate": into English) a clip of any length with a Whisper model, as
        /v1/audio/transcriptions does: 30 s windows decoded together under the folder's generation rules, their
        texts joined; with `timestamps` each window's timestamp tokens cut it into segments (and each window's
        no_speech_prob is computed).

        `audio`: the bytes of an encoded file, vLLM's `(samples, sampling_rate)` or samples at 16 kHz. `prompt`:
        earlier text the decoder is conditioned on. `max_tokens`: per window (default: the decoder's context).
        InvalidRequestError for a model that is not Whisper-like, an unknown language or task, bad audio.
        """
        processor = self.llm_engine.processor.encoder_decoder_processor
        if processor is None:
            raise InvalidRequestError(f"LLM.transcribe needs a speech model (Whisper); {self.config.model.model} is "
                                      "not an encoder-decoder model", param="model")
        if timestamps and processor.rules.timestamp_begin is None:
            raise InvalidRequestError("timestamps=True, but this model's tokenizer has no timestamp tokens "
                                      "(<|0.00|> right after <|notimestamps|>)", param="timestamps")
        options = TranscriptionOptions(language, task, prompt, temperature, timestamps)
        tokenizer = self.get_tokenizer()
        options.check(tokenizer)
        rate = processor.sampling_rate
        clip = windows(load_clip(audio, rate), rate, processor.max_seconds)
        text = decoder_prompt(options)
        room = self.llm_engine.processor.max_model_len - len(tokenizer(text, add_special_tokens=False)["input_ids"])
        params = sampling_params(options, processor.rules, room if max_tokens is None else max_tokens)
        audio_data = [{"multi_modal_data": {"audio": (w.samples, rate)}} for w in clip]
        prompts, all_params = [{"prompt": text, **a} for a in audio_data], [params] * len(clip)
        probe = no_speech_prompt(options, processor.rules) if timestamps else None
        if probe is not None:  # each window's no_speech_prob, from one more short request
            prompts += [{"prompt": probe, **a} for a in audio_data]
            all_params += [no_speech_params()] * len(clip)
        outputs = self.generate(prompts, all_params, use_tqdm=use_tqdm)
        return transcript(options, clip, outputs[: len(clip)], processor.rules,
                          lambda ids: tokenizer.decode(ids, skip_special_tokens=True), outputs[len(clip) :])

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, *, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """The best `params.beam_width` beams of each prompt, as transformers' `generate(num_beams=...)` finds them.

        Every prompt and the params are checked before anything is queued. Each step runs every running beam
        of every prompt as one request in one batch; the beams share their prompt's KV blocks through prefix
        caching, so a step computes only each beam's last, partial block.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        searches = [start_search(self.llm_engine, prompt, params) for prompt in prompts]
        with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm, unit="step") as bar:
            while running := [s for s in searches if not s.done]:
                step = step_params(params, self.llm_engine.eos_token_ids)
                beams = [{"prompt_token_ids": seq} for s in running for seq in s.sequences()]
                outputs = iter(self.generate(beams, step, use_tqdm=False))
                for search in running:
                    search.advance([next_token_logprobs(next(outputs)) for _ in search.running])
                bar.update(1)
        tokenizer = self.get_tokenizer()
        return [search.output(tokenizer) for search in searches]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them, using the tokenizer's chat template (and, with
        `lora_request`, a LoRA adapter: one for all, or one per conversation)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, **(chat_template_kwargs or {})) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def chat_prompt(self, conversation: Conversation, **kwargs: Any) -> dict[str, Any]:
        """A conversation rendered by the chat template, as prompt text plus token ids (and its images or audio, when
        its messages hold such parts: `image_url` with a data URL, `image_pil`, `image`; `input_audio`, `audio_url`
        with a data URL)."""
        from llmplug.engine.multimodal import has_media_parts

        if has_media_parts(conversation):
            return self._multimodal_chat_prompt(conversation, **kwargs)
        text = self.llm_engine.processor.apply_chat_template(conversation, **kwargs)
        # the template already holds the special tokens: do not let the tokenizer add a BOS again
        token_ids = self.get_tokenizer().encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _multimodal_chat_prompt(self, conversation: Conversation, **kwargs: Any) -> dict[str, Any]:
        """Rendered by the processor's chat template when it has one (else the tokenizer's, each image or clip as
        the model's placeholder text), then the text through the processor as an offline text prompt is (its
        special tokens the template's own): each placeholder expanded as the model's processor expands it, tile
        tags and image delimiters included (Gemma 3, Idefics3, Llama 4)."""
        from llmplug.engine.multimodal import flatten_media_parts, split_chat_media

        mm_processor = self.llm_engine.processor.mm_processor
        if mm_processor is None:
            raise InvalidRequestError("the conversation holds image or audio parts, but this model takes text only (it "
                                      "is not a multimodal model)", param="messages")
        messages, mm_data = split_chat_media(conversation, mm_processor.sampling_rate)
        hf_processor = mm_processor.hf_processor
        if getattr(hf_processor, "chat_template", None):
            kwargs.setdefault("add_generation_prompt", True)
            text = hf_processor.apply_chat_template(messages, tokenize=False, **kwargs)
        else:
            text = self.llm_engine.processor.apply_chat_template(
                flatten_media_parts(messages, mm_processor.placeholder), **kwargs)
        return {"prompt": text, "multi_modal_data": mm_data, "add_special_tokens": False}

    # ---- pooling models: embeddings, classification, scores (vLLM's names) ------------------------
    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt (`pooling_task`: embed, classify, score, token_embed, token_classify; None: the
        model's default); `outputs.data` is a float32 tensor."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _pooling_params_per_prompt(pooling_params, len(prompts), pooling_task)
        ids = self._add_requests(prompts, params, None)
        outputs = self._run(ids, use_tqdm)
        failed = [f"{out.request_id}: {out.error}" for out in outputs if out.outputs is None]
        if failed:  # the others ran to the end; the engine goes on
            raise RequestFailedError(f"{len(failed)} of {len(outputs)} pooling requests failed: " + "; ".join(failed))
        return outputs

    def embed(
        self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`)."""
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(out) for out in outputs]

    def classify(
        self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (`outputs.probs`)."""
        outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(out) for out in outputs]

    def reward(
        self, prompts: PromptType | Sequence[PromptType], *, use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[PoolingRequestOutput]:
        """A reward model's score of every token (`outputs.data`: [num_tokens, num_labels])."""
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="token_classify")

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """The relevance of each text pair: a cross-encoder's score of the pair, or the cosine similarity of the
        two texts' embeddings. One `data_1` text is paired with every `data_2` text; else pairs go by index."""
        pairs = score_pairs(data_1, data_2)
        tasks = self.llm_engine.pooling.tasks if self.llm_engine.pooling else ()
        if "score" in tasks:
            prompts = [pair_prompt(self.get_tokenizer(), a, b) for a, b in pairs]
            outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="score")
            return [ScoringRequestOutput.from_base(out) for out in outputs]
        if "embed" not in tasks:
            raise InvalidRequestError(
                f"scoring needs a cross-encoder or an embedding model; this model pools for {tasks}"
            )
        return self._embedding_scores(pairs, pooling_params, use_tqdm)

    def _embedding_scores(
        self, pairs: list[tuple[str, str]], pooling_params: PoolingParams | None, use_tqdm: bool
    ) -> list[ScoringRequestOutput]:
        import torch.nn.functional as F

        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
        embedded = dict(zip(texts, self.encode(texts, pooling_params, use_tqdm=use_tqdm, pooling_task="embed")))
        results = []
        for i, (a, b) in enumerate(pairs):
            first, second = embedded[a], embedded[b]
            score = F.cosine_similarity(first.outputs.data, second.outputs.data, dim=0).item()
            tokens = first.prompt_token_ids + second.prompt_token_ids
            results.append(ScoringRequestOutput(str(i), ScoringOutput(score), tokens, True))
        return results

    # ---- step-by-step use -------------------------------------------------------------------
    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue one request; returns its id."""
        request_id = request_id or str(next(self._ids))
        self.llm_engine.add_request(request_id, prompt, params, lora_request=lora_request)
        return request_id

    def step(self) -> list[RequestOutput]:
        """Run one engine step."""
        return self.llm_engine.step()

    def abort(self, request_ids: str | list[str]) -> None:
        """Stop requests and free their KV blocks."""
        self.llm_engine.abort_request([request_ids] if isinstance(request_ids, str) else request_ids)

    def shutdown(self) -> None:
        """Release the workers."""
        self.llm_engine.shutdown()

    # ---- between generations: new weights, sleep mode (RL) ------------------------------------
    def update_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Load new weights into the running engine and reset the prefix cache (no request may be running).

        `weights` are (checkpoint name, tensor) pairs, e.g. a transformers model's `state_dict().items()`;
        any subset of the model's weights, on any device, in any dtype. Each goes through the same
        per-parameter weight loader as at start-up, so fused projections and tensor-parallel shards
        are handled alike. An unknown name or a wrong shape raises ModelLoadError naming the tensor.
        """
        self.llm_engine.engine_core.update_weights(weights)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (no request may be running)."""
        self.llm_engine.engine_core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache memory; level 1 also moves the weights to host memory, level 2 discards them.

        No request may be running, and none can be added until `wake_up`. After level 2, load weights
        with `update_weights` (after `wake_up(tags=["weights"])`) before generating.
        """
        self.llm_engine.engine_core.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what sleep freed: tags "weights", "kv_cache", or both (None)."""
        self.llm_engine.engine_core.wake_up(tags)

    # ---- LoRA adapters (see docs/lora.md) -------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter ahead of its requests (InvalidRequestError when it cannot be served)."""
        self.llm_engine.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; False when none was loaded under that id."""
        return self.llm_engine.engine_core.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded now."""
        return self.llm_engine.engine_core.list_loras()

    def is_sleeping(self) -> bool:
        """True while anything is asleep."""
        return bool(self.llm_engine.engine_core.asleep)

    # ---- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        return list(sampling_params)

    @staticmethod
    def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
        """`value` for each of `n` prompts: a sequence of n, or one value for all."""
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"got {len(value)} {name} for {n} prompts")
            return list(value)
        return [value] * n

    def _add_requests(
        self, prompts: Sequence[PromptType], params: list[SamplingParams] | list[PoolingParams], priority,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[str]:
        ids = []
        finals: dict[int, SamplingParams] = {}  # one final-only copy of each params object given
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                if isinstance(p, SamplingParams) and p.output_kind != RequestOutputKind.FINAL_ONLY:
                    p = finals.get(id(p)) or finals.setdefault(id(p), _final_only(p))
                request_id = str(next(self._ids))
                self.llm_engine.add_request(
                    request_id, prompt, p, priority=priority[i] if priority else 0,
                    lora_request=loras[i] if loras else None,
                )
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)  # a bad prompt fails the call, not the engine
            raise
        return ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request finished; whatever escapes (an error, Ctrl-C) first aborts the unfinished ones,
        so the engine holds none of their blocks and the next call starts clean."""
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
                while pending:
                    if not self.llm_engine.has_unfinished_requests():
                        raise RuntimeError(f"engine went idle with requests {sorted(pending)} unfinished")
                    for out in self.llm_engine.step():
                        if out.finished and out.request_id in pending:
                            finished[out.request_id] = out
                            pending.discard(out.request_id)
                            bar.update(1)
        except BaseException:
            self.llm_engine.abort_request(sorted(pending))
            raise
        return [finished[i] for i in request_ids]


def _final_only(params: SamplingParams) -> SamplingParams:
    """A copy of `params` whose request answers once, when it finished (`_run` reads nothing else): the engine then
    builds no output a step for it, as vLLM's LLM asks."""
    final = params.clone()
    final.output_kind = RequestOutputKind.FINAL_ONLY
    return final


def _pooling_params_per_prompt(
    pooling_params: PoolingParams | Sequence[PoolingParams] | None, n: int, task: str | None
) -> list[PoolingParams]:
    """One PoolingParams per prompt, each for `task` when one is given."""
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        params = [pooling_params or PoolingParams()] * n
    elif len(pooling_params) != n:
        raise ValueError(f"got {len(pooling_params)} pooling_params for {n} prompts")
    else:
        params = list(pooling_params)
    return [p.with_task(task) if task else p for p in params]


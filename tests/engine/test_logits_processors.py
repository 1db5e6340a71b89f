"""Plain logits processors end to end: per request (SamplingParams) and for every request (a hooks plugin)."""

from __future__ import annotations

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.config import EngineConfig, ModelConfig
from llmplug.core.errors import InvalidRequestError
from llmplug.core.hookspecs import hookimpl
from llmplug.core.plugins import PluginRegistry
from llmplug.core.protocols import LogitsProcessor
from llmplug.engine.llm_engine import LLMEngine
from tests.models.tiny_models import make_tiny

PROMPTS = [{"prompt_token_ids": [5, 17, 42]}, {"prompt_token_ids": [200, 3]}]


def only_token(token_id: int) -> LogitsProcessor:
    """A processor that leaves one token possible."""

    def processor(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = logits[token_id].clone()
        logits.fill_(float("-inf"))
        logits[token_id] = keep
        return logits

    return processor


class BanTokens:
    """A hooks plugin contributing one processor for every request: the banned tokens are never sampled."""

    def __init__(self, banned: set[int]) -> None:
        self.banned = sorted(banned)

    @hookimpl
    def llmplug_logits_processors(self, config):
        def ban(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            logits[self.banned] = float("-inf")
            return logits

        return [ban]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


def generate(llm: LLM, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def tiny_config(tiny) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(tiny.path), dtype="float32", skip_tokenizer_init=True))


def make_llm(tiny) -> LLM:
    return LLM(config=tiny_config(tiny))


def test_per_request_processor_applies_to_its_request_only(tiny):
    free = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    forced = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True, logits_processors=[only_token(9)])
    ids = generate(make_llm(tiny), [forced, free])
    assert ids[0] == [9] * 6 and ids[1] != [9] * 6


def test_hook_processors_apply_to_every_request(tiny):
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    before = generate(make_llm(tiny), greedy)
    plugin = BanTokens({ids[0] for ids in before})
    registry = PluginRegistry()  # the engine's own: the plugin reaches no other engine
    registry.hook_manager().register(plugin)
    after = generate(LLM.from_engine(LLMEngine(tiny_config(tiny), registry)), greedy)  # asked at model load
    assert all(not set(plugin.banned) & set(ids) for ids in after)  # every request, not only the first
    assert generate(make_llm(tiny), greedy) == before  # an engine with its own registry never sees the plugin


def test_a_processor_must_be_callable():
    with pytest.raises(InvalidRequestError, match="logits_processors"):
        SamplingParams(logits_processors=["not callable"])


def mask_everything(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    return torch.full_like(logits, float("-inf"))


def raise_error(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    raise ValueError("user bug")


@pytest.mark.parametrize("processor", [mask_everything, raise_error])
@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 0.9)])
def test_a_request_whose_processor_leaves_nothing_to_sample_fails_alone(tiny, processor, temperature, top_p):
    llm = make_llm(tiny)
    good = SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    alone = generate(llm, [good, good])[1]
    bad = SamplingParams(temperature=temperature, top_p=top_p, seed=0, max_tokens=5, logits_processors=[processor])
    outs = llm.generate(PROMPTS, [bad, good], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort" and list(outs[0].outputs[0].token_ids) == []
    assert list(outs[1].outputs[0].token_ids) == alone  # the batch's other request is untouched
    assert generate(llm, [good, good])[1] == alone  # and the engine keeps serving
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.num_free_blocks == \
        llm.llm_engine.engine_core.scheduler.kv_cache_manager.num_blocks

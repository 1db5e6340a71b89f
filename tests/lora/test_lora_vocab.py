"""Adapters of the vocabulary layers (PEFT's `embed_tokens` and `lm_head` targets) against peft: mixed in one
batch with adapters that do not adapt them and with the base model; tied embeddings; over two tensor-parallel
ranks; and adapters whose vocabulary does not fit, refused with the next request still served."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from llmplug import SamplingParams
from llmplug.core.errors import InvalidRequestError
from llmplug.lora import LoRARequest
from tests.models.tiny_models import TinyModel, make_tiny

from .adapters import Adapter, greedy_reference, save_adapter
from .test_lora_parity import as_inputs, check_mixed_greedy, check_mixed_logits, lora_llm, prompts

# the base model, an embedding + q adapter, an attention-only one, an lm_head + MLP one, and one adapting both
VOCAB_MIXED = (None, "emb8", "qv8", "head16", "both8")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
llama_only = pytest.mark.parametrize("base", ["llama"], indirect=True)


def test_vocab_adapters_mixed_batch_logits_match_peft(base: TinyModel, adapters: dict[str, Adapter]) -> None:
    check_mixed_logits(base, adapters, VOCAB_MIXED)


def test_vocab_adapters_mixed_batch_generates_peft_greedy_tokens(base: TinyModel, adapters: dict[str, Adapter]) -> None:
    check_mixed_greedy(base, adapters, VOCAB_MIXED)


def test_tied_embeddings_adapt_lookup_and_head_separately_as_peft_does(tmp_path: Path) -> None:
    """Qwen2's tiny model ties lm_head to embed_tokens; peft adapts each module on its own (unmerged forward)."""
    tied = make_tiny("qwen2", tmp_path / "tied")
    assert tied.hf_model.config.tie_word_embeddings
    both = save_adapter(tied.path, "both8", tmp_path / "both8", seed=5, merge=False)
    batch = prompts(tied.hf_model.config.vocab_size, (7, 10))
    llm = lora_llm(tied, max_loras=1)
    try:
        outputs = llm.generate(as_inputs(batch), GREEDY, lora_request=[both.request(1), None], use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, model, output in zip(batch, (both.merged, tied.hf_model), outputs):
        assert list(output.outputs[0].token_ids) == greedy_reference(model, prompt, GREEDY.max_tokens)[0]


def _edited(adapter: Adapter, dest: Path, edit) -> Path:
    """A copy of `adapter`'s folder whose tensors went through `edit` (a dict -> dict)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter.path, dest)
    path = dest / "adapter_model.safetensors"
    save_file(edit(load_file(path)), path)
    return dest


def _resize(tensors: dict[str, torch.Tensor], key_end: str, dim: int) -> dict[str, torch.Tensor]:
    """Drop 10 vocabulary entries of the tensors ending in `key_end` (and the base tables: a smaller vocabulary)."""
    return {k: (v.narrow(dim, 0, v.shape[dim] - 10).contiguous() if k.endswith(key_end) else v)
            for k, v in tensors.items() if not k.endswith("base_layer.weight")}


@llama_only
def test_vocab_adapters_that_do_not_fit_are_refused_and_the_next_request_served(
    base: TinyModel, adapters: dict[str, Adapter], tmp_path: Path
) -> None:
    vocab = base.hf_model.config.vocab_size
    both = adapters["both8"]

    def retrained(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        key = next(k for k in tensors if k.endswith("embed_tokens.base_layer.weight"))
        return {**tensors, key: tensors[key] + 0.01}

    cases = {
        f"lora_embedding_A has shape (8, {vocab - 10}), the model needs (8, {vocab})":
            _edited(both, tmp_path / "emb", lambda t: _resize(t, "lora_embedding_A", 1)),
        f"lm_head.lora_B has shape ({vocab - 10}, 8), the model needs ({vocab}, 8)":
            _edited(both, tmp_path / "head", lambda t: _resize(t, "lm_head.lora_B.weight", 0)),
        "carries its own 'model.embed_tokens' table": _edited(both, tmp_path / "retrained", retrained),
    }
    llm = lora_llm(base)
    prompt = prompts(vocab, (6,))[0]
    try:
        for i, (why, path) in enumerate(cases.items()):
            with pytest.raises(InvalidRequestError, match=re.escape(why)):
                llm.generate(as_inputs([prompt]), GREEDY, lora_request=LoRARequest(f"bad{i}", 50 + i, str(path)),
                             use_tqdm=False)
            assert not llm.llm_engine.has_unfinished_requests()
            good = llm.generate(as_inputs([prompt]), GREEDY, lora_request=both.request(1), use_tqdm=False)[0]
            assert list(good.outputs[0].token_ids) == greedy_reference(both.merged, prompt, GREEDY.max_tokens)[0]
    finally:
        llm.shutdown()


@pytest.mark.slow
@llama_only
def test_tensor_parallel_splits_vocabulary_adapters_like_the_tables(
    base: TinyModel, adapters: dict[str, Adapter]
) -> None:
    llm = lora_llm(base, tensor_parallel_size=2)
    try:
        batch = prompts(base.hf_model.config.vocab_size, (6, 9, 4, 12))
        names = [None, "emb8", "head16", "both8"]
        loras = [None if n is None else adapters[n].request(i) for i, n in enumerate(names)]
        params = SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=2)
        outputs = llm.generate(as_inputs(batch), params, lora_request=loras, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, name, output in zip(batch, names, outputs):
        model = base.hf_model if name is None else adapters[name].merged
        tokens, log_probs = greedy_reference(model, prompt, GREEDY.max_tokens)
        assert list(output.outputs[0].token_ids) == tokens, name
        for row, lp in enumerate(output.prompt_logprobs[1:]):
            for tok, v in lp.items():
                assert abs(v.logprob - log_probs[row, tok].item()) < 1e-4, name

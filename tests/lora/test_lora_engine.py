"""The engine's handling of adapters: more adapters than slots, prefix caching per adapter, and adapters that
do not fit (each refused before it is queued, and the next request still served)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from llmplug import SamplingParams
from llmplug.core.errors import InvalidRequestError
from llmplug.lora import LoRARequest
from tests.models.tiny_models import TinyModel

from .adapters import SPECS, Adapter, greedy_reference
from .test_lora_parity import as_inputs, lora_llm, prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
llama_only = pytest.mark.parametrize("base", ["llama"], indirect=True)


def expected_tokens(adapter: Adapter, prompt: list[int]) -> list[int]:
    return greedy_reference(adapter.merged, prompt, GREEDY.max_tokens)[0]


@llama_only
def test_five_adapters_through_two_slots_give_each_its_own_answer(base: TinyModel, adapters: dict[str, Adapter]) -> None:
    llm = lora_llm(base, max_loras=2, max_cpu_loras=3)
    try:
        batch = prompts(base.hf_model.config.vocab_size, (6, 9, 4, 12, 7, 10, 5, 8, 11, 3))
        names = [list(SPECS)[i % len(SPECS)] for i in range(len(batch))]  # 5 adapters, each twice, interleaved
        requests = {name: adapters[name].request(i + 1) for i, name in enumerate(SPECS)}
        outputs = llm.generate(as_inputs(batch), GREEDY, lora_request=[requests[n] for n in names], use_tqdm=False)
        manager = llm.llm_engine.engine_core.executor.worker.model_runner.lora_manager
        assert len(manager.slot_of) == 2 and len(manager.cached) == 3  # the caps held
    finally:
        llm.shutdown()
    for prompt, name, output in zip(batch, names, outputs):
        assert list(output.outputs[0].token_ids) == expected_tokens(adapters[name], prompt), name


@llama_only
def test_prefix_cache_is_never_shared_across_adapters(base: TinyModel, adapters: dict[str, Adapter]) -> None:
    llm = lora_llm(base)
    prompt = prompts(base.hf_model.config.vocab_size, (17,))[0]  # four full blocks of 4
    first, second = adapters["qv8"], adapters["all8"]
    try:
        run = lambda adapter, lora_id: llm.generate(as_inputs([prompt]), GREEDY, lora_request=adapter.request(lora_id),  # noqa: E731
                                                    use_tqdm=False)[0]
        a = run(first, 1)
        b = run(second, 2)  # the same prompt under another adapter: no block of `a` may be reused
        a_again = run(first, 1)  # the same adapter again: its blocks are reused
        plain = llm.generate(as_inputs([prompt]), GREEDY, use_tqdm=False)[0]  # nor by the base model
    finally:
        llm.shutdown()
    assert b.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert a_again.num_cached_tokens == 16
    assert list(b.outputs[0].token_ids) == expected_tokens(second, prompt)
    assert list(a_again.outputs[0].token_ids) == list(a.outputs[0].token_ids) == expected_tokens(first, prompt)
    assert list(plain.outputs[0].token_ids) == greedy_reference(base.hf_model, prompt, GREEDY.max_tokens)[0]


@llama_only
def test_an_id_given_to_another_adapter_after_a_removal_never_meets_the_old_ones_blocks(
        base: TinyModel, adapters: dict[str, Adapter]) -> None:
    llm = lora_llm(base)
    prompt = prompts(base.hf_model.config.vocab_size, (17,))[0]  # four full blocks of 4
    first, second = adapters["qv8"], adapters["all8"]
    try:
        run = lambda adapter: llm.generate(as_inputs([prompt]), GREEDY, lora_request=adapter.request(1),  # noqa: E731
                                           use_tqdm=False)[0]
        run(first)
        assert llm.remove_lora(1)
        b = run(second)  # id 1 again, other weights: the blocks cached under the first adapter must not match
        assert llm.remove_lora(1)
        a_again = run(first)  # even the same folder, loaded anew, starts a new load
    finally:
        llm.shutdown()
    assert b.num_cached_tokens == 0 and a_again.num_cached_tokens == 0
    assert list(b.outputs[0].token_ids) == expected_tokens(second, prompt)
    assert list(a_again.outputs[0].token_ids) == expected_tokens(first, prompt)


def _copy(adapter: Adapter, dest: Path) -> Path:
    shutil.copytree(adapter.path, dest)
    return dest


def _edit_config(folder: Path, **changes) -> Path:
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))
    return folder


@llama_only
def test_adapters_that_do_not_fit_are_refused_before_queueing(
    base: TinyModel, adapters: dict[str, Adapter], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.models.tiny_models import make_tiny

    from .adapters import save_adapter

    other = make_tiny("qwen3", tmp_path_factory.mktemp("other-base"))  # head_dim 32: q_proj is 128 wide
    foreign = save_adapter(other.path, "qv8", tmp_path / "foreign", seed=9)
    broken_weights = _copy(adapters["qv8"], tmp_path / "broken")
    (broken_weights / "adapter_model.safetensors").write_bytes(b"not safetensors")
    cases = {
        "exceeds max_lora_rank=8": adapters["mlp16"].path,
        "has shape (128, 8)": foreign.path,
        "use_dora=True": _edit_config(_copy(adapters["qv8"], tmp_path / "dora"), use_dora=True),
        "not a readable safetensors": broken_weights,
        "no adapter_config.json": tmp_path / "missing",
        "not a layer this model can adapt": _copy(adapters["qv8"], tmp_path / "norm"),
        "modules_to_save": _edit_config(_copy(adapters["qv8"], tmp_path / "saved"), modules_to_save=["lm_head"]),
    }
    _rename_tensors(cases["not a layer this model can adapt"])
    llm = lora_llm(base, max_lora_rank=8)
    prompt = prompts(base.hf_model.config.vocab_size, (5,))[0]
    try:
        for i, (why, path) in enumerate(cases.items()):
            with pytest.raises(InvalidRequestError, match=re.escape(why)):
                llm.generate(as_inputs([prompt]), GREEDY, lora_request=LoRARequest(f"bad{i}", 100 + i, str(path)), use_tqdm=False)
            assert not llm.llm_engine.has_unfinished_requests()
            good = llm.generate(as_inputs([prompt]), GREEDY, lora_request=adapters["qv8"].request(1), use_tqdm=False)[0]
            assert list(good.outputs[0].token_ids) == expected_tokens(adapters["qv8"], prompt)
        assert [r.lora_name for r in llm.list_loras()] == ["qv8"]
    finally:
        llm.shutdown()


def _rename_tensors(folder: Path) -> None:
    """Point layer 0's q_proj tensors at its input norm, which LoRA here does not adapt."""
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    tensors = {k.replace("self_attn.q_proj", "input_layernorm"): v for k, v in load_file(path).items()}
    save_file(tensors, path)


@llama_only
def test_lora_request_without_enable_lora_is_a_clear_error(base: TinyModel, adapters: dict[str, Adapter]) -> None:
    llm = lora_llm(base, enable_lora=False)
    prompt = prompts(base.hf_model.config.vocab_size, (5,))[0]
    try:
        with pytest.raises(InvalidRequestError, match="enable_lora"):
            llm.generate(as_inputs([prompt]), GREEDY, lora_request=adapters["qv8"].request(1), use_tqdm=False)
        plain = llm.generate(as_inputs([prompt]), GREEDY, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert list(plain.outputs[0].token_ids) == greedy_reference(base.hf_model, prompt, GREEDY.max_tokens)[0]


@pytest.mark.slow
@llama_only
def test_tensor_parallel_shards_adapters_like_the_base_layers(base: TinyModel, adapters: dict[str, Adapter]) -> None:
    llm = lora_llm(base, tensor_parallel_size=2)
    try:
        batch = prompts(base.hf_model.config.vocab_size, (6, 9, 4, 12))
        names = [None, "qv8", "mlp16", "all8"]  # every fused and row-parallel layer, ranks 8 and 16
        loras = [None if n is None else adapters[n].request(i) for i, n in enumerate(names)]
        outputs = llm.generate(as_inputs(batch), GREEDY, lora_request=loras, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, name, output in zip(batch, names, outputs):
        model = base.hf_model if name is None else adapters[name].merged
        assert list(output.outputs[0].token_ids) == greedy_reference(model, prompt, GREEDY.max_tokens)[0], name


@llama_only
def test_compile_with_lora_is_refused_at_start(base: TinyModel) -> None:
    from llmplug.core.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape("device.compile cannot be combined with lora.enable_lora")):
        lora_llm(base, **{"device.compile": True})

"""Guided decoding inside the engine: mixed batches, chunked prefill, preemption, compiling off the step loop."""

from __future__ import annotations

import re
import threading

import pytest

from llmplug import LLM, SamplingParams
from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import GuidedDecodingParams
from llmplug.plugins.guided_decoding.xgrammar_backend import XGrammarBackend

from .conftest import CASES

PROMPTS = ['{"a":', "(1+", "abc@1", "[true,", '"x":', "12345", "nul", "{}"]
# (backend, kind) per prompt; None: unconstrained
MIXED = [("xgrammar", "json"), None, ("llguidance", "grammar"), ("outlines", "regex"), None,
         ("lm_format_enforcer", "choice"), ("llguidance", "json_object"), None]


def mixed_requests() -> list[tuple[str, SamplingParams]]:
    """Constrained requests of every backend interleaved with unconstrained ones, all seeded."""
    return [
        (prompt, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=80,
                                guided_decoding=CASES[mixed[1]].params(mixed[0]) if mixed else None))
        for i, (prompt, mixed) in enumerate(zip(PROMPTS, MIXED))
    ]


def run(llm: LLM, requests: list[tuple[str, SamplingParams]]) -> list[tuple[str, list[int]]]:
    outs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]


def check_valid(requests, results) -> None:
    for (_, params), (text, _) in zip(requests, results):
        constraint = params.guided_decoding
        if constraint is not None:
            assert CASES[constraint.kind].valid(text), (constraint.backend, constraint.kind, text)


def test_mixed_batch_equals_each_request_alone(tiny_llm):
    requests = mixed_requests()
    together = run(tiny_llm, requests)
    alone = [run(tiny_llm, [r])[0] for r in requests]
    assert together == alone
    check_valid(requests, together)


@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_batched_tokens": 8},  # every prompt is prefilled in chunks: no sampling, no matcher step
    {"num_gpu_blocks_override": 12, "max_num_seqs": 8},  # requests are preempted and recomputed
], ids=["chunked_prefill", "preemption"])
def test_matchers_survive_chunked_prefill_and_preemption(tiny_guided_model, tiny_llm, engine_kwargs):
    requests = [(p * 4, s) for p, s in mixed_requests()]  # longer prompts: several chunks / blocks each
    expected = run(tiny_llm, requests)
    llm = LLM(str(tiny_guided_model), dtype="float32", max_model_len=512, block_size=16, **engine_kwargs)
    try:
        assert run(llm, requests) == expected
        if "num_gpu_blocks_override" in engine_kwargs:
            assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()
    check_valid(requests, expected)


class GatedXGrammar(XGrammarBackend):
    """The real xgrammar backend whose compiles wait for a gate: shows that others run meanwhile."""

    gate = threading.Event()

    def _compile(self, constraint):
        assert self.gate.wait(30), "the test never opened the gate"
        return super()._compile(constraint)


def test_a_request_waits_for_its_grammar_while_others_run(tiny_llm):
    engine = tiny_llm.llm_engine
    tokenizer = engine.tokenizer
    engine.guided._backends["gated"] = GatedXGrammar(tokenizer, engine.guided.vocab_size, engine.eos_token_id)
    guided = SamplingParams(max_tokens=50, temperature=1.0, seed=3,
                            guided_decoding=GuidedDecodingParams(regex="(ab|cd)@[0-9]", backend="gated"))
    engine.add_request("guided", "abc", guided)
    engine.add_request("free", "abc", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    finished = {}
    try:
        while "free" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert "guided" not in finished and engine.engine_core.scheduler.compiling
        stats = engine.engine_core.stats()  # vllm:num_requests_waiting_by_reason{reason="deferred"}
        assert (stats["num_waiting"], stats["num_waiting_deferred"]) == (1, 1)
    finally:
        GatedXGrammar.gate.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(finished["free"].outputs[0].token_ids) == 5
    assert re.fullmatch("(ab|cd)@[0-9]", finished["guided"].outputs[0].text)


def test_request_finishes_when_the_grammar_is_complete(tiny_llm):
    for backend in ("xgrammar", "llguidance", "outlines", "lm_format_enforcer"):
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=100,
                                guided_decoding=GuidedDecodingParams(choice=["abc"], backend=backend))
        out = tiny_llm.generate(["a"], params, use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason) == ("abc", "stop"), backend
        assert len(out.token_ids) <= 4  # "a", "b", "c" and at most the end-of-sequence token


def test_compiled_grammars_are_cached_by_backend_and_constraint(tiny_llm):
    manager = tiny_llm.llm_engine.guided
    a = manager.prepare(GuidedDecodingParams(regex="[ab]+", backend="xgrammar"))
    b = manager.prepare(GuidedDecodingParams(regex="[ab]+", backend="xgrammar"))
    c = manager.prepare(GuidedDecodingParams(regex="[ab]+", backend="llguidance"))
    assert a is b and a is not c
    assert a.result() is b.result()


class _RaisingMatcher:
    """A real matcher whose `method` raises from now on (a backend's bug met mid-generation)."""

    def __init__(self, matcher, method: str) -> None:
        self._matcher, self._method = matcher, method

    def __getattr__(self, name):
        if name == self._method:
            raise RuntimeError(f"matcher bug in {name}")
        return getattr(self._matcher, name)


@pytest.mark.parametrize("method", ["fill_bitmask", "accept_token", "is_terminated"])
def test_a_grammar_that_raises_ends_its_request_only(tiny_llm, method):
    requests = mixed_requests()
    expected = run(tiny_llm, requests)
    ids = [tiny_llm.add_request(prompt, params) for prompt, params in requests]
    grammar = tiny_llm.llm_engine.engine_core.scheduler.requests[ids[0]].grammar
    finished = {}
    while not grammar.ready:
        finished.update({o.request_id: o for o in tiny_llm.step() if o.finished})
    grammar._matcher = _RaisingMatcher(grammar.matcher, method)
    while tiny_llm.llm_engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in tiny_llm.step() if o.finished})
    broken = finished[ids[0]].outputs[0]
    assert broken.finish_reason == "abort" and f"matcher bug in {method}" in broken.error
    others = [(finished[i].outputs[0].text, list(finished[i].outputs[0].token_ids)) for i in ids[1:]]
    assert others == expected[1:]
    kv = tiny_llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_grammar_applies_only_after_the_reasoning_end_sequence(tiny_llm):
    """A constraint with start_after_token_ids leaves the reasoning free and constrains only what follows it."""
    tokenizer = tiny_llm.get_tokenizer()
    reasoning = tokenizer.encode("abc))", add_special_tokens=False)  # its first token is no choice's first one
    end = tuple(reasoning[-2:])  # "))": the end-of-reasoning sequence

    def write_reasoning(output_token_ids: list[int], logits):
        """Force the reasoning tokens first (so they are certain), then leave the logits alone."""
        if len(output_token_ids) < len(reasoning):
            forced = reasoning[len(output_token_ids)]
            logits.fill_(float("-inf"))
            logits[forced] = 0.0
        return logits

    choices = ["true", "false"]
    texts = []
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=30, logits_processors=[write_reasoning],
                                guided_decoding=GuidedDecodingParams(choice=choices, start_after_token_ids=end))
        out = tiny_llm.generate(["(1+"], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids[:len(reasoning)] == reasoning  # the grammar did not mask the reasoning
        texts.append(out.text)
        assert out.text.removeprefix("abc))") in choices, out.text
        assert out.finish_reason == "stop"
    # without the delay the same reasoning is impossible: the grammar masks its first token and the request fails
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=30, logits_processors=[write_reasoning],
                            guided_decoding=GuidedDecodingParams(choice=choices))
    out = tiny_llm.generate(["(1+"], params, use_tqdm=False)[0].outputs[0]
    assert not out.text.startswith("abc")
    with pytest.raises(InvalidRequestError, match="start_after_token_ids"):
        tiny_llm.generate(["(1+"], SamplingParams(guided_decoding=GuidedDecodingParams(
            choice=choices, start_after_token_ids=(10**9,))), use_tqdm=False)


def test_a_failure_in_output_processing_ends_its_request_only_and_frees_its_blocks(tiny_llm):
    """The output processor's per-request guard, through the engine: the broken request is aborted in the core
    (its blocks freed), the others finish as they would alone."""
    requests = mixed_requests()
    expected = run(tiny_llm, requests)
    ids = [tiny_llm.add_request(prompt, params) for prompt, params in requests]
    finished = {o.request_id: o for o in tiny_llm.step() if o.finished}
    completion = tiny_llm.llm_engine.output_processor.requests[ids[1]].children[ids[1]]

    def broken(*args, **kwargs):
        raise RuntimeError("detokenizer bug")

    completion.detokenizer.update = broken
    while tiny_llm.llm_engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in tiny_llm.step() if o.finished})
    bad = finished[ids[1]].outputs[0]
    assert bad.finish_reason == "abort" and "detokenizer bug" in bad.error
    others = [(finished[i].outputs[0].text, list(finished[i].outputs[0].token_ids)) for i in ids if i != ids[1]]
    assert others == [e for i, e in enumerate(expected) if i != 1]
    kv = tiny_llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert run(tiny_llm, requests[:2]) == expected[:2]  # the next requests are served

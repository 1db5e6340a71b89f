"""OutputProcessor: output kinds, stop strings, n > 1 aggregation, logprobs, metrics, aborts."""

from __future__ import annotations

import pytest
import torch

from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import RequestOutputKind, SamplingParams
from llmplug.engine.core_outputs import LogprobsLists
from llmplug.engine.output_processor import EngineCoreOutput, OutputProcessor
from llmplug.engine.sampler import compute_prompt_logprobs

from .test_detokenizer import load_smollm2_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. 🦊 狐狸"


@pytest.fixture(scope="module")
def tokenizer():
    """The SmolLM2 tokenizer (shared with test_detokenizer through its cache)."""
    return load_smollm2_tokenizer()


@pytest.fixture
def ids(tokenizer) -> list[int]:
    """The token ids of TEXT."""
    return tokenizer.encode(TEXT, add_special_tokens=False)


def run(processor: OutputProcessor, req_id: str, ids: list[int], finish_reason="length", stop_reason=None):
    """Feed ids one per step (finishing on the last); return every RequestOutput and abort list."""
    outputs, aborts = [], []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        update = EngineCoreOutput(req_id, [token], finish_reason if last else None, stop_reason if last else None)
        processed = processor.process([update])
        outputs += processed.request_outputs
        aborts += processed.reqs_to_abort
    return outputs, aborts


def start(processor: OutputProcessor, params: SamplingParams, request_id="req", n=1) -> list[str]:
    """Add a request with n children; return the child ids."""
    child_ids = [f"{i}_{request_id}" for i in range(n)] if n > 1 else [request_id]
    processor.add_request(request_id, "prompt", [1, 2, 3], params, arrival_time=100.0, child_ids=child_ids)
    return child_ids


# --- output kinds ---


def test_cumulative_outputs_grow_and_finish(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams())
    outputs, _ = run(processor, "req", ids)
    assert len(outputs) == len(ids)
    texts = [o.outputs[0].text for o in outputs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    final = outputs[-1]
    assert final.finished and final.outputs[0].text == TEXT and final.outputs[0].token_ids == ids
    assert final.outputs[0].finish_reason == "length" and not outputs[-2].finished
    assert final.prompt == "prompt" and final.prompt_token_ids == [1, 2, 3]
    assert not processor.has_unfinished_requests()


def test_delta_outputs_carry_only_what_is_new(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams(output_kind=RequestOutputKind.DELTA))
    outputs, _ = run(processor, "req", ids)
    assert "".join(o.outputs[0].text for o in outputs) == TEXT
    assert [t for o in outputs for t in o.outputs[0].token_ids] == ids
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


def test_final_only_emits_once(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY))
    outputs, _ = run(processor, "req", ids)
    assert len(outputs) == 1 and outputs[0].finished and outputs[0].outputs[0].text == TEXT


def test_metrics_and_cached_tokens(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams())
    first = processor.process([EngineCoreOutput("req", ids[:1], num_cached_tokens=16)]).request_outputs[0]
    last = processor.process([EngineCoreOutput("req", ids[1:2], "length")]).request_outputs[0]
    assert first.metrics.arrival_time == 100.0 and first.metrics.first_token_time is not None
    assert first.metrics.finished_time is None and last.metrics.finished_time >= last.metrics.first_token_time
    assert last.num_cached_tokens == 16


# --- stopping ---


def test_stop_string_finishes_and_asks_the_core_to_abort(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams(stop=["fox"]))
    outputs, aborts = run(processor, "req", ids)
    final = outputs[-1]
    assert final.finished and final.outputs[0].text == "The quick brown "
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "fox"
    assert aborts == ["req"] and not processor.has_unfinished_requests()
    assert len(outputs) == ids.index(tokenizer.encode(" fox", add_special_tokens=False)[0]) + 1


def test_delta_never_sends_a_partial_stop_string(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams(stop=["lazy cat"], output_kind=RequestOutputKind.DELTA))
    outputs, aborts = run(processor, "req", ids)
    sent = [o.outputs[0].text for o in outputs]
    assert "".join(sent) == TEXT and aborts == []
    assert not any("".join(sent[: i + 1]).endswith(" lazy") for i in range(len(sent) - 1))  # held back


def test_stop_token_text_is_left_out_unless_asked(tokenizer, ids):
    eos = tokenizer.encode("!", add_special_tokens=False)  # a stop token id with visible text
    for include, suffix in ((False, ""), (True, "!")):
        processor = OutputProcessor(tokenizer)
        start(processor, SamplingParams(stop_token_ids=eos, include_stop_str_in_output=include))
        outputs, _ = run(processor, "req", ids + eos, finish_reason="stop", stop_reason=eos[0])
        out = outputs[-1].outputs[0]
        assert out.text == TEXT + suffix and out.token_ids == ids + eos and out.stop_reason == eos[0]


def test_updates_after_a_stop_string_are_ignored(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams(stop=["quick"], n=2), n=2)
    processor.process([EngineCoreOutput("0_req", ids[:2]), EngineCoreOutput("1_req", ids[:1])])
    late = processor.process([EngineCoreOutput("0_req", ids[2:3]), EngineCoreOutput("1_req", ids[1:2])])
    assert late.reqs_to_abort == ["1_req"]
    assert [o.index for o in late.request_outputs[0].outputs] == [0, 1]
    assert late.request_outputs[0].outputs[0].token_ids == ids[:2]


# --- n > 1 ---


def test_n_children_aggregate_by_index(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    children = start(processor, SamplingParams(n=3, output_kind=RequestOutputKind.FINAL_ONLY), n=3)
    assert processor.process([EngineCoreOutput(children[2], ids[:3], "length")]).request_outputs == []
    assert processor.process([EngineCoreOutput(children[0], ids[:5], "length")]).request_outputs == []
    final = processor.process([EngineCoreOutput(children[1], ids[:1], "stop", 2)]).request_outputs
    assert len(final) == 1 and final[0].finished and final[0].request_id == "req"
    assert [o.index for o in final[0].outputs] == [0, 1, 2]
    assert [len(o.token_ids) for o in final[0].outputs] == [5, 1, 3]
    assert final[0].outputs[1].finish_reason == "stop"


def test_n_children_stream_cumulative_with_all_and_delta_with_changed(tokenizer, ids):
    for kind, expected in ((RequestOutputKind.CUMULATIVE, [0, 1]), (RequestOutputKind.DELTA, [1])):
        processor = OutputProcessor(tokenizer)
        start(processor, SamplingParams(n=2, output_kind=kind), n=2)
        processor.process([EngineCoreOutput("0_req", ids[:2]), EngineCoreOutput("1_req", ids[:2])])
        out = processor.process([EngineCoreOutput("1_req", ids[2:4])]).request_outputs[0]
        assert [o.index for o in out.outputs] == expected and not out.finished
        child = out.outputs[-1]
        assert child.token_ids == (ids[:4] if kind == RequestOutputKind.CUMULATIVE else ids[2:4])


# --- logprobs ---


def test_logprobs_become_logprob_objects_with_text(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams(logprobs=2))
    lists = LogprobsLists([[ids[0], 7, ids[0], 9]], [[-0.5, -0.1, -0.5, -3.0]], [2])  # batch computed k = 3
    processor.process([EngineCoreOutput("req", ids[:1], new_logprobs=lists)])
    out = processor.process([EngineCoreOutput("req", ids[1:2], "length", new_logprobs=lists)]).request_outputs[0]
    completion = out.outputs[0]
    assert completion.cumulative_logprob == pytest.approx(-1.0)
    position = completion.logprobs[0]
    assert set(position) == {ids[0], 7}  # the sampled token and the top 2, no third
    assert position[7].rank == 1 and position[7].logprob == pytest.approx(-0.1)
    assert position[ids[0]].decoded_token == tokenizer.decode([ids[0]])
    assert len(completion.logprobs) == 2


def test_prompt_logprobs_from_sampler_tensors(tokenizer):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams(prompt_logprobs=1, output_kind=RequestOutputKind.DELTA))
    torch.manual_seed(0)
    chunk = compute_prompt_logprobs(torch.randn(2, 100), torch.tensor([2, 3]), 1)
    out = processor.process([EngineCoreOutput("req", [], prompt_logprobs=chunk)]).request_outputs
    assert out == []  # nothing generated yet
    first = processor.process([EngineCoreOutput("req", [5])]).request_outputs[0]
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == 3
    assert first.prompt_logprobs[1][2].logprob == pytest.approx(float(chunk.logprobs[0, 0]))
    later = processor.process([EngineCoreOutput("req", [6])]).request_outputs[0]
    assert later.prompt_logprobs == []  # DELTA sends them once


def test_no_logprobs_when_not_requested(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams())
    out = processor.process([EngineCoreOutput("req", ids[:1], "length")]).request_outputs[0].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None


# --- without text ---


def test_without_a_tokenizer_only_token_ids_are_returned(ids):
    processor = OutputProcessor(None)
    start(processor, SamplingParams(logprobs=0))
    lists = LogprobsLists([[ids[0]]], [[-1.0]], [1])
    out = processor.process([EngineCoreOutput("req", ids[:1], "length", new_logprobs=lists)]).request_outputs[0]
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == ids[:1]
    assert out.outputs[0].logprobs[0][ids[0]].decoded_token is None


def test_detokenize_false_skips_text(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams(detokenize=False))
    outputs, _ = run(processor, "req", ids)
    assert outputs[-1].outputs[0].text == "" and outputs[-1].outputs[0].token_ids == ids


def test_stop_strings_without_detokenization_are_rejected(tokenizer):
    with pytest.raises(InvalidRequestError, match="stop strings"):
        start(OutputProcessor(tokenizer), SamplingParams(stop=["x"], detokenize=False))
    with pytest.raises(InvalidRequestError, match="stop strings"):
        start(OutputProcessor(None), SamplingParams(stop=["x"]))


# --- aborts ---


def test_abort_by_request_id_returns_running_children(tokenizer, ids):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams(n=2), n=2)
    processor.process([EngineCoreOutput("0_req", ids[:1], "length")])
    assert processor.abort_requests(["req"]) == ["1_req"]
    assert not processor.has_unfinished_requests()
    assert processor.process([EngineCoreOutput("1_req", ids[:1])]).request_outputs == []


def test_duplicate_request_id_is_rejected(tokenizer):
    processor = OutputProcessor(tokenizer)
    start(processor, SamplingParams())
    with pytest.raises(InvalidRequestError, match="already in use"):
        start(processor, SamplingParams())


# --- failure isolation ---


class _BrokenDetokenizer:
    """A detokenizer whose `method` raises (a tokenizer's bug met on some token)."""

    def __init__(self, detokenizer, method: str) -> None:
        self._detokenizer, self._method = detokenizer, method

    def __getattr__(self, name):
        if name == self._method:
            raise RuntimeError(f"detokenizer bug in {name}")
        return getattr(self._detokenizer, name)


@pytest.mark.parametrize("method", ["update", "get_next_output_text"])
@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_failure_in_output_processing_ends_its_request_only(tokenizer, ids, method, kind):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(output_kind=kind)
    start(processor, params, "bad")
    start(processor, params, "good")
    processor.process([EngineCoreOutput("bad", ids[:1], None, None), EngineCoreOutput("good", ids[:1], None, None)])
    completion = processor.requests["bad"].children["bad"]
    completion.detokenizer = _BrokenDetokenizer(completion.detokenizer, method)
    processed = processor.process([EngineCoreOutput("bad", ids[1:2], None, None),
                                   EngineCoreOutput("good", ids[1:2], None, None)])
    assert processed.reqs_failed == ["bad"]  # the engine core aborts it; the step goes on
    bad = next(o for o in processed.request_outputs if o.request_id == "bad")
    assert bad.finished and bad.outputs[0].finish_reason == "abort"
    assert f"detokenizer bug in {method}" in bad.outputs[0].error
    assert "bad" not in processor.requests  # forgotten
    outputs, _ = run(processor, "good", ids[2:])
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "length" and final.error is None
    text = final.text if kind == RequestOutputKind.CUMULATIVE else None
    assert text is None or text == TEXT

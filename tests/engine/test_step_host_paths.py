"""The per-step host shortcuts keep the engine's results: a step whose every row samples (decode) computes its logits
from the hidden states as they are, without gathering the sample rows; any other step gathers them; and each
RequestOutput carries its own copy of the request's metrics."""

from __future__ import annotations

import copy

import pytest

from llmplug import LLM, SamplingParams
from llmplug.core.params import RequestOutputKind
from llmplug.engine.output_processor import EngineCoreOutput, OutputProcessor
from tests.models.tiny_models import make_tiny

from .test_llm import hf_greedy, prompts


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama_host_paths"))


def record_steps(runner, monkeypatch) -> list[dict]:
    """Each step's batch shape, sample rows and how its logits were asked for (rows None: every row, as is)."""
    steps: list[dict] = []
    prepare, compute = runner.prepare_inputs, runner._compute_logits

    def prepare_inputs(reqs, block_tables):
        batch = prepare(reqs, block_tables)
        steps.append({"num_tokens": int(batch.input_ids.numel()), "num_reqs": len(reqs),
                      "every_row": batch.samples_every_row, "sample_indices": batch.sample_indices.tolist()})
        return batch

    def compute_logits(hidden_states, rows, lora_mapping, generated=None):
        if steps and "rows" not in steps[-1]:  # the step's sampling call (prompt logprobs are not asked here)
            steps[-1]["rows"] = rows
            steps[-1]["hidden_rows"] = hidden_states.shape[0]
        logits = compute(hidden_states, rows, lora_mapping, generated)
        steps[-1].setdefault("logit_rows", logits.shape[0])
        return logits

    monkeypatch.setattr(runner, "prepare_inputs", prepare_inputs)
    monkeypatch.setattr(runner, "_compute_logits", compute_logits)
    return steps


@pytest.mark.parametrize("max_num_seqs", [6, 2], ids=["decode_steps", "prefills_beside_decodes"])
def test_decode_steps_take_every_row_as_is_and_greedy_still_matches_hf(tiny_llama, monkeypatch, max_num_seqs):
    # with 2 sequences at a time, later prompts join a step beside the decodes of the running ones (mixed steps)
    llm = LLM(str(tiny_llama.path), dtype="float32", skip_tokenizer_init=True, block_size=4,
              max_num_seqs=max_num_seqs)
    steps = record_steps(llm.llm_engine.engine_core.executor.worker.model_runner, monkeypatch)
    batch = prompts(seed=3)
    max_tokens = [9, 4, 12, 6, 3, 8]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(tiny_llama.hf_model, p, m) for p, m in zip(batch, max_tokens)
    ]
    for step in steps:
        every_row = step["sample_indices"] == list(range(step["num_tokens"]))
        assert step["every_row"] == every_row
        assert (step["rows"] is None) == every_row
        assert step["logit_rows"] == len(step["sample_indices"])
    assert any(s["every_row"] and s["num_reqs"] > 1 for s in steps)  # decode steps of several requests
    assert any(not s["every_row"] for s in steps)  # prompt steps sample their last rows only
    if max_num_seqs == 2:
        mixed = [s for s in steps if s["num_tokens"] > s["num_reqs"] > 1]
        assert mixed and not any(s["every_row"] for s in mixed)


def test_each_output_keeps_the_metrics_it_was_sent_with():
    processor = OutputProcessor(None)
    params = SamplingParams(detokenize=False, output_kind=RequestOutputKind.CUMULATIVE)
    processor.add_request("req", None, [1, 2, 3], params, arrival_time=100.0, child_ids=["req"])
    first = processor.process([EngineCoreOutput("req", [7], first_scheduled_time=101.0)]).request_outputs[0]
    sent = copy.copy(first.metrics)  # what the standard library's copy holds at the time it was sent
    assert sent.first_token_time is not None and sent.last_token_time == sent.first_token_time
    assert first.metrics is not processor.requests["req"].metrics
    for token in (8, 9):
        processor.process([EngineCoreOutput("req", [token])])
    last = processor.process([EngineCoreOutput("req", [10], "length")]).request_outputs[0]
    for name in ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time", "finished_time"):
        assert getattr(first.metrics, name) == getattr(sent, name), name  # later steps left it alone
    assert first.metrics.finished_time is None and last.metrics.finished_time is not None
    assert last.metrics.arrival_time == 100.0 and last.metrics.first_scheduled_time == 101.0
    assert last.metrics.last_token_time >= sent.last_token_time
    assert last.outputs[0].token_ids == [7, 8, 9, 10] and last.finished

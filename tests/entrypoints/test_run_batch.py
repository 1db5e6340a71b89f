"""`llmplug run-batch`: OpenAI Batch API files answered by the server's handlers, one output line per input line
(bad lines as error lines), answers equal to the offline engine's, resuming an interrupted output file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.errors import ConfigError
from llmplug.entrypoints.cli import main
from llmplug.entrypoints.run_batch import load_answered, parse_line
from llmplug.loaders.default_model import resolve_model_path
from llmplug.loaders.gguf import load_gguf_tokenizer
from tests.models.tiny_models import save_tiny_llama

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256"]
MAX_TOKENS = 6
BAD_LINES = {10: "invalid_json_line", 50: "invalid_url", 90: "invalid_request_error"}  # index -> error code


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary and chat template (as the server tests build theirs)."""
    path = tmp_path_factory.mktemp("tiny_batch_model")
    tok = load_gguf_tokenizer(resolve_model_path("SmolLM2-135M-Instruct"))
    save_tiny_llama(path, tok, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    return path


def _request(i: int) -> dict:
    """Line i: a completion (even i) or a chat (odd i), greedy."""
    if i % 2 == 0:
        return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                "body": {"prompt": f"Once upon a time, number {i}", "max_tokens": MAX_TOKENS, "temperature": 0}}
    body = {"messages": [{"role": "user", "content": f"Tell me about the number {i}."}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _input_lines() -> list[str]:
    """100 lines, 3 of them bad: invalid JSON, an unknown url, an invalid body (temperature -1)."""
    lines = [json.dumps(_request(i)) for i in range(100)]
    lines[10] = lines[10][:60]  # cut: not JSON, but its custom_id can still be read
    lines[50] = json.dumps({**_request(50), "url": "/v1/unknown"})
    bad = _request(90)
    bad["body"]["temperature"] = -1
    lines[90] = json.dumps(bad)
    return lines


def _run_batch(input_path: Path, output_path: Path, model: Path, *flags: str) -> int:
    return main(["run-batch", "-i", str(input_path), "-o", str(output_path), "--model", str(model), *ENGINE_FLAGS,
                 "--disable-progress-bar", *flags])


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def batch(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    """(input file, output file) of one full run over the 100 lines."""
    folder = tmp_path_factory.mktemp("batch")
    input_path, output_path = folder / "in.jsonl", folder / "out.jsonl"
    input_path.write_text("\n".join(_input_lines()) + "\n")
    assert _run_batch(input_path, output_path, tiny_model) == 0
    return input_path, output_path


def test_hundred_lines_give_97_answers_and_3_error_lines_in_input_order(batch):
    outputs = _read(batch[1])
    assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in range(100)]
    for i, out in enumerate(outputs):
        if i in BAD_LINES:
            assert out["error"]["code"] == BAD_LINES[i], out
            assert out["error"]["line"] == i + 1 and out["error"]["message"]
        else:
            assert out["error"] is None and out["response"]["status_code"] == 200, out
            assert out["response"]["request_id"] == out["response"]["body"]["id"]
    assert outputs[10]["response"] is None and outputs[50]["response"] is None  # never sent
    refused = outputs[90]["response"]  # sent, and refused by the server's own validation
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"
    assert len({o["id"] for o in outputs}) == 100


def test_answers_equal_the_offline_engine(batch, tiny_model):
    outputs = {o["custom_id"]: o for o in _read(batch[1])}
    llm = LLM(str(tiny_model), dtype="float32", max_model_len=256)
    try:
        indices = [i for i in range(100) if i not in BAD_LINES]
        prompts = [_offline_prompt(llm, _request(i)["body"]) for i in indices]
        expected = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    finally:
        llm.shutdown()
    for i, want in zip(indices, expected):
        body = outputs[f"req-{i}"]["response"]["body"]
        choice = body["choices"][0]
        got = choice["text"] if i % 2 == 0 else choice["message"]["content"]
        assert got == want.outputs[0].text, f"req-{i}"
        assert body["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)


def _offline_prompt(llm: LLM, body: dict):
    return body["prompt"] if "prompt" in body else llm.chat_prompt(body["messages"])


def test_resume_skips_the_answered_lines_and_redoes_a_cut_one(batch, tiny_model, tmp_path, capsys):
    input_path, full_path = batch
    full = full_path.read_text().splitlines(keepends=True)
    partial = tmp_path / "out.jsonl"
    partial.write_text("".join(full[:40]) + full[40][: len(full[40]) // 2])  # interrupted mid-write of line 41
    capsys.readouterr()
    assert _run_batch(input_path, partial, tiny_model) == 0
    resumed = partial.read_text().splitlines(keepends=True)
    assert resumed[:40] == full[:40]  # the first 40 kept as they were, not redone
    outputs = [json.loads(line) for line in resumed]
    assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in range(100)]  # each once: nothing answered twice
    before = {o["custom_id"]: o for o in _read(full_path)}
    for out in outputs[40:]:
        assert _answer_text(out) == _answer_text(before[out["custom_id"]])
    # a third run finds every line answered and writes nothing
    assert _run_batch(input_path, partial, tiny_model) == 0
    assert partial.read_text().splitlines(keepends=True) == resumed
    assert "0 answered, 0 errors, 100 skipped" in capsys.readouterr().err


def _answer_text(out: dict):
    if out["error"] is not None:
        return out["error"]["code"]
    choice = out["response"]["body"]["choices"][0]
    return choice.get("text") or choice["message"]["content"]


def test_resume_counts_the_skipped_lines(batch, tiny_model, tmp_path, capsys):
    input_path, full_path = batch
    partial = tmp_path / "out.jsonl"
    partial.write_text("".join(full_path.read_text().splitlines(keepends=True)[:40]))
    capsys.readouterr()
    assert _run_batch(input_path, partial, tiny_model) == 0
    # 60 lines left: 58 answered by the engine, 2 error lines; the 40 already there not sent again
    assert "58 answered, 2 errors, 40 skipped" in capsys.readouterr().err


def test_embeddings_lines_on_a_pooling_model(tiny_model, tmp_path):
    texts = ["Hello world", "The cat sat on the mat.", "Embeddings map text to vectors."]
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": text}}
             for i, text in enumerate(texts)]
    lines.append(_request(1))  # a chat line: the pooling model refuses it, the others are answered
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    input_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert _run_batch(input_path, output_path, tiny_model, "--runner", "pooling") == 0
    outputs = _read(output_path)
    assert outputs[3]["custom_id"] == "req-1" and outputs[3]["error"]["code"] == "wrong_model_kind"
    llm = LLM(str(tiny_model), dtype="float32", max_model_len=256, runner="pooling")
    try:
        expected = llm.embed(texts, use_tqdm=False)
    finally:
        llm.shutdown()
    for out, want in zip(outputs[:3], expected):
        got = torch.tensor(out["response"]["body"]["data"][0]["embedding"])
        torch.testing.assert_close(got, torch.as_tensor(want.outputs.embedding, dtype=got.dtype), rtol=1e-5,
                                   atol=1e-6)


def test_command_end_to_end_with_a_duplicate_custom_id(tiny_model, tmp_path):
    lines = [_request(0), _request(1), _request(0)]  # the third reuses req-0
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    input_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [sys.executable, "-m", "llmplug.entrypoints.cli", "run-batch", "-i", str(input_path), "-o",
               str(output_path), "--model", str(tiny_model), *ENGINE_FLAGS]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stderr
    outputs = _read(output_path)
    assert [o["custom_id"] for o in outputs] == ["req-0", "req-1", "req-0"]
    assert outputs[0]["response"]["status_code"] == 200 and outputs[1]["response"]["status_code"] == 200
    assert outputs[2]["response"] is None and outputs[2]["error"]["code"] == "duplicate_custom_id"
    assert "run-batch: 2 answered, 1 errors, 0 skipped" in done.stderr


# --- no engine: reading lines and output files ---------------------------------------------------


def test_bad_lines_are_named_by_number_and_custom_id():
    cut = parse_line(3, '{"custom_id": "a\\"b", "method": "POST", "url": "/v1/comp')
    assert cut.custom_id == 'a"b' and cut.error["code"] == "invalid_json_line" and cut.error["line"] == 3
    assert parse_line(1, "[1, 2]").error["code"] == "invalid_json_line"
    assert parse_line(1, '{"url": "/v1/completions", "body": {}}').error["code"] == "missing_required_parameter"
    get = parse_line(1, '{"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}')
    assert get.error["code"] == "invalid_method"
    stream = parse_line(1, '{"custom_id": "x", "url": "/v1/completions", "body": {"stream": true}}')
    assert stream.error["code"] == "invalid_request"
    good = parse_line(7, json.dumps(_request(2)))
    assert good.error is None and good.url == "/v1/completions" and good.custom_id == "req-2"


def test_resume_drops_a_cut_last_line_and_refuses_a_corrupt_middle_one(tmp_path):
    path = tmp_path / "out.jsonl"
    whole = json.dumps({"custom_id": "a", "response": {}, "error": None})
    no_id = json.dumps({"custom_id": None, "response": None, "error": {"code": "invalid_json_line", "line": 4}})
    path.write_text(f"{whole}\n{no_id}\n{whole[:20]}")
    answered = load_answered(path)
    assert answered.custom_ids == {"a"} and answered.lines == {4}
    assert path.read_text() == f"{whole}\n{no_id}\n"
    path.write_text(f"{whole[:20]}\n{whole}\n")
    with pytest.raises(ConfigError, match="line 1 is not valid JSON"):
        load_answered(path)

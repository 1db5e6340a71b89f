"""`llmplug bench serve|throughput|latency` on a tiny model with tiny sizes: each prints vLLM's summary, and its
numbers agree with what was asked (requests, prompt and generated tokens). No assertion on speed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llmplug import AsyncLLM
from llmplug.entrypoints.bench.metrics import percentile
from llmplug.entrypoints.cli import main
from llmplug.loaders.default_model import resolve_model_path
from llmplug.loaders.gguf import load_gguf_tokenizer
from tests.entrypoints.openai.conftest import serve
from tests.models.tiny_models import save_tiny_llama

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary, saved with its tokenizer."""
    path = tmp_path_factory.mktemp("tiny_bench_model")
    tok = load_gguf_tokenizer(resolve_model_path("SmolLM2-135M-Instruct"))
    save_tiny_llama(path, tok, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    return path


def _fields(text: str) -> dict[str, str]:
    """`Name:   value` lines of a summary, by name."""
    return {m.group(1).strip(): m.group(2) for m in re.finditer(r"^([^:\n]+):\s+(\S+)\s*$", text, re.M)}


def test_bench_throughput_prints_vllms_line_with_every_token_counted(tiny_model, tmp_path, capsys):
    results = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", str(tiny_model), *ENGINE_FLAGS, "--input-len", "8",
                 "--output-len", "4", "--num-prompts", "5", "--disable-tqdm", "--output-json", str(results)]) == 0
    out = capsys.readouterr().out
    found = re.search(r"^Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s$", out,
                      re.M)
    assert found, out
    assert "Total num prompt tokens:  40" in out and "Total num output tokens:  20" in out
    data = json.loads(results.read_text())
    assert data["num_requests"] == 5 and data["total_num_tokens"] == 60 and data["total_output_tokens"] == 20
    requests_per_s, total_per_s, output_per_s = map(float, found.groups())
    assert requests_per_s == pytest.approx(5 / data["elapsed_time"], rel=0.01, abs=0.01)
    assert total_per_s == pytest.approx(3 * output_per_s, rel=0.01, abs=0.02)  # 60 tokens in all, 20 generated


def test_bench_latency_prints_the_average_and_percentiles_of_each_iteration(tiny_model, tmp_path, capsys):
    results = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(tiny_model), *ENGINE_FLAGS, "--input-len", "8", "--output-len",
                 "4", "--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3", "--disable-tqdm",
                 "--output-json", str(results)]) == 0
    out = capsys.readouterr().out
    data = json.loads(results.read_text())
    assert len(data["latencies"]) == 3
    assert re.search(r"^Avg latency: ([\d.e-]+) seconds$", out, re.M).group(1) == str(data["avg_latency"])
    for q in (10, 25, 50, 75, 90, 99):
        printed = float(re.search(rf"^{q}% percentile latency: ([\d.e-]+) seconds$", out, re.M).group(1))
        assert printed == pytest.approx(percentile(data["latencies"], q))
        assert min(data["latencies"]) <= printed <= max(data["latencies"])


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = AsyncLLM(str(tiny_model), dtype="float32", max_model_len=256)
    try:
        with serve(engine) as running:
            yield running
    finally:
        engine.shutdown()


@pytest.mark.parametrize("load", [["--max-concurrency", "3"], ["--request-rate", "50"]], ids=["concurrency", "rate"])
def test_bench_serve_prints_vllms_summary_with_the_requests_and_tokens_asked_for(server, tiny_model, tmp_path,
                                                                                 capsys, load):
    results = tmp_path / "serve.json"
    assert main(["bench", "serve", "--base-url", server.base_url, "--model", server.model, "--tokenizer",
                 str(tiny_model), "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "8",
                 "--random-output-len", "5", "--disable-tqdm", "--save-result", str(results), *load]) == 0
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    fields = _fields(out)
    assert fields["Successful requests"] == "6" and fields["Failed requests"] == "0"
    assert fields["Total input tokens"] == "48" and fields["Total generated tokens"] == "30"  # ignore_eos
    data = json.loads(results.read_text())
    duration = data["duration"]  # the printed one is rounded to 10 ms
    assert float(fields["Benchmark duration (s)"]) == pytest.approx(duration, abs=0.006)
    assert float(fields["Request throughput (req/s)"]) == pytest.approx(6 / duration, abs=0.006)
    assert float(fields["Output token throughput (tok/s)"]) == pytest.approx(30 / duration, abs=0.006)
    assert float(fields["Total Token throughput (tok/s)"]) == pytest.approx(78 / duration, abs=0.006)
    for name in ("TTFT", "TPOT", "ITL", "E2EL"):
        for stat in ("Mean", "Median", "P99"):
            assert float(fields[f"{stat} {name} (ms)"]) >= 0
    assert float(fields["Mean TTFT (ms)"]) <= float(fields["Mean E2EL (ms)"])
    assert data["output_lens"] == [5] * 6 and data["errors"] == []
    if "--max-concurrency" in load:
        assert fields["Maximum request concurrency"] == "3"
    else:
        assert fields["Request rate configured (RPS)"] == "50.00"

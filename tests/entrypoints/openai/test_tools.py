"""Tool calling through the real openai client against the real server (tiny model, SmolLM2's tokenizer).

The tiny model's context is short (256 tokens, most of it the tools' description), so forced calls here
are single (parallel_tool_calls=False); parallel calls are shown on the default model (test_tools_default_model).

Forced calls (tool_choice "required" or a named function) must validate against the tools' schemas
(checked with jsonschema); "auto" calls are read by the server's tool parser, here from outputs that a
regex constraint makes the model write; tool results go back through the chat template exactly as
transformers renders them.
"""

from __future__ import annotations

import json
import logging

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from llmplug import LLM, AsyncLLM, SamplingParams
from llmplug.entrypoints.openai.api_server import ServerSettings
from tests.models.tiny_models import save_tiny_llama
from tests.plugin_examples import pip_install_examples

from .conftest import ENGINE_KWARGS, serve

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city for some days.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                            "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
CLOCK = {
    "name": "now",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                   "required": ["zone"], "additionalProperties": False},
}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}]
SCHEMAS = {"get_weather": WEATHER["parameters"], "now": CLOCK["parameters"]}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


def check_calls(calls) -> None:
    """Every call names a tool and its arguments validate against that tool's schema."""
    assert calls, "the answer has tool calls"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """The calls added up from the chunks' tool-call deltas (OpenAI's form), the finish reason, the content."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.type == "function" and delta.function.name, "the first delta of a call"
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("seed", range(3))
def test_required_tool_choice_gives_valid_calls(server, seed):
    reply = server.client().chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS,
                                                    tool_choice="required", temperature=1.0, seed=seed,
                                                    parallel_tool_calls=False)
    choice = reply.choices[0]
    check_calls(choice.message.tool_calls)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_required_tool_choice_streams_the_same_calls(server):
    kwargs = dict(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0,
                  seed=11, parallel_tool_calls=False)
    whole = server.client().chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls, finish, content = streamed_calls(server.client().chat.completions.create(stream=True, **kwargs))
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in whole]
    assert finish == "tool_calls" and content == ""
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_named_function_and_no_parallel_calls(server):
    client = server.client()
    named = {"type": "function", "function": {"name": "now"}}
    for stream in (False, True):
        reply = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                               temperature=1.0, seed=5, max_tokens=60, stream=stream)
        if stream:
            calls, _, _ = streamed_calls(reply)
        else:
            calls = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in reply.choices[0].message.tool_calls]
        assert [c["name"] for c in calls] == ["now"]
        jsonschema.validate(json.loads(calls[0]["arguments"]), CLOCK["parameters"])
    single = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=1.0, seed=2)
    assert len(single.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("extra, named", [
    ({"tools": TOOLS}, "--enable-auto-tool-choice"),  # "auto" is the default with tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "at most one structured-output constraint; got response_format, tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "not a valid JSON schema"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments must be a JSON object"),
])
def test_bad_tool_requests_get_a_400_and_the_next_request_works(server, extra, named):
    client = server.client()
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 5, **extra}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**body)
    assert named in str(error.value)
    ok = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, seed=0)
    check_calls(ok.choices[0].message.tool_calls)


# --- tool_choice "auto": the hermes parser reads what the model writes ------------------------------------------

CALL_REGEX = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'


@pytest.fixture(scope="module")
def hermes_server(engine):
    """The same engine served with --tool-call-parser hermes --enable-auto-tool-choice."""
    with serve(engine, ServerSettings(tool_call_parser="hermes", enable_auto_tool_choice=True)) as running:
        yield running


def test_auto_tool_choice_reads_the_calls_the_model_writes(hermes_server):
    client = hermes_server.client()
    kwargs = dict(model=hermes_server.model, messages=MESSAGES, tools=TOOLS[:1], temperature=1.0, seed=4,
                  extra_body={"structured_outputs": {"regex": CALL_REGEX}})
    reply = client.chat.completions.create(**kwargs).choices[0]
    check_calls(reply.message.tool_calls)
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    calls, finish, content = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in reply.message.tool_calls]
    assert finish == "tool_calls" and content == ""


def test_malformed_call_from_the_model_is_returned_as_content(hermes_server):
    client = hermes_server.client()
    broken = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": \}\}</tool_call>'
    kwargs = dict(model=hermes_server.model, messages=MESSAGES, tools=TOOLS[:1],
                  extra_body={"structured_outputs": {"regex": broken}})
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.message.content == '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'
    assert reply.message.tool_calls is None and reply.finish_reason == "stop"
    _, finish, _ = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert finish in ("stop", "tool_calls")
    plain = client.chat.completions.create(model=hermes_server.model, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                           temperature=0)
    assert plain.choices[0].finish_reason == "length"  # text without calls: content as usual


# --- tool results through the chat template ---------------------------------------------------------------------

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<tool_response>{{ m.tool_call_id }}: {{ m.content }}</tool_response>"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HISTORY = [
    *MESSAGES,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Paris", "days": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C."},
]


@pytest.fixture(scope="module")
def tool_template_model(tmp_path_factory, smollm_tokenizer):
    """The tiny model again, with a chat template that renders tools, calls and tool results."""
    path = tmp_path_factory.mktemp("tiny_tool_template")
    tok = smollm_tokenizer
    save_tiny_llama(path, tok, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    hf = AutoTokenizer.from_pretrained(path)
    hf.chat_template = TOOL_TEMPLATE
    hf.save_pretrained(path)
    return path


def test_tool_results_round_trip_through_a_template_that_takes_tools(tool_template_model, server):
    hf = AutoTokenizer.from_pretrained(tool_template_model)
    structured = [dict(m, content=m["content"] or "") for m in HISTORY]
    structured[1]["tool_calls"] = [dict(structured[1]["tool_calls"][0], function={
        "name": "get_weather", "arguments": {"city": "Paris", "days": 3}})]  # templates take arguments as objects
    expected_prompt = hf.apply_chat_template(structured, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>call_1: Sunny, 24 C.</tool_response>" in expected_prompt
    server.wait_idle()
    llm = LLM(str(tool_template_model), **ENGINE_KWARGS)
    expected = llm.generate([expected_prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    engine = AsyncLLM.from_engine(llm.llm_engine, "tool-template")
    try:
        with serve(engine) as running:
            reply = running.client().chat.completions.create(model=running.model, messages=HISTORY, tools=TOOLS,
                                                             tool_choice="none", temperature=0, max_tokens=6)
    finally:
        engine.shutdown()
    assert reply.usage.prompt_tokens == len(hf(expected_prompt, add_special_tokens=False)["input_ids"])
    assert reply.choices[0].message.content == expected.outputs[0].text


def test_tool_results_round_trip_through_the_documented_fallback(server, smollm_tokenizer):
    """SmolLM2's template knows no tools: the tools go into the system message, the call into the assistant's
    text as the JSON array tool_choice="required" makes, and the tool result keeps its role."""
    system = ("You can call these functions (each given as a JSON schema):\n" + "\n".join(
        json.dumps(t["function"]) for t in TOOLS)
        + "\nCall the function now: answer with its arguments as a JSON object.")
    by_hand = [{"role": "system", "content": system}, *MESSAGES,
               {"role": "assistant", "content": '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}]'},
               {"role": "tool", "content": "Sunny, 24 C."}]
    expected_prompt = smollm_tokenizer.apply_chat_template(by_hand, tokenize=False, add_generation_prompt=True)
    reply = server.client().chat.completions.create(
        model=server.model, messages=HISTORY, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}},
        temperature=0)
    assert reply.usage.prompt_tokens == len(smollm_tokenizer(expected_prompt, add_special_tokens=False)["input_ids"])
    check_calls(reply.choices[0].message.tool_calls)


# --- unknown fields ---------------------------------------------------------------------------------------------


def test_unknown_fields_are_logged_and_change_nothing(server, offline, caplog):
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    with caplog.at_level(logging.WARNING, logger="llmplug.entrypoints.openai.serving_engine"):
        reply = server.client().chat.completions.create(
            model=server.model, messages=[dict(MESSAGES[0], mood="happy")], temperature=0, max_tokens=5,
            extra_body={"guided_jsonn": {"type": "object"}, "frobnicate": True})
    assert reply.choices[0].message.content == expected.text
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "guided_jsonn" in logged and "frobnicate" in logged and "messages[0].mood" in logged


# --- /v1/responses ----------------------------------------------------------------------------------------------

RESPONSES_TOOLS = [{"type": "function", **WEATHER}, {"type": "function", **CLOCK}]


def test_responses_required_tool_choice_gives_function_call_items(server):
    client = server.client()
    kwargs = dict(model=server.model, input=MESSAGES[0]["content"], tools=RESPONSES_TOOLS, tool_choice="required",
                  parallel_tool_calls=False, temperature=1.0, extra_body={"seed": 8})
    response = client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and response.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = events[-1].response.output[0]
    assert (done.name, done.arguments) == (calls[0].name, calls[0].arguments) == (events[2].item.name, arguments)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_call_output_round_trips(server, smollm_tokenizer):
    """A call and its result as input items render as the chat messages they stand for."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris", "days": 3}'}
    items = [MESSAGES[0], call, {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 C."}]
    named = {"type": "function", "name": "now"}
    response = server.client().responses.create(model=server.model, input=items, tools=RESPONSES_TOOLS,
                                                tool_choice=named, temperature=0)
    chat = server.client().chat.completions.create(model=server.model, messages=HISTORY, tools=TOOLS, temperature=0,
                                                   tool_choice={"type": "function", "function": {"name": "now"}})
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output[0].arguments == chat.choices[0].message.tool_calls[0].function.arguments


# --- a third-party tool parser, by entry point alone ------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_parser_site(tmp_path_factory):
    """tests/plugins/toy_tool_parser, pip-installed as users install plugins."""
    site = tmp_path_factory.mktemp("tool_parser_site")
    pip_install_examples(["toy_tool_parser"], site, tmp_path_factory.mktemp("tool_parser_sources"))
    return site


def test_a_pip_installed_tool_parser_is_used_by_its_entry_point_name(toy_parser_site, engine, monkeypatch):
    monkeypatch.syspath_prepend(str(toy_parser_site))
    registry = engine.llm_engine.registry  # the server takes its parsers from the engine's plugins
    registry.refresh()
    [info] = [i for i in registry.infos("llmplug.tool_parsers") if i.name == "toy_arrows"]
    assert (info.distribution, info.builtin) == ("llmplug-example-toy-tool-parser", False)
    settings = ServerSettings(tool_call_parser="toy_arrows", enable_auto_tool_choice=True)
    with serve(engine, settings) as running:
        kwargs = dict(model=running.model, messages=MESSAGES, tools=TOOLS[:1], temperature=1.0, seed=1,
                      extra_body={"structured_outputs": {"regex": r'Ok\.\n>>>get_weather\n\{"city": "Rome", "days": [1-7]\}'}})
        reply = running.client().chat.completions.create(**kwargs).choices[0]
        calls, finish, content = streamed_calls(running.client().chat.completions.create(stream=True, **kwargs))
    assert reply.message.content == "Ok.\n" == content
    check_calls(reply.message.tool_calls)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in reply.message.tool_calls]
    assert finish == reply.finish_reason == "tool_calls"


def test_auto_calls_beyond_the_first_are_dropped_without_parallel_tool_calls(hermes_server):
    two = (r'<tool_call>\{"name": "now", "arguments": \{"zone": "UTC"\}\}</tool_call>'
           r'<tool_call>\{"name": "now", "arguments": \{"zone": "CET"\}\}</tool_call>')
    kwargs = dict(model=hermes_server.model, messages=MESSAGES, tools=TOOLS[1:],
                  extra_body={"structured_outputs": {"regex": two}})
    both = hermes_server.client().chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["zone"] for c in both] == ["UTC", "CET"]
    first = hermes_server.client().chat.completions.create(parallel_tool_calls=False, **kwargs)
    assert [json.loads(c.function.arguments)["zone"] for c in first.choices[0].message.tool_calls] == ["UTC"]
    calls, finish, _ = streamed_calls(hermes_server.client().chat.completions.create(
        parallel_tool_calls=False, stream=True, **kwargs))
    assert [json.loads(c["arguments"])["zone"] for c in calls] == ["UTC"] and finish == "tool_calls"

"""Tools in chat and responses requests: what `tool_choice` asks, the grammar that forces a call, tools in
the chat template, and which parser reads the calls out of the answer.

- `tool_choice="required"` and a named function are enforced with guided decoding, as vLLM does: the
  answer must follow a JSON schema built from the tools' parameter schemas (required: an array of
  `{"name", "parameters"}` objects, one of the tools each; named: that function's arguments object), so
  every call is valid. `RequiredCallsParser` and `NamedCallParser` read those answers.
- `tool_choice="auto"` (OpenAI's default when tools are given) lets the model decide; its calls are read
  by the server's `--tool-call-parser`, and it needs `--enable-auto-tool-choice`.
- A chat template that renders tools (it uses the `tools` variable) gets them, with earlier calls as
  structured `tool_calls`. One that does not gets a fallback: the tools, as JSON schemas, and how to call
  them, in the system message; earlier calls written into the assistant's text as the JSON array that
  `tool_choice="required"` produces. A fallback rather than a 400, so that models whose template knows
  no tools (the default SmolLM2 among them) still serve forced calls, which the grammar makes valid.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Sequence

from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.guided import Constraint
from llmplug.plugins.partial_text import skip_space
from llmplug.plugins.tool_parsers.base import (
    START,
    PartialCall,
    Resume,
    Snapshot,
    ToolParser,
    json_value_end,
    read_json_calls,
)

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """The tools of one request (function definitions) and what its tool_choice asks."""

    tools: list[dict[str, Any]]
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the function of mode "named"
    parallel: bool = True


def tool_choice(tools: Sequence[Any] | None, choice: Any, named: str | None, parallel: bool,
                auto_enabled: bool) -> ToolChoice | None:
    """The request's tool choice, or None without tools; a 400 for a choice the tools or server cannot meet.

    `tools`: FunctionDefinition-like objects; `choice`: "none" | "auto" | "required" | None; `named`: the
    function a named tool_choice names.
    """
    if not tools:
        if choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice needs tools: the request has none", param="tool_choice")
        return None
    definitions = [_definition(tool) for tool in tools]
    names = [d["name"] for d in definitions]
    if len(set(names)) != len(names):
        raise OpenAIError(400, f"tools have duplicate names: {names}", param="tools")
    if named is not None:
        if named not in names:
            raise OpenAIError(400, f"tool_choice names the function {named!r}, which is not among the tools "
                                   f"({', '.join(names)})", param="tool_choice")
        return ToolChoice(definitions, "named", named, parallel)
    mode = choice or "auto"
    if mode == "auto" and not auto_enabled:
        raise OpenAIError(400, 'tool_choice "auto" (the default when tools are given) needs the server started with '
                               "--enable-auto-tool-choice and --tool-call-parser; or send tool_choice \"required\", a "
                               'named function, or "none"', param="tool_choice")
    return ToolChoice(definitions, mode, None, parallel)


def _definition(tool: Any) -> dict[str, Any]:
    description = {"description": tool.description} if tool.description else {}
    return {"name": tool.name, **description, "parameters": tool.parameters or EMPTY_PARAMETERS}


def forced_call_constraint(choice: ToolChoice) -> Constraint | None:
    """The JSON-schema constraint that makes the answer a valid call (required, named), else None."""
    if choice.mode == "named":
        return Constraint("tool_choice", "json", _function(choice, choice.name)["parameters"])
    if choice.mode == "required":
        return Constraint("tool_choice", "json", required_calls_schema(choice.tools, choice.parallel))
    return None


def _function(choice: ToolChoice, name: str) -> dict[str, Any]:
    return next(tool for tool in choice.tools if tool["name"] == name)


def required_calls_schema(tools: Sequence[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each `{"name": <a tool's name>, "parameters": <its arguments>}`; one call when
    `parallel` is False. The tools' `$defs` move to the top, where their `$ref`s point."""
    defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        parameters = copy.deepcopy(tool["parameters"])
        for key, value in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise OpenAIError(400, f"tools define $defs/{key} differently; tool_choice \"required\" needs one "
                                       "meaning per definition", param="tools")
        options.append({"properties": {"name": {"type": "string", "enum": [tool["name"]]}, "parameters": parameters},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class RequiredCallsParser(ToolParser):
    """Reads the JSON array of calls that `tool_choice="required"` forces."""

    name = "required"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return self.snapshot_after(text, final, START)

    def snapshot_after(self, text: str, final: bool, resume: Resume) -> Snapshot:
        """The whole array read at every delta, but each call's JSON scanned once (the scans go on where they
        stopped)."""
        scans = resume.state if resume.state is not None else {}
        start = skip_space(text, 0)
        if start == len(text):
            return Snapshot("", resume=Resume(state=scans))
        calls, _ = read_json_calls(text, start, final, scans)
        return Snapshot("", tuple(calls), resume=Resume(state=scans))


class NamedCallParser(ToolParser):
    """Reads the arguments object that a named tool_choice forces: the whole answer is the call's arguments."""

    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return self.snapshot_after(text, final, START)

    def snapshot_after(self, text: str, final: bool, resume: Resume) -> Snapshot:
        """The whole answer read at every delta, but its JSON scanned once (the scan goes on where it stopped)."""
        scans = resume.state if resume.state is not None else {}
        start = skip_space(text, 0)
        end = json_value_end(text, start, scans) if start < len(text) else None
        call = PartialCall(self.function, text[start:end], complete=end is not None)
        return Snapshot("", (call,), resume=Resume(state=scans))


def reply_tool_parser(choice: ToolChoice | None, auto_parser: type[ToolParser] | None) -> ToolParser | None:
    """The parser that reads this request's calls out of the answer; None when it may make none."""
    if choice is None or choice.mode == "none":
        return None
    if choice.mode == "named":
        return NamedCallParser(choice.name)
    if choice.mode == "required":
        return RequiredCallsParser(choice.tools)
    return auto_parser(choice.tools)


# --- the chat template ----------------------------------------------------------------------------------------------


def template_takes_tools(template: str | None) -> bool:
    """True when the chat template uses the `tools` variable (so it renders the tools itself)."""
    if not isinstance(template, str):
        return False
    import jinja2
    import jinja2.meta
    import jinja2.sandbox

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(environment.parse(template))
    except jinja2.TemplateSyntaxError:
        return False  # rendering reports it


def template_input(messages: list[dict[str, Any]], choice: ToolChoice | None, takes_tools: bool,
                   format_hint: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template arguments that put the tools and earlier calls into the prompt."""
    if takes_tools:
        rendered = [_structured_calls(message, i) for i, message in enumerate(messages)]
        tools = [{"type": "function", "function": tool} for tool in choice.tools] if choice else None
        return rendered, ({"tools": tools} if tools else {})
    rendered = [_calls_as_text(message, i) for i, message in enumerate(messages)]
    if choice is not None:
        rendered = _with_system_text(rendered, _fallback_prompt(choice, format_hint))
    return rendered, {}


def _structured_calls(message: dict[str, Any], index: int) -> dict[str, Any]:
    """An assistant message's calls with their arguments as objects, as chat templates expect them."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for j, call in enumerate(message["tool_calls"]):
        function = dict(call["function"], arguments=_arguments(call["function"]["arguments"],
                                                               f"messages[{index}].tool_calls[{j}].function.arguments"))
        calls.append(dict(call, function=function))
    return dict(message, tool_calls=calls, content=message.get("content") or "")


def _arguments(text: str, param: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise OpenAIError(400, f"{param} must be a JSON object, got {text!r}", param=param)
    return value


def _calls_as_text(message: dict[str, Any], index: int) -> dict[str, Any]:
    """For a template without tools: an assistant's calls as text (the array tool_choice="required" makes)."""
    if not message.get("tool_calls"):
        return {key: value for key, value in message.items() if key != "tool_call_id"}
    where = f"messages[{index}].tool_calls"
    calls = [{"name": c["function"]["name"],
              "parameters": _arguments(c["function"]["arguments"], f"{where}[{j}].function.arguments")}
             for j, c in enumerate(message["tool_calls"])]
    text = "\n".join(part for part in (message.get("content") or "", json.dumps(calls)) if part)
    return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": text}


def _fallback_prompt(choice: ToolChoice, format_hint: str) -> str:
    tools = "\n".join(json.dumps(tool) for tool in choice.tools)
    how = {
        "none": "Do not call any function now.",
        "auto": format_hint,
        "required": 'Call one or more functions: answer with a JSON array [{"name": <function name>, '
                    '"parameters": <arguments object>}].',
        "named": f"Call the function {choice.name}: answer with its arguments as a JSON object.",
    }[choice.mode]
    return f"You can call these functions (each given as a JSON schema):\n{tools}\n{how}".rstrip()


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        return [dict(messages[0], content=f"{messages[0]['content']}\n\n{text}"), *messages[1:]]
    return [{"role": "system", "content": text}, *messages]

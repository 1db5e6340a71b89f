"""The structured-output fields of OpenAI requests as one GuidedDecodingParams.

Chat and completions take OpenAI's `response_format` ({"type": "json_schema", "json_schema": {"schema":
...}} or {"type": "json_object"}), vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar" |
"json_object" | "structural_tag": ...}) and vLLM's older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` (with `guided_decoding_backend`); the Responses API takes `text.format`. A tool choice
that forces a call (chat and responses) is a constraint too. At most one constraint per request: two
are a 400 that names both.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import GuidedDecodingParams
from llmplug.entrypoints.openai.errors import OpenAIError

# vLLM's request field -> the GuidedDecodingParams field it sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# structured_outputs' fields that are constraints (the GuidedDecodingParams field of the same name)
STRUCTURED_KINDS = {"json_": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "structural_tag": "structural_tag"}


class Constraint(NamedTuple):
    """One constraint a request asks for: the request field, the GuidedDecodingParams field and its value."""

    param: str
    kind: str
    value: Any


def guided_decoding_params(request: Any, forced: Constraint | None = None,
                           start_after_token_ids: tuple[int, ...] = ()) -> GuidedDecodingParams | None:
    """The request's constraint (or `forced`, the one a tool choice adds), or None; a 400 naming the field
    when it is malformed or when two are set. `start_after_token_ids`: where the constraint begins (the end
    of the model's reasoning)."""
    found = [Constraint(name, kind, getattr(request, name, None)) for name, kind in GUIDED_FIELDS.items()]
    found = [item for item in found if item.value is not None] + _structured_outputs(request)
    response_format = _response_format(request)
    if response_format is not None:
        found.append(response_format)
    if forced is not None:
        found.append(forced)
    if not found:
        _check_nothing_to_configure(request)
        return None
    if len(found) > 1:
        names = ", ".join(item.param for item in found)
        raise OpenAIError(400, f"set at most one structured-output constraint; got {names}", param=found[1].param)
    constraint = found[0]
    try:
        return GuidedDecodingParams(**{constraint.kind: constraint.value},
                                    backend=getattr(request, "guided_decoding_backend", None),
                                    whitespace_flexible=_whitespace_flexible(request),
                                    start_after_token_ids=start_after_token_ids)
    except InvalidRequestError as exc:
        raise OpenAIError(400, str(exc), param=constraint.param) from exc


def _check_nothing_to_configure(request: Any) -> None:
    """400 for a request that configures a constraint it does not set: the setting would be ignored."""
    if getattr(request, "guided_decoding_backend", None) is not None:
        raise OpenAIError(400, "guided_decoding_backend names a backend, but the request sets no constraint for it "
                               "(guided_json, structured_outputs, response_format, ...)",
                          param="guided_decoding_backend")
    if getattr(request, "structured_outputs", None) is not None:
        raise OpenAIError(400, "structured_outputs sets no constraint (json, json_object, regex, choice, grammar or "
                               "structural_tag)", param="structured_outputs")


def _structured_outputs(request: Any) -> list[Constraint]:
    """The constraints set in `structured_outputs` (json_object counts when true)."""
    outputs = getattr(request, "structured_outputs", None)
    if outputs is None:
        return []
    found = []
    for field, kind in STRUCTURED_KINDS.items():
        value = getattr(outputs, field)
        if value is not None and value is not False:
            found.append(Constraint(f"structured_outputs.{kind}", kind, value))
    return found


def _whitespace_flexible(request: Any) -> bool | None:
    outputs = getattr(request, "structured_outputs", None)
    if outputs is None or outputs.disable_any_whitespace is None:
        return None  # the engine's decoding.compact_json decides
    return not outputs.disable_any_whitespace


def _response_format(request: Any) -> Constraint | None:
    """The constraint of response_format / text.format; None for text."""
    if getattr(request, "response_format", None) is not None:
        fmt, param = request.response_format, "response_format"
        schema_holder = fmt.json_schema
    elif getattr(request, "text", None) is not None and request.text.format is not None:
        fmt, param = request.text.format, "text.format"
        schema_holder = fmt
    else:
        return None
    if fmt.type == "json_object":
        return Constraint(param, "json_object", True)
    if fmt.type == "json_schema":
        if schema_holder is None or schema_holder.schema_ is None:
            where = f"{param}.json_schema.schema" if param == "response_format" else f"{param}.schema"
            raise OpenAIError(400, f"{where} is required with type 'json_schema'", param=param)
        return Constraint(param, "json", schema_holder.schema_)
    return None

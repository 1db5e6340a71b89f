"""The structured-output fields of OpenAI requests as one GuidedDecodingParams.

Chat and completions take OpenAI's `response_format` ({"type": "json_schema", "json_schema": {"schema":
...}} or {"type": "json_object"}) and vLLM's extras `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` (with `guided_decoding_backend`); the Responses API takes `text.format`. At most one
constraint per request.
"""

from __future__ import annotations

from typing import Any

from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import GuidedDecodingParams
from llmplug.entrypoints.openai.errors import OpenAIError

# vLLM's request field -> the GuidedDecodingParams field it sets
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def guided_decoding_params(request: Any) -> GuidedDecodingParams | None:
    """The request's constraint, or None; a 400 naming the field when it is malformed or doubled."""
    found = [(name, kind, getattr(request, name, None)) for name, kind in GUIDED_FIELDS.items()]
    found = [item for item in found if item[2] is not None]
    response_format = _response_format(request)
    if response_format is not None:
        found.append(response_format)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(param for param, _, _ in found)
        raise OpenAIError(400, f"set at most one structured-output constraint; got {names}", param=found[1][0])
    param, kind, value = found[0]
    try:
        return GuidedDecodingParams(**{kind: value}, backend=getattr(request, "guided_decoding_backend", None))
    except InvalidRequestError as exc:
        raise OpenAIError(400, str(exc), param=param) from exc


def _response_format(request: Any) -> tuple[str, str, Any] | None:
    """(param, GuidedDecodingParams field, value) of response_format / text.format; None for text."""
    if getattr(request, "response_format", None) is not None:
        fmt, param = request.response_format, "response_format"
        schema_holder = fmt.json_schema
    elif getattr(request, "text", None) is not None and request.text.format is not None:
        fmt, param = request.text.format, "text.format"
        schema_holder = fmt
    else:
        return None
    if fmt.type == "json_object":
        return param, "json_object", True
    if fmt.type == "json_schema":
        if schema_holder is None or schema_holder.schema_ is None:
            where = f"{param}.json_schema.schema" if param == "response_format" else f"{param}.schema"
            raise OpenAIError(400, f"{where} is required with type 'json_schema'", param=param)
        return param, "json", schema_holder.schema_
    return None

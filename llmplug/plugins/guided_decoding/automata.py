"""The size of the automata that outlines and lm-format-enforcer build whole from a constraint.

Both turn a regex (a JSON schema's regex, a schema's `pattern`s) into a deterministic automaton before
anything is generated, and its number of states can grow exponentially with the regex's length:
`(a|b)*a(a|b){16}` has 2^17. These functions build the automaton as the library does, with light imports
(no torch, no tokenizer), so that the engine can run them in its grammar sandbox: a separate process under
a time budget (see `llmplug.engine.grammar_sandbox`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from llmplug.core.params import GuidedDecodingParams
from llmplug.plugins.guided_decoding.common import choice_regex

__all__ = ["fsm_states", "outlines_index_states", "outlines_regex", "schema_patterns"]


def outlines_regex(constraint: GuidedDecodingParams) -> str:
    """The regex outlines compiles for `constraint` (a JSON schema becomes one first)."""
    from outlines_core.json_schema import build_regex_from_schema

    kind = constraint.kind
    if kind in ("json", "json_object"):
        whitespace = None if constraint.whitespace_flexible else ""
        return build_regex_from_schema(json.dumps(constraint.schema), whitespace_pattern=whitespace)
    if kind == "regex":
        return constraint.regex
    return choice_regex(constraint.choice)


def outlines_index_states(constraint: GuidedDecodingParams) -> int:
    """States of outlines' index of the constraint, built over single bytes (its states are the regex's DFA's)."""
    import outlines_core

    return len(outlines_core.Index(outlines_regex(constraint), _byte_vocabulary()).get_transitions())


@lru_cache(maxsize=1)
def _byte_vocabulary() -> Any:
    """Every single byte as a token (outlines_core.Vocabulary): its index has the states of the real one."""
    import outlines_core

    return outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


def fsm_states(constraint: GuidedDecodingParams) -> int:
    """States of the interegular automata lm-format-enforcer builds: the regex's, or each `pattern` of a schema."""
    import interegular

    if constraint.kind in ("json", "json_object"):
        regexes = list(schema_patterns(constraint.schema))
    else:
        regexes = [constraint.regex if constraint.kind == "regex" else choice_regex(constraint.choice)]
    return sum(len(interegular.parse_pattern(regex).to_fsm().states) for regex in regexes)


def schema_patterns(schema: Any) -> Iterator[str]:
    """Every string `pattern` in a JSON schema, however deep."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            else:
                yield from schema_patterns(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from schema_patterns(item)

"""The `xgrammar` guided-decoding backend: JSON schema, JSON object, regex, choice, EBNF grammars and structural tags."""

from __future__ import annotations

import json

import torch
import xgrammar as xgr

from llmplug.core.params import GuidedDecodingParams
from llmplug.plugins.guided_decoding.common import EBNF_GRAMMAR, Compiled, GuidedBackendBase, choice_regex

LLMPLUG_PLUGIN_API_VERSION = "1.1"


class XGrammarMatcher:
    """One request's xgrammar matcher; it terminates after accepting the end-of-sequence token."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token."""
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens."""
        self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """True after the end-of-sequence token."""
        return self._matcher.is_terminated()


class XGrammarBackend(GuidedBackendBase):
    """Guided decoding with xgrammar (grammars in GBNF-style EBNF: `root ::= ...`)."""

    name = "xgrammar"
    features = frozenset({"json", "json_object", "regex", "choice", EBNF_GRAMMAR, "structural_tag"})

    def _build_tokenizer_data(self) -> xgr.GrammarCompiler:
        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=[self.eos_token_id]
        )
        return xgr.GrammarCompiler(info, max_threads=1)  # compiles already run in llmplug's thread pool

    def _grammar(self, constraint: GuidedDecodingParams) -> xgr.Grammar:
        """The tokenizer-independent grammar (cheap: also serves as validation)."""
        kind = constraint.kind
        if kind in ("json", "json_object"):
            flexible = constraint.whitespace_flexible
            return xgr.Grammar.from_json_schema(
                json.dumps(constraint.schema), any_whitespace=flexible, separators=None if flexible else (",", ":"),
                strict_mode=kind == "json",  # strict forbids unlisted properties: any object would be {} only
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(constraint.regex)
        if kind == "choice":
            return xgr.Grammar.from_regex(choice_regex(constraint.choice))
        if kind == "structural_tag":
            return _structural_tag_grammar(constraint.structural_tag)
        return xgr.Grammar.from_ebnf(constraint.grammar)

    def _check(self, constraint: GuidedDecodingParams) -> None:
        self._grammar(constraint)

    def _compile(self, constraint: GuidedDecodingParams) -> Compiled:
        compiled = self.tokenizer_data.compile_grammar(self._grammar(constraint))
        return Compiled(lambda: XGrammarMatcher(compiled))


def _structural_tag_grammar(tag: dict) -> xgr.Grammar:
    """xgrammar's structural tag, in its current form (`{"type": "structural_tag", "format": ...}`) or in the
    older one vLLM documents (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`)."""
    if "structures" not in tag:
        return xgr.Grammar.from_structural_tag(tag)
    items = []
    for i, item in enumerate(tag["structures"]):
        missing = [key for key in ("begin", "schema", "end") if key not in item]
        if missing:
            raise ValueError(f"structures[{i}] lacks {', '.join(missing)}")
        items.append(xgr.StructuralTagItem(begin=item["begin"], schema=json.dumps(item["schema"]), end=item["end"]))
    return xgr.Grammar.from_structural_tag(items, list(tag.get("triggers", [])))

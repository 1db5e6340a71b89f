"""`case(...)`: a parity case over a tiny transformers config, shared by the case modules (cases.py and the
modules it joins), in a module of its own so that any of them can be imported first."""

from __future__ import annotations

from llmplug.testing import ParityCase, tiny_config

NO_POSITION_LIMIT = {"max_model_len": 256}  # ALiBi and state-space models: the config has no max_position_embeddings


def case(
    name: str, config_class: type, engine_kwargs: dict | None = None, hf_attn: str = "eager", **fields
) -> ParityCase:
    """A ParityCase over `tiny_config(config_class, **fields)`."""
    make = lambda: tiny_config(config_class, **fields)  # noqa: E731
    return ParityCase(name, make, engine_kwargs=engine_kwargs or {}, hf_attn_implementation=hf_attn)

"""`case(...)`: a parity case over a tiny transformers config, shared by the case modules (cases.py and the
modules it joins), in a module of its own so that any of them can be imported first."""

from __future__ import annotations

from llmplug.testing import ParityCase, tiny_config

NO_POSITION_LIMIT = {"max_model_len": 256}  # ALiBi and state-space models: the config has no max_position_embeddings


def case(
    name: str,
    config_class: type,
    engine_kwargs: dict | None = None,
    hf_attn: str = "eager",
    architecture: str | None = None,
    prompt_lengths: tuple[int, ...] | None = None,
    hf_position_offset: int | None = None,
    **fields,
) -> ParityCase:
    """A ParityCase over `tiny_config(config_class, **fields)`; `architecture`: the name config.json gets (a
    config-only alias's hub class), `prompt_lengths`: other prompts than the harness's, `hf_position_offset`: see
    ParityCase."""
    make = lambda: tiny_config(config_class, **fields)  # noqa: E731
    lengths = {} if prompt_lengths is None else {"prompt_lengths": prompt_lengths}
    return ParityCase(
        name, make, engine_kwargs=engine_kwargs or {}, hf_attn_implementation=hf_attn, architecture=architecture,
        hf_position_offset=hf_position_offset, **lengths,
    )

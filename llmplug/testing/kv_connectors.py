"""Prove a KV connector (`llmplug.kv_connectors`) through the engine: what it loads is what was computed.

`check_kv_connector(model, kv_transfer_config)` runs greedy generation on `model` (a tiny checkpoint will do)
with the connector and compares every token with an engine without one:

- round trip: a long prompt, its local prefix cache dropped, asked again: its blocks are loaded from the
  connector (the cached tokens say so), with the same tokens;
- partial hit: a prompt sharing only the first blocks of it loads exactly those;
- failed loads: the worker's loads are made to fail (the loaded blocks overwritten with garbage and reported
  invalid): the engine recomputes and the tokens are still the same;
- restart (`restart=True`, for a connector whose blocks outlive the engine): a new engine with the same config
  loads the prompt's blocks.

Raises AssertionError naming what differed. The engine runs with the uniproc executor (the failure injection
wraps the model runner of the worker in this process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["KVConnectorReport", "check_kv_connector"]

BLOCK_SIZE = 4
PROMPT_BLOCKS = 8  # the long prompt: 8 full blocks and 3 more tokens
SHARED_BLOCKS = 3  # the partial hit shares this many leading blocks with it
MAX_TOKENS = 6


@dataclass(slots=True)
class KVConnectorReport:
    """What the check saw: the tokens found through the connector in each phase."""

    connector: str
    round_trip_cached_tokens: int = 0
    partial_cached_tokens: int = 0
    failed_loads: int = 0  # blocks whose load was made to fail (then recomputed)
    restart_cached_tokens: int | None = None  # None: not checked
    tokens: dict[str, list[int]] = field(default_factory=dict)


def check_kv_connector(
    model: str | Path, kv_transfer_config: dict[str, Any], *, restart: bool = False, **engine_kwargs: Any
) -> KVConnectorReport:
    """Run the checks above for the connector `kv_transfer_config` configures; `engine_kwargs` go to both engines."""
    from llmplug import LLM

    kwargs = {"dtype": "float32", "skip_tokenizer_init": True, "block_size": BLOCK_SIZE, "max_num_seqs": 4,
              "distributed_executor_backend": "uniproc", **engine_kwargs}
    prompts = _prompts()
    reference = LLM(str(model), **kwargs)
    expected = {name: _generate(reference, prompt)[0] for name, prompt in prompts.items()}
    reference.shutdown()
    report = KVConnectorReport(kv_transfer_config["kv_connector"])
    llm = LLM(str(model), kv_transfer_config=kv_transfer_config, **kwargs)
    try:
        report.round_trip_cached_tokens = _round_trip(llm, prompts, expected, report)
        report.partial_cached_tokens = _phase(llm, "partial", prompts, expected, report)
        _expect(report.partial_cached_tokens == SHARED_BLOCKS * BLOCK_SIZE,
                f"a prompt sharing {SHARED_BLOCKS} blocks found {report.partial_cached_tokens} cached tokens, not "
                f"{SHARED_BLOCKS * BLOCK_SIZE}")
        report.failed_loads = _failed_loads(llm, prompts, expected, report)
    finally:
        llm.shutdown()
    if restart:
        llm = LLM(str(model), kv_transfer_config=kv_transfer_config, **kwargs)
        try:
            report.restart_cached_tokens = _phase(llm, "long", prompts, expected, report)
        finally:
            llm.shutdown()
        _expect(report.restart_cached_tokens == PROMPT_BLOCKS * BLOCK_SIZE,
                f"after a restart the long prompt found {report.restart_cached_tokens} tokens through the connector, "
                f"not {PROMPT_BLOCKS * BLOCK_SIZE}")
    return report


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1234)
    long = torch.randint(3, 200, (PROMPT_BLOCKS * BLOCK_SIZE + 3,), generator=g).tolist()
    tail = torch.randint(3, 200, (5,), generator=g).tolist()
    return {"long": long, "partial": long[: SHARED_BLOCKS * BLOCK_SIZE] + tail}


def _generate(llm: Any, prompt: list[int]) -> tuple[list[int], int]:
    from llmplug import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def _phase(llm: Any, name: str, prompts: dict, expected: dict, report: KVConnectorReport, label: str = "") -> int:
    """Generate `name` with an empty local prefix cache (so every cached token came through the connector)."""
    llm.reset_prefix_cache()
    tokens, cached = _generate(llm, prompts[name])
    label = label or name
    report.tokens[label] = tokens
    _expect(tokens == expected[name], f"{label}: tokens {tokens} differ from the engine without a connector "
                                      f"{expected[name]}")
    return cached


def _round_trip(llm: Any, prompts: dict, expected: dict, report: KVConnectorReport) -> int:
    _phase(llm, "long", prompts, expected, report, "first")
    cached = _phase(llm, "long", prompts, expected, report, "round_trip")
    _expect(cached == PROMPT_BLOCKS * BLOCK_SIZE,
            f"the long prompt, computed before, found {cached} tokens through the connector, not all "
            f"{PROMPT_BLOCKS * BLOCK_SIZE} of its full blocks")
    return cached


def _failed_loads(llm: Any, prompts: dict, expected: dict, report: KVConnectorReport) -> int:
    executor = llm.llm_engine.engine_core.executor
    executor.collective_rpc(_make_loads_fail, (True,))
    try:
        cached = _phase(llm, "long", prompts, expected, report, "failed_load")
    finally:
        [num_failed] = executor.collective_rpc(_make_loads_fail, (False,))
    _expect(num_failed > 0, "the long prompt loaded no block through the connector, so no load could fail")
    _expect(cached == 0, f"after its loads failed the long prompt still counts {cached} cached tokens")
    return num_failed


class _FailingLoads:
    """A model runner's execute_model whose connector loads fail: each load runs, then every block the step loaded
    into (the leading blocks of the requests admitted in it) is overwritten with garbage and reported invalid. The
    engine must not use a block a failed load left behind."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.num_failed = 0  # blocks whose load was made to fail

    def __call__(self, scheduler_output: Any) -> Any:
        connector = self.runner.kv_connector
        load_kv = connector.load_kv
        connector.load_kv = lambda meta: self._load(load_kv, meta, scheduler_output)
        try:
            return type(self.runner).execute_model(self.runner, scheduler_output)
        finally:
            connector.__dict__.pop("load_kv", None)

    def _load(self, load_kv: Any, meta: Any, scheduler_output: Any) -> set[int]:
        from llmplug.engine.kv_transfer import layer_caches

        invalid = set(load_kv(meta))
        runner, block_size = self.runner, self.runner.block_size
        loaded = {block_id for r in scheduler_output.requests if r.new is not None
                  for block_id in r.new_block_ids[: r.num_computed_tokens // block_size]}
        for cache in layer_caches(runner.attn_backend, runner._attention_layers(), block_size):
            for block_id in loaded:
                cache.tensor.select(cache.block_dim, block_id).fill_(7.0)
        self.num_failed += len(loaded)
        return invalid | loaded


def _make_loads_fail(worker: Any, on: bool) -> int:
    """Start failing loads, or stop and return how many blocks failed."""
    # Fault injection for the check only: an instance attribute shadows the runner's method while `on`.
    runner = worker.model_runner
    if on:
        runner.execute_model = _FailingLoads(runner)
        return 0
    return runner.__dict__.pop("execute_model").num_failed


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)

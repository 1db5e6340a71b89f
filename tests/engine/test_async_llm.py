"""AsyncLLM: streaming as tokens arrive, abort and cancellation free blocks, errors reach the right requests."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from llmplug import LLM, AsyncLLM, SamplingParams
from llmplug.core.errors import EngineDeadError, InvalidRequestError
from llmplug.core.params import RequestOutputKind
from tests.engine.faults import break_forward, heal
from tests.models.tiny_models import make_tiny

KWARGS = {"dtype": "float32", "skip_tokenizer_init": True, "block_size": 4}
PROMPTS = [[5, 17, 9], [200, 3, 3, 3, 41, 8, 8], [77], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = AsyncLLM(str(tiny_llama.path), **KWARGS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama, engine):
    """Offline greedy and seeded outputs (computed before the async engine steps: one engine steps at a time)."""
    llm = LLM(str(tiny_llama.path), **KWARGS)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=12, ignore_eos=True)
    out = {
        "greedy": [o.outputs[0].token_ids for o in llm.generate(_token_prompts(), greedy, use_tqdm=False)],
        "seeded": [[c.token_ids for c in o.outputs] for o in llm.generate(_token_prompts(), seeded, use_tqdm=False)],
    }
    llm.shutdown()
    return out


def _token_prompts():
    return [{"prompt_token_ids": p} for p in PROMPTS]


def assert_all_blocks_free(engine: AsyncLLM) -> None:
    deadline = time.monotonic() + 10
    kv = engine.llm_engine.engine_core.kv_cache_manager
    while engine.stats()["kv_cache_usage"] > 0 or engine.stats()["num_running"]:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)
    assert kv.num_free_blocks == kv.num_blocks


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_delta_and_cumulative_streams_equal_offline(engine, expected):
    async def run():
        delta = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        cumulative = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompts = _token_prompts()
        return await asyncio.gather(
            *(collect(engine, p, delta, f"d{i}") for i, p in enumerate(prompts)),
            *(collect(engine, p, cumulative, f"c{i}") for i, p in enumerate(prompts)),
        )

    results = asyncio.run(run())
    deltas, cumulatives = results[: len(PROMPTS)], results[len(PROMPTS):]
    for outs, want in zip(deltas, expected["greedy"]):
        assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert [t for o in outs for t in o.outputs[0].token_ids] == want
    for outs, want in zip(cumulatives, expected["greedy"]):
        assert outs[-1].outputs[0].token_ids == want
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths)
    assert_all_blocks_free(engine)


def test_seeded_n2_equals_offline(engine, expected):
    params = SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=12, ignore_eos=True)

    async def run():
        return await asyncio.gather(*(collect(engine, p, params, f"s{i}") for i, p in enumerate(_token_prompts())))

    for outs, want in zip(asyncio.run(run()), expected["seeded"]):
        assert [c.token_ids for c in sorted(outs[-1].outputs, key=lambda c: c.index)] == want


def test_abort_ends_the_stream_and_frees_blocks(engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run():
        outs = []
        async for out in engine.generate({"prompt_token_ids": PROMPTS[1]}, params, "to-abort"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("to-abort")
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert 3 <= len(outs) < 200  # outputs already on their way may still arrive before the abort
    assert_all_blocks_free(engine)


def test_cancelled_consumer_aborts_its_request(engine):
    params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run():
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate({"prompt_token_ids": PROMPTS[0]}, params, "to-cancel"):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert_all_blocks_free(engine)


def test_invalid_request_fails_alone(engine, expected):
    too_long = {"prompt_token_ids": [1] * 300}  # the tiny model's context is 256

    async def run():
        good = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        return await asyncio.gather(collect(engine, too_long, good, "bad"),
                                    collect(engine, _token_prompts()[0], good, "good"), return_exceptions=True)

    bad, good = asyncio.run(run())
    assert isinstance(bad, InvalidRequestError) and "context length" in str(bad)
    assert good[-1].outputs[0].token_ids == expected["greedy"][0]
    assert not engine.is_dead


def test_duplicate_request_id_is_refused(engine):
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    async def run():
        first = engine.generate({"prompt_token_ids": [1]}, params, "same")
        await anext(first)
        with pytest.raises(InvalidRequestError, match="already in use"):
            await anext(engine.generate({"prompt_token_ids": [2]}, params, "same"))
        await first.aclose()

    asyncio.run(run())
    assert_all_blocks_free(engine)


def test_a_step_does_not_block_the_event_loop(engine):
    """While the engine generates, the event loop keeps ticking: the loop runs in the engine thread."""
    params = SamplingParams(max_tokens=60, ignore_eos=True)

    async def run():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        outs = await collect(engine, {"prompt_token_ids": PROMPTS[3]}, params, "ticks")
        stop.set()
        await task
        return ticks, outs

    ticks, outs = asyncio.run(run())
    assert outs[-1].finished and ticks > 10
    assert engine._thread is not threading.current_thread()


def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(tiny_llama, expected):
    engine = AsyncLLM(str(tiny_llama.path), **KWARGS)
    break_forward(engine, "boom")

    async def run():
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        return await asyncio.gather(collect(engine, {"prompt_token_ids": [1, 2]}, params, "first"),
                                    collect(engine, {"prompt_token_ids": [3]}, params, "second"))

    try:
        for outs in asyncio.run(run()):
            last = outs[-1].outputs[0]
            assert outs[-1].finished and last.finish_reason == "abort" and "boom" in last.error
        engine.check_health()  # not dead
        assert_all_blocks_free(engine)
        heal(engine)
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = asyncio.run(collect(engine, _token_prompts()[0], greedy, "after"))
        assert outs[-1].outputs[0].token_ids == expected["greedy"][0]
    finally:
        engine.shutdown()


def test_a_fatal_failure_fails_every_request_and_health(tiny_llama):
    engine = AsyncLLM(str(tiny_llama.path), **KWARGS)
    break_forward(engine, "device lost", error=torch.AcceleratorError)

    async def run():
        params = SamplingParams(max_tokens=100, ignore_eos=True)
        return await asyncio.gather(collect(engine, {"prompt_token_ids": [1, 2]}, params, "first"),
                                    collect(engine, {"prompt_token_ids": [3]}, params, "second"), return_exceptions=True)

    try:
        results = asyncio.run(run())
        assert all(isinstance(r, EngineDeadError) for r in results)
        assert "device lost" in str(results[0]) and engine.is_dead
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):  # later requests fail at once instead of hanging
            asyncio.run(collect(engine, {"prompt_token_ids": [1]}, SamplingParams(max_tokens=2), "late"))
    finally:
        engine.shutdown()


def test_shutdown_stops_the_thread(tiny_llama):
    engine = AsyncLLM(str(tiny_llama.path), **KWARGS)
    engine.shutdown()
    assert not engine._thread.is_alive() and engine.is_dead


def test_the_engine_is_built_on_the_thread_that_steps_it(tiny_llama, monkeypatch):
    """One thread runs all torch work: a second OpenMP team made GNU OpenMP stop spinning (docs/platforms.md)."""
    from llmplug.engine import async_llm

    built_on = []
    real_engine = async_llm.LLMEngine

    def recording_engine(config):
        built_on.append(threading.current_thread())
        return real_engine(config)

    monkeypatch.setattr(async_llm, "LLMEngine", recording_engine)
    engine = AsyncLLM(str(tiny_llama.path), **KWARGS)
    try:
        assert built_on == [engine._thread] and engine._thread is not threading.current_thread()
        out = asyncio.run(collect(engine, {"prompt_token_ids": [5, 17, 9]}, SamplingParams(max_tokens=3), "after"))
        assert out[-1].finished and len(out[-1].outputs[0].token_ids) == 3
    finally:
        engine.shutdown()


def test_a_construction_error_reaches_the_caller(tmp_path):
    before = set(threading.enumerate())
    with pytest.raises(Exception) as caught:
        AsyncLLM(str(tmp_path / "no-such-model"), **KWARGS)
    assert "no-such-model" in str(caught.value)
    started = [t for t in threading.enumerate() if t not in before]
    for thread in started:
        thread.join(timeout=5)
    assert [t.name for t in started] in ([], ["llmplug-engine"]) and not any(t.is_alive() for t in started)

"""Batch-invariant mode (on by default) through the server: the same seeded chat request, sent 40 times while 31 other random
requests keep the engine busy, gets one answer (default model, bf16, real uvicorn server, real `openai` client)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

from llmplug import AsyncLLM
from tests.entrypoints.openai.conftest import DEFAULT_MODEL_LEN, RunningServer, serve

PROBE = [{"role": "user", "content": "Write two sentences about a lighthouse keeper and his cat."}]
ROUNDS = 4  # of 10 concurrent probes: 40 answers, each met another mix of batch sizes and neighbours
WORDS = "sea storm light keeper boat rope harbor gull wave night tide lamp rock wind ship island".split()


@pytest.fixture(scope="module")
def invariant_server() -> Iterator[RunningServer]:
    engine = AsyncLLM(max_model_len=DEFAULT_MODEL_LEN, max_num_seqs=32)  # batch_invariant: its default, auto
    try:
        with serve(engine) as running:
            yield running
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_the_same_request_40_times_under_load_gets_one_answer(invariant_server) -> None:
    client = invariant_server.async_client()
    rng = random.Random(0)

    async def probe() -> str:
        reply = await client.chat.completions.create(
            model=invariant_server.model, messages=PROBE, temperature=0.8, seed=1234, max_tokens=24
        )
        return reply.choices[0].message.content

    async def other() -> None:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 40)))
        await client.chat.completions.create(
            model=invariant_server.model, messages=[{"role": "user", "content": words}],
            temperature=rng.choice([0.0, 0.7, 1.0]), max_tokens=rng.randrange(4, 48),
        )

    async def keep_busy(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await other()

    async def main() -> list[str]:
        stop = asyncio.Event()
        load = [asyncio.create_task(keep_busy(stop)) for _ in range(31)]
        answers = []
        for _ in range(ROUNDS):  # 10 probes in flight at a time, the 31 others always running beside them
            answers += await asyncio.gather(*(probe() for _ in range(10)))
        stop.set()
        await asyncio.gather(*load)
        return answers

    answers = asyncio.run(main())
    assert len(answers) == 10 * ROUNDS and answers[0]
    assert len(set(answers)) == 1, f"{len(set(answers))} distinct answers: {sorted(set(answers))[:3]}"
    invariant_server.wait_idle()

"""Prefix affinity of data-parallel routing: multi-turn chats on two replicas, prefix-cache hit rate by routing.

    python benchmarks/dp_affinity.py                       # the embedded SmolLM2, 16 conversations x 4 turns
    python benchmarks/dp_affinity.py --conversations 32 --turns 6 --routing prefix_affinity round_robin

For each routing policy (`data_parallel_routing`) one `LLM(data_parallel_size=2)` answers every conversation's
turns: all conversations' turn k go as one batch, in a new random order each turn, and each next turn's prompt is
the conversation so far (system prompt, earlier questions and answers) plus a new question. Reported per policy:
the prefix-cache hit rate of turns 2 and later (prompt tokens found in the cache of the replica that ran them,
per prompt token looked up, from the replicas' own counters) and the wall time of those turns.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from llmplug import LLM, SamplingParams

SYSTEM = "You are a helpful assistant. Answer briefly and precisely, in one or two sentences."
TOPICS = ["the moon", "volcanoes", "bread", "chess", "rivers", "bees", "glass", "trains", "tea", "clouds",
          "copper", "owls", "maps", "salt", "kites", "rain"]


def question(conversation: int, turn: int) -> str:
    topic = TOPICS[conversation % len(TOPICS)]
    return f"Conversation {conversation}, question {turn}: tell me one more fact about {topic}."


def hits_and_queries(llm: LLM) -> tuple[int, int]:
    states = llm.llm_engine.replica_states()
    return (sum(s.stats.get("prefix_cache_hits", 0) for s in states),
            sum(s.stats.get("prefix_cache_queries", 0) for s in states))


def run(routing: str, args: argparse.Namespace) -> dict[str, float]:
    llm = LLM(args.model, data_parallel_size=2, data_parallel_routing=routing, max_model_len=2048)
    try:
        rng = random.Random(0)
        chats = [[{"role": "system", "content": SYSTEM}] for _ in range(args.conversations)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
        start = 0.0
        for turn in range(args.turns):
            if turn == 1:  # turns 2 and later: the first one only fills the caches
                hits_before, queries_before = hits_and_queries(llm)
                start = time.perf_counter()
            order = list(range(args.conversations))
            rng.shuffle(order)
            for i in order:
                chats[i].append({"role": "user", "content": question(i, turn)})
            outputs = llm.chat([chats[i] for i in order], params, use_tqdm=False)
            for i, out in zip(order, outputs):
                chats[i].append({"role": "assistant", "content": out.outputs[0].text})
        elapsed = time.perf_counter() - start
        hits, queries = hits_and_queries(llm)
        return {"hit_rate": (hits - hits_before) / max(queries - queries_before, 1), "seconds": elapsed}
    finally:
        llm.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Default: the embedded SmolLM2-135M-Instruct.")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--routing", nargs="+", default=["prefix_affinity", "round_robin", "least_loaded"])
    args = parser.parse_args()
    rows = ["| routing | prefix-cache hit rate, turns 2+ | seconds, turns 2+ |", "|---|---|---|"]
    for routing in args.routing:
        result = run(routing, args)
        print(f"[{routing}] {result}", file=sys.stderr)
        rows.append(f"| {routing} | {result['hit_rate']:.1%} | {result['seconds']:.1f} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of an engine under an external launcher: `torchrun --nproc-per-node N this.py MODEL OUT TP PP`.

Every rank builds the whole engine on the same prompts and writes what it generated to OUT/rank<R>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.engine.executors.parity import ENGINE_KWARGS, generate


def main(model: str, out: str, tp: int, pp: int) -> None:
    from llmplug import LLM

    llm = LLM(model, **ENGINE_KWARGS, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              distributed_executor_backend="external_launcher")
    try:
        results = generate(llm)
    finally:
        llm.shutdown()
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))

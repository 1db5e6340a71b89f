"""`llmplug save-sharded MODEL OUT --tensor-parallel-size N`: write each rank's weights for the
`sharded_state` loader (see llmplug/loaders/sharded_state.py).

Kept light at import time (the CLI builds every parser on each call): the engine loads inside `run`.
"""

from __future__ import annotations

import argparse

from llmplug.entrypoints.engine_args import add_engine_args, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL (positional or --model), OUT, and the engine flags (--tensor-parallel-size, ...)."""
    add_engine_args(parser, model_positional=True)
    parser.add_argument("output", metavar="OUT", help="Directory to write the per-rank weight files into.")


def run(args: argparse.Namespace) -> int:
    """Load the model with the requested parallel sizes and let every worker save its shard."""
    from llmplug import _configure_threads_before_torch

    _configure_threads_before_torch()
    from llmplug.engine.llm import LLM
    from llmplug.loaders.sharded_state import save_sharded_state

    llm = LLM(config=config_from_args(args).config)
    try:
        files = llm.llm_engine.engine_core.executor.collective_rpc(save_sharded_state, (args.output,))
        if llm.get_tokenizer() is not None:
            llm.get_tokenizer().save_pretrained(args.output)
    finally:
        llm.shutdown()
    print(f"wrote {sum(len(f) for f in files)} weight file(s) for {len(files)} rank(s) into {args.output}")
    return 0

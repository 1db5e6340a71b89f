"""`llmplug tensorize MODEL OUT`: serialize a model with tensorizer for `load.format: tensorizer`."""

from __future__ import annotations

import argparse

from llmplug.entrypoints.engine_args import add_engine_args, config_from_args

__all__ = ["tensorize_arguments", "run_tensorize"]


def tensorize_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL (any format llmplug loads, or --model), OUT, and the engine flags (e.g. --load-format, --dtype)."""
    add_engine_args(parser, model_positional=True)
    parser.add_argument("out", metavar="OUT", help="Directory for config.json, the tokenizer and model.tensors.")


def run_tensorize(args: argparse.Namespace) -> int:
    """Write OUT and say how to load it."""
    from llmplug.loaders.tensorizer import tensorize_model

    tensors = tensorize_model(config_from_args(args).config, args.out)
    print(f"wrote {tensors}; load it with: llmplug run --model {args.out} --load-format tensorizer")
    return 0

"""The `llmplug` command line: `llmplug [--version] <command> ...`.

Each command is a `Subcommand` in `SUBCOMMANDS`. Adding one (run, generate, chat, serve, ...) means
writing its `add_arguments(parser)` and `run(args) -> exit code` and adding an entry: the parsers of
all commands are built on every call, so a command's module must stay light at import time and
import the engine (torch) inside `run`. `llmplug config`, `llmplug plugins` and `--version` never
import torch.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmplug.core.config import CONFIG_FORMATS, format_config
from llmplug.core.errors import ConfigError, LlmplugError, PluginError
from llmplug.entrypoints.engine_args import add_engine_args, config_from_args

# Exit status of a usage or configuration error (argparse uses the same).
EXIT_USAGE = 2


@dataclass(frozen=True, slots=True)
class Subcommand:
    """One `llmplug <name>` command: its one-line help, its flags and what it runs."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# --- llmplug config ------------------------------------------------------------------------------


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--format", choices=CONFIG_FORMATS, default="yaml",
                        help="yaml: loadable with --config, a comment per value names its source (default); "
                             "json: {config, sources}; table: field, value, source.")


def _run_config(args: argparse.Namespace) -> int:
    print(format_config(config_from_args(args), args.format), end="")
    return 0


# --- llmplug plugins -----------------------------------------------------------------------------


def _plugins_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--group", metavar="G", help="Only this entry-point group: llmplug.platforms or platforms.")
    parser.add_argument("--json", action="store_true", help="One JSON list of rows instead of a table.")
    parser.add_argument("--probe", action="store_true",
                        help="Also ask each platform whether its hardware is here (imports torch; slower).")


def _run_plugins(args: argparse.Namespace) -> int:
    from llmplug.core.plugins import get_registry

    rows = list(get_registry().describe())
    if args.probe:
        _probe_platforms(rows)
    if args.group:
        rows = _rows_of_group(rows, args.group)
    print(json.dumps(rows, indent=2) if args.json else _plugins_table(rows))
    return 0


def _probe_platforms(rows: list[dict[str, Any]]) -> None:
    """Mark platforms whose hardware this machine lacks as not usable, saying what was detected."""
    from llmplug.platforms import PLATFORMS_GROUP, detect_platforms

    report = detect_platforms()
    for row in rows:
        reason = report.get(row["name"]) if row["group"] == PLATFORMS_GROUP and row["usable"] else None
        if reason:
            row["usable"], row["reason"] = False, reason


def _rows_of_group(rows: list[dict[str, Any]], group: str) -> list[dict[str, Any]]:
    from llmplug.core import plugins

    known = sorted(getattr(plugins, "GROUPS", None) or {row["group"] for row in rows})
    full = group if group in known else f"llmplug.{group}"
    if full not in known:
        close = difflib.get_close_matches(group, known, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"groups: {', '.join(known)}"
        raise PluginError(f"unknown plugin group {group!r} (from flag --group); {hint}")
    return [row for row in rows if row["group"] == full]


def _plugins_table(rows: list[dict[str, Any]]) -> str:
    header = ("GROUP", "NAME", "DISTRIBUTION", "VERSION", "USABLE")
    cells = [header] + [
        (row["group"], row["name"], row["distribution"] or "-", row["version"] or "-",
         "yes" if row["usable"] else f"no: {row['reason']}")
        for row in rows
    ]
    widths = [max(len(str(cell[i])) for cell in cells) for i in range(len(header) - 1)]
    return "\n".join("  ".join(f"{str(c):<{w}}" for c, w in zip(cell, widths)) + f"  {cell[-1]}" for cell in cells)


def _engine_commands() -> dict[str, Subcommand]:
    from llmplug.entrypoints import (bench, collect_env, generate, models_list, proxy, run_batch, save_sharded,
                                     serve, tensorize)

    return {
        "models": Subcommand("List the model architectures: family and whether TP, PP, GGUF and int4 work.",
                             models_list.add_arguments, models_list.run),
        "run": Subcommand("Answer a few demo prompts with the model (default: the embedded SmolLM2, in float32) "
                          "and print tok/s.",
                          generate._run_arguments, generate._run_demo),
        "generate": Subcommand("Complete prompts and print the completions.",
                               generate._generate_arguments, generate._run_generate),
        "chat": Subcommand("Chat with the model in the terminal, streaming its answers.",
                           generate._chat_arguments, generate._run_chat),
        "serve": Subcommand("Serve the model over an OpenAI-compatible HTTP API (chat, completions, responses).",
                            serve._serve_arguments, serve._run_serve),
        "proxy": Subcommand("Front a prefill engine and a decode engine that share a disk_offload KV directory "
                            "(disaggregated prefill/decode).", proxy.add_arguments, proxy.run),
        "run-batch": Subcommand("Answer an OpenAI Batch API file (JSONL in, JSONL out) with the server's handlers; "
                                "resumable.", run_batch.add_arguments, run_batch.run),
        "bench": Subcommand("Benchmark: serve (a running server), throughput and latency (an offline engine), "
                            "printing vLLM's summaries.", bench.add_arguments, bench.run),
        "tensorize": Subcommand("Serialize a model with tensorizer into a directory for --load-format tensorizer.",
                                tensorize.tensorize_arguments, tensorize.run_tensorize),
        "save-sharded": Subcommand("Save each tensor-parallel rank's weights so a TP engine loads only its own.",
                                   save_sharded.add_arguments, save_sharded.run),
        "collect-env": Subcommand("Print the CPU, its flags, the oneDNN ISA and versions, threads, and the kernel "
                                  "each linear layer of the default model gets here.",
                                  collect_env.add_arguments, collect_env.run),
    }


# Every `llmplug <name>` command.
SUBCOMMANDS: dict[str, Subcommand] = {
    "config": Subcommand("Print the resolved engine config and where each value came from.",
                         _config_arguments, _run_config),
    "plugins": Subcommand("List every plugin: group, name, distribution, version, usable here or why not.",
                          _plugins_arguments, _run_plugins),
    **_engine_commands(),
}


# --- main ----------------------------------------------------------------------------------------


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and the parser of each subcommand, by name."""
    parser = argparse.ArgumentParser(
        prog="llmplug", description="LLM inference engine whose every backend is a plugin.", allow_abbrev=False
    )
    parser.add_argument("--version", action="store_true", help="Print llmplug's version and exit.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {}
    for name, command in SUBCOMMANDS.items():
        # no abbreviations: `--block` must not silently mean `--block-size`
        subparsers[name] = commands.add_parser(name, help=command.help, description=command.help, allow_abbrev=False)
        command.add_arguments(subparsers[name])
    return parser, subparsers


def main(argv: Sequence[str] | None = None) -> int:
    """Run `llmplug` with `argv` (default: sys.argv[1:]); returns the exit status."""
    parser, subparsers = build_parser()
    try:
        args = _parse(parser, subparsers, argv)
        if args.version:
            from llmplug import __version__

            print(f"llmplug {__version__}")
            return 0
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return SUBCOMMANDS[args.command].run(args)
    except SystemExit as exc:  # argparse's own usage errors and --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except LlmplugError as exc:  # a user's mistake: one line, no traceback
        print(f"llmplug: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _parse(parser: argparse.ArgumentParser, subparsers: dict[str, argparse.ArgumentParser],
           argv: Sequence[str] | None) -> argparse.Namespace:
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ConfigError(_unknown_arguments(unknown, args.command, subparsers))
    return args


def _unknown_arguments(unknown: list[str], command: str | None, subparsers: dict[str, argparse.ArgumentParser]) -> str:
    """Name the first unknown argument and the closest flag of its command."""
    word = unknown[0]
    where = f"llmplug {command}" if command else "llmplug"
    if not word.startswith("-"):
        return f"unexpected argument {word!r} for '{where}'; see '{where} --help'"
    flag = word.split("=", 1)[0]
    known = list(subparsers[command]._option_string_actions) if command else ["--version", "--help"]
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"see '{where} --help'"
    return f"unknown flag {flag} for '{where}'; {hint}"


if __name__ == "__main__":
    sys.exit(main())

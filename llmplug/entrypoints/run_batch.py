"""`llmplug run-batch -i IN.jsonl -o OUT.jsonl`: an OpenAI Batch API file answered offline, as vLLM's `run-batch`.

Each input line is `{"custom_id", "method": "POST", "url", "body"}` with `url` one of /v1/chat/completions,
/v1/completions, /v1/embeddings (the last for a pooling model). Each line is answered by the server's own
app (`build_app`), called in-process without a socket: the same pydantic validation, the same handlers and
the same errors as `llmplug serve`. Lines run concurrently (at most `--max-concurrency` in flight, so the
engine batches them) and are written in input order, one JSON line each, flushed as soon as every line
before it is written:

- an answer: `{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}`;
- a request the server refuses (invalid body, a prompt too long, ...): `response` holds its status and the
  OpenAI error body, and `error` is `{"code", "message", "line"}`;
- a line that cannot be sent (invalid JSON, no custom_id, a method or url not served, `stream`, a custom_id
  seen before in the file): `"response": null` and `error` as above (custom_id: null when it cannot be read).

Resuming: when the output file exists, the input lines it already answers are skipped and the rest are
appended. A line is answered when the file holds a line with its custom_id (an answer or an error: both
are final; delete a line to redo it) or, for an input line whose custom_id cannot be read, an error naming
its line number. A last line not ended by a newline was cut mid-write: it is dropped and redone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import uuid
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmplug.core.errors import ConfigError
from llmplug.entrypoints.arg_types import positive_int
from llmplug.entrypoints.engine_args import add_engine_args, config_from_args

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
DUPLICATE = "duplicate_custom_id"  # the error code of a repeated custom_id: not an answer to that id
# a custom_id read out of a line that is not valid JSON, so its error line can name it
_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*"((?:[^"\\]|\\.)*)"')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("batch")
    g.add_argument("-i", "--input-file", required=True, metavar="FILE",
                   help="OpenAI Batch API input: one JSON request a line.")
    g.add_argument("-o", "--output-file", required=True, metavar="FILE",
                   help="Where the answers go, one JSON line per input line, in input order. An existing file is "
                        "resumed: lines it answers are skipped, the others appended.")
    g.add_argument("--max-concurrency", type=positive_int, default=64, metavar="N",
                   help="Most lines in flight at once (the engine batches them). Default: 64.")
    g.add_argument("--served-model-name", action="append", metavar="NAME",
                   help="Name a line's body.model may give (repeatable). Default: the model as given.")
    g.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                   help="Jinja chat template for every chat line. Default: the model's own.")
    g.add_argument("--disable-progress-bar", action="store_true", help="No progress bar on stderr.")
    add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    """Answer every line of --input-file not yet answered in --output-file."""
    input_path, output_path = Path(args.input_file), Path(args.output_file)
    if not input_path.is_file():
        raise ConfigError(f"--input-file {args.input_file}: no such file")
    config = config_from_args(args).config
    from llmplug import _configure_threads_before_torch

    _configure_threads_before_torch()
    from llmplug.entrypoints.openai.api_server import ServerSettings
    from llmplug.entrypoints.openai.prompt_renderer import load_chat_template

    settings = ServerSettings(served_model_names=list(args.served_model_name or []),
                              chat_template=load_chat_template(args.chat_template) if args.chat_template else None)
    summary = asyncio.run(run_batch(config, settings, input_path, output_path, args.max_concurrency,
                                    progress=not args.disable_progress_bar))
    print(f"run-batch: {summary['answered']} answered, {summary['errors']} errors, {summary['skipped']} skipped "
          f"(already in {output_path})", file=sys.stderr)
    return 0


# --- input lines -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One input line: what to send, or why it cannot be sent."""

    number: int  # 1-based line number in the input file
    custom_id: str | None  # None: the line has none that can be read
    url: str | None = None
    body: dict[str, Any] | None = None
    error: dict[str, Any] | None = None  # {"code", "message", "line"} of a line that is not sent


def read_lines(path: Path) -> Iterator[BatchLine]:
    """The non-blank lines of an input file, parsed and checked."""
    with path.open(encoding="utf-8") as file:
        for number, text in enumerate(file, start=1):
            if text.strip():
                yield parse_line(number, text)


def parse_line(number: int, text: str) -> BatchLine:
    """A BatchLine from the text of input line `number`."""
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        found = _CUSTOM_ID.search(text)
        custom_id = json.loads(f'"{found.group(1)}"') if found else None
        return _refused(number, custom_id, "invalid_json_line",
                        f"line {number} is not valid JSON ({exc.msg}, column {exc.colno})")
    if not isinstance(item, dict):
        return _refused(number, None, "invalid_json_line", f"line {number} is not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _refused(number, None, "missing_required_parameter", f"line {number} has no custom_id (a string)")
    problem = _request_problem(item)
    if problem is not None:
        return _refused(number, custom_id, problem[0], f"line {number} (custom_id {custom_id!r}): {problem[1]}")
    return BatchLine(number, custom_id, item["url"], item["body"])


def _request_problem(item: dict[str, Any]) -> tuple[str, str] | None:
    """(code, message) when the line's method, url or body cannot be sent; None when it can."""
    if item.get("method", "POST") != "POST":
        return "invalid_method", f"method {item.get('method')!r} is not served; use POST"
    if item.get("url") not in URLS:
        return "invalid_url", f"url {item.get('url')!r} is not served; use one of {', '.join(URLS)}"
    if not isinstance(item.get("body"), dict):
        return "missing_required_parameter", "body must be a JSON object (the request)"
    if item["body"].get("stream"):
        return "invalid_request", "stream is not supported in a batch: each line gets one whole answer"
    return None


def _refused(number: int, custom_id: str | None, code: str, message: str) -> BatchLine:
    return BatchLine(number, custom_id, error={"code": code, "message": message, "line": number})


# --- output lines and resuming --------------------------------------------------------------------


@dataclass(slots=True)
class Answered:
    """What an existing output file already holds: the custom_ids answered, the line numbers of errors
    without a custom_id, and how many duplicate-custom_id errors each id has."""

    custom_ids: set[str]
    lines: set[int]
    duplicates: Counter

    def holds(self, line: BatchLine) -> bool:
        return line.custom_id in self.custom_ids if line.custom_id is not None else line.number in self.lines


def load_answered(path: Path) -> Answered:
    """Read an output file to resume it, first cutting off a last line that lacks its newline."""
    answered = Answered(set(), set(), Counter())
    if not path.exists():
        return answered
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):  # a line cut mid-write: redone
        with path.open("r+b") as file:
            file.truncate(len(complete))
    for number, text in enumerate(complete.decode("utf-8").splitlines(), start=1):
        if text.strip():
            _record(answered, _output_line(path, number, text))
    return answered


def _output_line(path: Path, number: int, text: str) -> dict[str, Any]:
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--output-file {path}: line {number} is not valid JSON ({exc.msg}), so the file cannot "
                          "be resumed; fix or remove that line, or write to a new file") from None
    if not isinstance(item, dict) or "custom_id" not in item:
        raise ConfigError(f"--output-file {path}: line {number} is not a batch output line (no custom_id); "
                          "write to a new file")
    return item


def _record(answered: Answered, item: dict[str, Any]) -> None:
    error = item.get("error") or {}
    if error.get("code") == DUPLICATE:
        answered.duplicates[item["custom_id"]] += 1
    elif item["custom_id"] is not None:
        answered.custom_ids.add(item["custom_id"])
    elif isinstance(error.get("line"), int):
        answered.lines.add(error["line"])


def error_line(line: BatchLine, error: dict[str, Any], response: dict[str, Any] | None = None) -> dict[str, Any]:
    """The output line of a line that was refused (`response`: the server's answer, if it got one)."""
    return {"id": _batch_id(), "custom_id": line.custom_id, "response": response, "error": error}


def _batch_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


# --- running ----------------------------------------------------------------------------------------


class AppClient:
    """POSTs JSON to an ASGI app in-process: the server's routes, validation and error handlers, no socket."""

    def __init__(self, app: Any):
        self.app = app

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, response body) of POST `path` with the JSON `body`."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 0), "server": ("localhost", 80)}
        sent, done = False, asyncio.Event()
        status, chunks = 500, []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()  # the server listens for a disconnect while it works: none comes
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    done.set()

        try:
            await self.app(scope, receive, send)
        except Exception:
            if not done.is_set():  # no answer was sent: not the server's 500 re-raised for logging
                raise
        finally:
            done.set()
        return status, b"".join(chunks)


async def answer(client: AppClient, line: BatchLine) -> dict[str, Any]:
    """The output line of one input line."""
    if line.error is not None:
        return error_line(line, line.error)
    status, raw = await client.post(line.url, json.dumps(line.body).encode())
    body = _json_or_text(raw)
    if status == 200:
        request_id = body.get("id") if isinstance(body, dict) else None
        response = {"status_code": 200, "request_id": request_id or _batch_id(), "body": body}
        return {"id": _batch_id(), "custom_id": line.custom_id, "response": response, "error": None}
    detail = body.get("error", {}) if isinstance(body, dict) else {}
    error = {"code": detail.get("code") or detail.get("type") or f"http_{status}",
             "message": detail.get("message") or f"the server answered {status}", "line": line.number}
    return error_line(line, error, {"status_code": status, "request_id": _batch_id(), "body": body})


def _json_or_text(raw: bytes) -> Any:
    """A response body: its JSON (every route of the server answers JSON), else its text."""
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode("utf-8", "replace")


def plan(lines: Iterator[BatchLine], answered: Answered) -> tuple[list[BatchLine], int]:
    """(the lines to answer, in input order, duplicates turned into errors; the number skipped as answered)."""
    todo, skipped, seen, repeats = [], 0, set(), Counter()
    for line in lines:
        if line.custom_id is not None and line.custom_id in seen:
            repeats[line.custom_id] += 1
            if repeats[line.custom_id] <= answered.duplicates[line.custom_id]:
                skipped += 1
                continue
            todo.append(_refused(line.number, line.custom_id, DUPLICATE,
                                 f"line {line.number}: custom_id {line.custom_id!r} was used by an earlier line; "
                                 "each line needs its own"))
            continue
        if line.custom_id is not None:
            seen.add(line.custom_id)
        if answered.holds(line):
            skipped += 1
        else:
            todo.append(line)
    return todo, skipped


async def run_batch(config: Any, settings: Any, input_path: Path, output_path: Path, max_concurrency: int,
                    progress: bool = True) -> dict[str, int]:
    """Answer the lines of `input_path` not yet in `output_path`; returns the counts answered, errors, skipped."""
    from tqdm import tqdm

    from llmplug.engine.async_llm import AsyncLLM
    from llmplug.entrypoints.openai.api_server import build_app

    todo, skipped = plan(read_lines(input_path), load_answered(output_path))
    counts = {"answered": 0, "errors": 0, "skipped": skipped}
    engine = AsyncLLM.from_config(config)
    try:
        app = build_app(engine, settings)
        client = AppClient(app)
        bar = tqdm(total=len(todo) + skipped, initial=skipped, desc="run-batch", unit="req", disable=not progress)
        async with app.router.lifespan_context(app):
            with output_path.open("a", encoding="utf-8") as out, bar:
                await _answer_in_order(client, todo, max_concurrency, out, bar, counts)
    finally:
        engine.shutdown()
    return counts


async def _answer_in_order(client: AppClient, todo: list[BatchLine], max_concurrency: int, out: Any, bar: Any,
                           counts: dict[str, int]) -> None:
    """Run up to `max_concurrency` lines at once; write each answer once every earlier one is written."""
    pending: deque[asyncio.Future] = deque()

    def write(item: dict[str, Any]) -> None:
        out.write(json.dumps(item, ensure_ascii=False) + "\n")
        out.flush()  # an interrupted run keeps every line written so far
        counts["errors" if item["error"] is not None else "answered"] += 1
        bar.update(1)

    try:
        for line in todo:
            pending.append(asyncio.ensure_future(answer(client, line)))
            await asyncio.sleep(0)  # let it start (and a refused line finish) before looking at the head
            while pending and (len(pending) >= max_concurrency or pending[0].done()):
                write(await pending.popleft())
        while pending:
            write(await pending.popleft())
    finally:
        for task in pending:  # interrupted: abort what is in flight
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

"""`llmplug serve [MODEL]`: the OpenAI-compatible HTTP server.

Kept light at import time (the CLI builds every parser on each call): FastAPI, uvicorn and torch load
inside `run`.
"""

from __future__ import annotations

import argparse

from llmplug.entrypoints.arg_types import non_negative_float, positive_float, positive_int
from llmplug.entrypoints.engine_args import add_engine_args, config_from_args
from llmplug.multimodal.audio import DEFAULT_MAX_AUDIO_BYTES, DEFAULT_MAX_AUDIO_SECONDS
from llmplug.multimodal.media import DEFAULT_FETCH_TIMEOUT, DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to listen on. Default: 127.0.0.1 (this machine "
                   "only); 0.0.0.0 listens on every interface.")
    g.add_argument("--port", type=int, default=8000, help="Port to listen on. Default: 8000.")
    g.add_argument("--api-key", action="append", metavar="KEY",
                   help="Require 'Authorization: Bearer KEY' on every route but /health, /version and /metrics "
                        "(repeatable: several keys). "
                        "Default: the LLMPLUG_API_KEY environment variable; unset: no authentication.")
    g.add_argument("--allowed-origins", metavar="A,B,...",
                   help="Origins allowed by CORS, comma-separated ('*' for any). Default: CORS off.")
    g.add_argument("--allowed-hosts", metavar="H1,H2,...",
                   help="Host header names served, comma-separated ('*' for any); other requests get 400. Default: "
                        "localhost,127.0.0.1,::1 when --host is a loopback address (so a web page cannot reach a "
                        "local server by DNS rebinding), any host otherwise.")
    g.add_argument("--rate-limit", metavar="N/UNIT",
                   help="Requests allowed per API key (or per client address without keys), e.g. 10/s, 600/min; "
                        "bursts up to N. Over it: 429 with Retry-After. Default: no limit.")
    g.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, metavar="BYTES",
                   help="Largest request body accepted (413 beyond). Default: 8 MiB.")
    g.add_argument("--max-waiting-requests", type=positive_int, default=1024, metavar="N",
                   help="Most requests (counted as sequences: n per request) waiting for a place in the running "
                        "batch; past it: 503 with Retry-After. Default: 1024.")
    g.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                   help="Jinja chat template for every chat request: a file, or the template text itself. "
                        "Clients cannot override it. Default: the model's own.")
    g.add_argument("--served-model-name", action="append", metavar="NAME",
                   help="Name clients use as `model` (repeatable). Default: the model as given.")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="On SIGTERM, how long in-flight requests may take to finish. Default: 30.")
    g.add_argument("--stream-send-timeout", type=non_negative_float, default=30.0, metavar="SECONDS",
                   help="A response whose client reads nothing for this long, once its buffers are full, is dropped "
                        "and its request aborted (its admission slots and KV blocks freed): a client that stops "
                        "reading its stream cannot hold them. 0: wait forever. Default: 30.")
    g.add_argument("--health-stall-timeout", type=non_negative_float, default=60.0, metavar="SECONDS",
                   help="/health answers 503 (code engine_stalled) once the engine's current step or command has "
                        "run this long while work waits: a stalled engine, not only a dead one, fails the load "
                        "balancer's check. 0: off. Default: 60.")
    g.add_argument("--enable-dev-endpoints", action="store_true",
                   help="Add vLLM's dev-mode routes: POST /sleep?level=1|2, POST /wake_up[?tags=weights|kv_cache], GET "
                        "/is_sleeping, POST /reset_prefix_cache (behind --api-key like every route). Also on with "
                        "VLLM_SERVER_DEV_MODE=1. Default: off.")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="Server log level. Default: info.")
    g = parser.add_argument_group("observability (see docs/observability.md)")
    g.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="Send an OpenTelemetry span per request (vLLM's \"llm_request\", child of the request's "
                        "traceparent) to this OTLP collector, e.g. http://localhost:4318/v1/traces. Needs "
                        "'pip install llmplug[tracing]'; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc for a gRPC "
                        "collector (with opentelemetry-exporter-otlp-proto-grpc). Default: no traces.")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="Log each generation request's id, prompt, sampling params and LoRA adapter at info level. "
                        "Default: off (prompts stay out of the log).")
    g.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help=argparse.SUPPRESS)  # vLLM's older flag: the default here
    g.add_argument("--max-log-len", type=positive_int, metavar="N",
                   help="With --enable-log-requests: characters of a prompt (and prompt token ids) logged. "
                        "Default: all.")
    g = parser.add_argument_group("LoRA adapters (the engine needs --enable-lora; see docs/lora.md)")
    g.add_argument("--lora-modules", nargs="+", action="extend", metavar="NAME=PATH",
                   help="PEFT adapter folders served as models NAME (a request's `model` picks one); loaded and "
                        "checked at start-up.")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="Add /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key like every "
                        "route). Default: off.")
    g.add_argument("--lora-resolver", action="append", metavar="NAME",
                   help="An llmplug.lora_resolvers plugin asked for adapters a request's `model` names that are not "
                        "loaded (repeatable: asked in order). Default: none.")
    g = parser.add_argument_group("tools and reasoning")
    g.add_argument("--tool-call-parser", metavar="NAME",
                   help="How the model writes tool calls: an llmplug.tool_parsers name (in tree: hermes, llama3_json, "
                        "mistral, pythonic, qwen3_xml). Needed for tool_choice \"auto\". Default: none.")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Allow tool_choice \"auto\" (OpenAI's default with tools): the model decides whether to call, "
                        "--tool-call-parser reads its calls. tool_choice \"required\" and named functions work "
                        "without it (guided decoding makes the calls).")
    g.add_argument("--reasoning-parser", metavar="NAME",
                   help="Split the model's reasoning from its answer (reasoning_content): an llmplug.reasoning_parsers "
                        "name (in tree: deepseek_r1, qwen3). Structured output then constrains the answer only. "
                        "Default: none.")
    g = parser.add_argument_group("image inputs (a model that takes images; see docs/multimodal.md)")
    g.add_argument("--allowed-local-media-path", metavar="DIR",
                   help="Serve file:// image URLs from inside DIR (symlinks and '..' resolved: nothing outside it). "
                        "Default: file:// URLs refused.")
    g.add_argument("--allowed-media-domains", metavar="HOST1,HOST2,...",
                   help="Hosts http(s) image URLs may name (redirects too), comma-separated. Default: none, http(s) "
                        "image URLs refused (vLLM fetches from any host); data: URLs always work.")
    g.add_argument("--media-fetch-timeout", type=positive_float, default=DEFAULT_FETCH_TIMEOUT, metavar="SECONDS",
                   help="Longest an image download may take (vLLM's VLLM_IMAGE_FETCH_TIMEOUT). Default: 5.")
    g.add_argument("--max-media-bytes", type=positive_int, default=DEFAULT_MAX_BYTES, metavar="BYTES",
                   help="Largest encoded image (download, file or data URL). Default: 20 MiB.")
    g.add_argument("--max-image-pixels", type=positive_int, default=DEFAULT_MAX_PIXELS, metavar="N",
                   help="Most pixels (width x height) of one image, checked from its header before decoding. "
                        "Default: 50000000.")
    g = parser.add_argument_group("audio inputs (an audio-language model; see docs/audio.md); the URL flags above "
                                  "apply to audio_url parts too")
    g.add_argument("--max-audio-clip-filesize-mb", type=positive_float, default=DEFAULT_MAX_AUDIO_BYTES / 2**20,
                   metavar="MB", help="Largest encoded audio clip (input_audio data, download, file or data URL), in "
                                      "MiB (vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB). Default: 25.")
    g.add_argument("--max-audio-clip-seconds", type=positive_float, default=DEFAULT_MAX_AUDIO_SECONDS,
                   metavar="SECONDS", help="Longest audio clip, read from its header before decoding. Default: 600.")
    add_engine_args(parser, model_positional=True)


def _run_serve(args: argparse.Namespace) -> int:
    from llmplug import _configure_threads_before_torch

    _configure_threads_before_torch()
    import logging

    from llmplug.entrypoints.openai.api_server import ServerSettings, run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    settings = ServerSettings.from_args(args)
    return run_server(config_from_args(args).config, settings)

"""The OpenAI-compatible HTTP server (`llmplug serve`): FastAPI app, protocol models, endpoint handlers.

Exports `build_app` and `run_server`; importing this package imports FastAPI but not torch.
"""

from llmplug.entrypoints.openai.api_server import ServerSettings, build_app, run_server

__all__ = ["ServerSettings", "build_app", "run_server"]

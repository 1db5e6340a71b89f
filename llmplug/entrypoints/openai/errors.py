"""Errors as the OpenAI API reports them: a status code and `{"error": {message, type, param, code}}`."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

# OpenAI's error `type` for each status this server answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error the handlers raise to answer with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error body."""
    kind = ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: OpenAIError) -> JSONResponse:
    """A JSON response carrying `error`."""
    body = error_body(error.status, error.message, error.param, error.code)
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def status_phrase(status: int) -> str:
    """"Not Found" for 404, and so on."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"

"""OpenAI-style error bodies and SSE framing, pre-encoded where it matters.

The error body is the one the OpenAI API and vLLM return::

    {"error": {"message": str, "type": str, "param": null, "code": int}}

(vLLM: ``vllm/entrypoints/openai/protocol.py`` ``ErrorResponse``; it also sets
``code`` to the HTTP status.)
"""
from __future__ import annotations

from typing import Any

import orjson

#: the ``type`` of motor's error bodies, by status: the OpenAI SDK's exception class where it
#: has one for the status (``openai._client.OpenAI._make_status_error``: 400, 401, 403, 404,
#: 409, 422, 429, >= 500), the status's name + ``Error`` otherwise (vLLM's
#: ``ServiceUnavailableError`` for 503). The one mapping in motor: every process words its
#: errors through :func:`error_type` / :func:`error_body`.
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

SSE_DONE = b"data: [DONE]\n\n"

#: longest X-Request-Id motor accepts from a client (longer: 400); engines build their own
#: request ids from it (vLLM: ``chatcmpl-<id>``), so it must stay a sane size
MAX_REQUEST_ID_BYTES = 256


def error_type(status: int) -> str:
    """The error body ``type`` of ``status`` (:data:`_TYPES`; another 5xx is
    ``InternalServerError``, another status ``BadRequestError``)."""
    return _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """JSON bytes of an OpenAI error body for ``status``."""
    return orjson.dumps({"error": {"message": message, "type": error_type(status),
                                   "param": param, "code": status}})


def sse_error_event(status: int, message: str) -> bytes:
    """An SSE ``data:`` event carrying an OpenAI error object, followed by ``[DONE]``."""
    return b"data: " + error_body(status, message) + b"\n\n" + SSE_DONE


def max_tokens_field(body: dict[str, Any], chat: bool) -> Any:
    """The value that bounds an answer's length, as vLLM reads it (raw, ``None`` if absent).

    Chat (``/v1/chat/completions``): ``max_completion_tokens``, else the deprecated
    ``max_tokens``; completions: ``max_tokens``. (vLLM ``ChatCompletionRequest``
    ``to_sampling_params``; ``motor sim`` reads it the same way.)
    """
    if chat:
        v = body.get("max_completion_tokens")
        if v is not None:
            return v
    return body.get("max_tokens")


def max_tokens_of(body: dict[str, Any], chat: bool) -> int:
    """:func:`max_tokens_field` as an integer for load accounting (0 when absent or not an
    integer; booleans are not integers here)."""
    v = max_tokens_field(body, chat)
    return v if type(v) is int and v > 0 else 0   # bool is an int subclass: not counted

"""One error shape for every refusal at the door: vLLM's `{"error": {"message", "type", "param", "code"}}`.

`RequestError` is what parsers raise (it pickles whole, so a parse in a worker process keeps its
status and param). No aiohttp here: parser processes import this module.
"""

from __future__ import annotations

import msgspec

_enc = msgspec.json.Encoder()
JSON = "application/json"

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeout",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


class RequestError(Exception):
    """A request refused: HTTP status, message, offending parameter, OpenAI error type."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, err_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.err_type = err_type or _TYPES.get(status, "BadRequestError")

    def __reduce__(self):
        return (RequestError, (self.message, self.param, self.status, self.err_type))


def error_body(message: str, err_type: str, status: int, param: str | None = None) -> bytes:
    """vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}} with code = HTTP status."""
    return _enc.encode({"error": {"message": message, "type": err_type, "param": param, "code": status}})

"""OpenAI error bodies: `APIError`, and the status every engine exception deserves.

```
VLLMValidationError (a ValueError)  -> 400, param = error.parameter (renamed per endpoint)
other ValueError                     -> 400, param given by the caller (or null)
EngineSleepingError / EngineShutdownError -> 503     SleepModeUnavailableError -> 501
DeviceMemoryError (a wake found no memory) -> 503
EngineGenerateError / EngineDeadError     -> 500     anything else -> 500 (logged)
KVTransferError (the prefill instance's KV could not be read)     -> 502
```

The `param` of a validation error comes from the error itself (the layer that
rejected the value names the field); nothing here parses messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus

from fastapi.responses import JSONResponse

from vllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from vllm.exceptions import DeviceMemoryError, VLLMValidationError
from vllm.logger import init_logger
from vllm.v1.engine.exceptions import (
    EngineDeadError,
    EngineGenerateError,
    EngineShutdownError,
    EngineSleepingError,
    KVTransferError,
    SleepModeUnavailableError,
)

logger = init_logger(__name__)

# vLLM's error "type" names, by status.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    502: "BadGatewayError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def encodable(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (lone surrogates) as `\\udXXX` escapes.

    Error messages may quote user input (an unknown model name); the body must
    still encode, or the client gets a plain-text 500 instead of the error.
    """
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """An error answered with the OpenAI error body and `status`.

    `message` and `param` are made UTF-8 encodable (`encodable`), so building
    the response never fails, whatever user text they quote.
    """

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        message = encodable(str(message))
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = encodable(param) if param is not None else None

    def body(self) -> ErrorResponse:
        error_type = _ERROR_TYPES.get(self.status) or HTTPStatus(self.status).phrase.replace(
            " ", "") + "Error"
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=error_type, param=self.param,
                            code=self.status)
        )

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def error_from_exception(error: BaseException, param: str | None = None) -> APIError:
    """The HTTP status an engine-side exception deserves."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return validation_error(error, default=param)
    if isinstance(error, EngineSleepingError | EngineShutdownError | DeviceMemoryError):
        return APIError(503, str(error))
    if isinstance(error, SleepModeUnavailableError):
        return APIError(501, str(error))
    if isinstance(error, KVTransferError):
        return APIError(502, str(error))
    if isinstance(error, EngineGenerateError | EngineDeadError):
        return APIError(500, str(error))
    logger.exception("unexpected error while serving a request", exc_info=error)
    return APIError(500, f"internal error: {error!r}")


def validation_error(
    error: ValueError, renamed: Mapping[str, str] | None = None, default: str | None = None
) -> APIError:
    """400 for a rejected request value; `param` is the field the error names.

    Args:
        error: a `VLLMValidationError` names its field (`parameter`); a plain
            `ValueError` names none.
        renamed: engine field name -> this endpoint's request field (chat:
            "prompt" -> "messages", "max_tokens" -> "max_completion_tokens",
            "logprobs" -> "top_logprobs"). A message that starts with the
            engine's name is rewritten to start with the request's.
        default: the param when the error names no field.
    """
    message = str(error)
    field = error.parameter if isinstance(error, VLLMValidationError) else None
    if field is None:
        return APIError(400, message, default)
    param = (renamed or {}).get(field, field)
    if param != field and message.startswith(field):
        message = param + message[len(field):]
    return APIError(400, message, param)

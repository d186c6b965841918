"""OpenAI-style errors: one exception type that every layer raises, and its JSON body."""

from __future__ import annotations

from typing import Any

from pegainfer.protocol import RequestRejected

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
NOT_FOUND = "NotFoundError"


class APIError(Exception):
    """An error that is answered to the client with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,  # noqa: A002 - the OpenAI field is named "type"
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def to_rejection(self, request_id: str) -> RequestRejected:
        return RequestRejected(
            request_id=request_id,
            status=self.status,
            message=self.message,
            error_type=self.type,
            param=self.param,
            code=self.code,
        )

    @classmethod
    def from_rejection(cls, rejected: RequestRejected) -> APIError:
        return cls(
            rejected.status, rejected.message, rejected.error_type, rejected.param, rejected.code
        )

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, {self.type!r}, {self.param!r})"


def error_body(
    message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:  # noqa: A002
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 caused by the request's content."""
    return APIError(400, message, INVALID_REQUEST, param, code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", INVALID_REQUEST, "model", "model_not_found"
    )

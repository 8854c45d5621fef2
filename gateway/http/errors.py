"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, and the one table from
gRPC status codes (what the request path raises) to HTTP statuses."""

from __future__ import annotations

import json
from http import HTTPStatus

import grpc

from splitserve.gateway.validation import InvalidRequest

# gRPC status (generation.py's Abort, the key check's denial) -> HTTP status.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.FAILED_PRECONDITION: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.UNAUTHENTICATED: HTTPStatus.UNAUTHORIZED,
    grpc.StatusCode.PERMISSION_DENIED: HTTPStatus.FORBIDDEN,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPStatus.GATEWAY_TIMEOUT,
    grpc.StatusCode.UNIMPLEMENTED: HTTPStatus.NOT_IMPLEMENTED,
    grpc.StatusCode.INTERNAL: HTTPStatus.INTERNAL_SERVER_ERROR,
}

# HTTP status -> OpenAI's error `type` (what the openai SDK and its users read besides the status).
_ERROR_TYPE = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
}


class ApiError(Exception):
    """Ends an HTTP request with this status and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = HTTPStatus(status), message, param, code
        self.headers = headers or {}

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str, headers: dict[str, str] | None = None) -> ApiError:
        status = HTTP_STATUS.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
        return cls(status, message, code=code.name.lower(), headers=headers)

    def body(self) -> dict:
        error_type = _ERROR_TYPE.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def invalid_request(error: InvalidRequest) -> ApiError:
    """A validator's refusal, with the code and message OpenAI's API gives the same failure."""
    return bad_request(error.openai_message(), error.param, error.code)

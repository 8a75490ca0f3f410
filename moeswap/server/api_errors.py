"""The errors a client can cause, as OpenAI's body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx (or 5xx) status."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.code, e.param), status_code=e.status)


def invalid(errors: list) -> ApiError:
    """A request body's validation errors (pydantic's ``errors()``) as one ApiError."""
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if first.get("type") == "json_invalid":
        message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")
    else:
        message = f"{where or 'body'}: {first.get('msg', 'invalid value')}"
    return ApiError(400, message, param=where or None, code="invalid_value")

"""Every error the server answers, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

    400  a bad request: not JSON, not the request's shape, a bad or unsupported field (`param` names it)
    401  a missing or wrong API key (`code: invalid_api_key`)
    404  an unknown model (`code: model_not_found`) or route
    405  a route asked with the wrong method
    413  a body over `server.max_request_body` (`code: request_too_large`)
    500  a fault of the server's own (logged with its traceback; the client gets one line), or an internal
         error of the engine's that ended this request alone (the others go on)
    503  the server is shutting down, or its engine failed

Messages are one line and never echo a secret.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from kvstrata.serving.schemas import ErrorInfo, ErrorResponse

logger = logging.getLogger("kvstrata")


class APIError(Exception):
    """An error a client caused (or must be told of), answered in OpenAI's error shape."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        message = " ".join(message.split())
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=error_type, param=param, code=code)
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=self.info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def service_unavailable(message: str) -> APIError:
    return APIError(503, message, error_type="service_unavailable")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error, FastAPI's and Starlette's own included, in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        if not _says_json(request) and any(tuple(e.get("loc", ())) == ("body",) for e in exc.errors()):
            # FastAPI reads a body as JSON only when its Content-Type says so (curl -d sends a form's)
            content_type = request.headers.get("content-type") or "none"
            return APIError(400, f"the request body must be JSON, sent with Content-Type: application/json "
                                 f"(got {content_type.split(';')[0]})").response()
        return validation_error_to_api_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_error_to_api_error(request, exc).response()

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("kvstrata: %s %s failed", request.method, request.url.path)
        return APIError(500, f"internal server error ({type(exc).__name__})", error_type="server_error").response()


def http_error_to_api_error(request: Request, exc: StarletteHTTPException) -> APIError:
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        return APIError(404, f"no such route: {where}", code="not_found")
    if exc.status_code == 405:
        allowed = _methods_allowed(request) or (exc.headers or {}).get("Allow", "")
        return APIError(405, f"method not allowed: {where}" + (f" (allowed: {allowed})" if allowed else ""),
                        code="method_not_allowed",
                        headers={**(exc.headers or {}), **({"Allow": allowed} if allowed else {})})
    return APIError(exc.status_code, f"{where}: {exc.detail}", headers=exc.headers)


def _says_json(request: Request) -> bool:
    media_type = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def _methods_allowed(request: Request) -> str:
    """Every method some route of this path answers: Starlette's 405 names only the first route's, and one path
    (`/v1/cache/documents`) has a route for GET and another for POST."""
    methods = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def validation_error_to_api_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 (a body that is not JSON, or not the request's shape) as OpenAI's 400 naming
    the field at fault."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON{': ' + str(detail) if detail else ''}")
    param = ".".join(_field_path(first.get("loc", ()))) or None
    if first.get("type") == "extra_forbidden":
        message = "not a field this server knows or implements"
    elif first.get("type") == "value_error" and "error" in (first.get("ctx") or {}):
        message = str(first["ctx"]["error"])
    else:
        message = first.get("msg", "invalid value")
    return APIError(400, f"{param}: {message}" if param else f"request body: {message}", param=param)


def _field_path(loc) -> list[str]:
    """The fields of a pydantic error location: where the field was ("body", "query", "path") and the
    tags pydantic adds for the member of a union it tried (`str`, `list[str]`) are not fields."""
    path = []
    for part in loc:
        if part in ("body", "query", "path") and not path:
            continue
        if isinstance(part, str) and not part.isidentifier() or part in _UNION_TAGS:
            break  # the union member tried, and where inside it: the field itself is the clearer name
        path.append(str(part))
    return path


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}

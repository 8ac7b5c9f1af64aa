"""HTTP routes a pack registers on ``PromptServer.instance.routes``, served from the env.

Packs add routes to ComfyUI's server when their module is imported::

    @PromptServer.instance.routes.get("/mypack/models/{kind}")
    async def models(request):
        return web.json_response(list_models(request.match_info["kind"]))

In the env, ``PromptServer.instance.routes`` is ``RouteTable``: it records each route (method,
path template, handler) and returns the handler unchanged. The scan reports the routes; the
host registers one forwarding handler per route on the server's real route table
(``comfy_env.comfyui._routes``), and each request comes here as plain data::

    browser -> ComfyUI (aiohttp) -> host forwarder -> worker call serve(pack, method, path,
        request data) -> the pack's handler(Request) -> its response as plain data -> host
        -> aiohttp Response

``Request`` offers what handlers use of aiohttp's (method, path, query, match_info, headers,
``read``/``text``/``json``/``post`` for url-encoded forms); ``aiohttp.web`` has a stand-in here
when the env lacks aiohttp (``json_response``, ``Response``, ``FileResponse`` and the common
``HTTPException`` classes). Multipart uploads are not forwarded (``post`` says so).
``routes.static(prefix, path)`` is served by the host from the same directory.
Stdlib only, Python 3.8+.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import types
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import parse_qsl

# (pack, method, path template, handler) in the order packs registered them, and the static
# directories; a pack is (pack_dir, module), the one whose module was being imported (several
# packs may share an env's worker).
Pack = Tuple[str, str]
ROUTES: List[Tuple[Pack, str, str, Callable[..., Any]]] = []
STATIC: List[Tuple[Pack, str, str]] = []
LOADING: List[Pack] = []  # the pack whose module is being imported (scan.load_module)


def _owner() -> Pack:
    return LOADING[-1] if LOADING else ("", "")


class RouteTable:
    """``PromptServer.instance.routes`` in the env (aiohttp's ``RouteTableDef`` decorators)."""

    def route(self, method: str, path: str, **kwargs: Any) -> Callable[[Any], Any]:
        def register(handler: Any) -> Any:
            ROUTES.append((_owner(), str(method).upper(), str(path), handler))
            return handler

        return register

    def get(self, path: str, **kwargs: Any) -> Callable[[Any], Any]:
        return self.route("GET", path)

    def post(self, path: str, **kwargs: Any) -> Callable[[Any], Any]:
        return self.route("POST", path)

    def put(self, path: str, **kwargs: Any) -> Callable[[Any], Any]:
        return self.route("PUT", path)

    def patch(self, path: str, **kwargs: Any) -> Callable[[Any], Any]:
        return self.route("PATCH", path)

    def delete(self, path: str, **kwargs: Any) -> Callable[[Any], Any]:
        return self.route("DELETE", path)

    def head(self, path: str, **kwargs: Any) -> Callable[[Any], Any]:
        return self.route("HEAD", path)

    def static(self, prefix: str, path: str, **kwargs: Any) -> None:
        STATIC.append((_owner(), str(prefix), os.path.abspath(str(path))))


def table(pack: Pack) -> Dict[str, Any]:
    """What the scan reports of ``pack``: its routes' methods and path templates, its static
    directories."""
    return {
        "routes": [[method, path] for owner, method, path, _ in ROUTES if owner == pack],
        "static": [[prefix, path] for owner, prefix, path in STATIC if owner == pack],
    }


class _Url:
    def __init__(self, path: str, query: Dict[str, str]) -> None:
        self.path = path
        self.query = query


class Request:
    """An HTTP request forwarded by the host: what handlers use of aiohttp's ``Request``."""

    def __init__(self, data: Dict[str, Any]) -> None:
        self.method: str = data.get("method", "GET")
        self.path: str = data.get("path", "/")
        self.query: Dict[str, str] = dict(data.get("query") or [])
        self.match_info: Dict[str, str] = dict(data.get("match_info") or {})
        self.headers: Dict[str, str] = dict(data.get("headers") or {})
        self.content_type: str = data.get("content_type") or "application/octet-stream"
        self.rel_url = _Url(self.path, self.query)
        self._body: bytes = bytes(data.get("body") or b"")
        self.can_read_body = bool(self._body)
        self.body_exists = bool(self._body)

    async def read(self) -> bytes:
        return self._body

    async def text(self) -> str:
        return self._body.decode("utf-8")

    async def json(self, *, loads: Callable[[str], Any] = json.loads) -> Any:
        return loads(await self.text())

    async def post(self) -> Dict[str, str]:
        if self.content_type.startswith("multipart/"):
            raise NotImplementedError(
                "comfy-env forwards url-encoded forms to an isolated pack's routes, not "
                "multipart uploads: upload to ComfyUI's own /upload/image, then name the file"
            )
        return dict(parse_qsl(self._body.decode("utf-8"), keep_blank_values=True))


# ---- aiohttp.web, for envs without aiohttp ------------------------------------------------


class Response(Exception):
    """The stand-in's ``web.Response`` (also the base of its HTTP exceptions, as in aiohttp)."""

    status_code = 200

    def __init__(
        self,
        *,
        body: Any = None,
        status: Optional[int] = None,
        reason: Optional[str] = None,
        text: Optional[str] = None,
        headers: Optional[Dict[str, str]] = None,
        content_type: Optional[str] = None,
        charset: Optional[str] = None,
    ) -> None:
        super().__init__(reason or "")
        self.status = int(status if status is not None else self.status_code)
        if text is not None:
            body = text.encode(charset or "utf-8")
            content_type = content_type or "text/plain"
        self.body = body if body is not None else b""
        self.headers = dict(headers or {})
        self.content_type = content_type or "application/octet-stream"


class FileResponse(Response):
    def __init__(self, path: Any, status: int = 200, headers: Optional[Dict[str, str]] = None):
        super().__init__(status=status, headers=headers)
        self._path = os.fspath(path)


def json_response(
    data: Any = None,
    *,
    text: Optional[str] = None,
    status: int = 200,
    headers: Optional[Dict[str, str]] = None,
    content_type: str = "application/json",
    dumps: Callable[[Any], str] = json.dumps,
) -> Response:
    return Response(
        text=dumps(data) if text is None else text,
        status=status,
        headers=headers,
        content_type=content_type,
    )


def _http_error(name: str, code: int) -> type:
    return type(name, (Response,), {"status_code": code})


HTTPException = _http_error("HTTPException", 500)


def _lacks(name: str) -> Callable[[str], Any]:
    def __getattr__(attr: str) -> Any:  # PEP 562: what the stand-in lacks, said as such
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(
            "module %r has no attribute %r: this env has no aiohttp, and comfy-env's stand-in "
            "offers only what a pack's server routes use (web.Response, web.json_response, "
            "web.FileResponse, HTTP errors); install aiohttp in the env for the rest" % (name, attr)
        )

    return __getattr__


def install_aiohttp() -> None:
    """``aiohttp.web`` stand-in, when the env has no aiohttp (idempotent)."""
    if "aiohttp" in sys.modules:
        return
    try:
        import importlib.util

        if importlib.util.find_spec("aiohttp") is not None:
            return
    except (ImportError, ValueError):
        pass
    names = {
        "Request": Request,
        "Response": Response,
        "StreamResponse": Response,
        "FileResponse": FileResponse,
        "json_response": json_response,
        "HTTPException": HTTPException,
        "RouteTableDef": RouteTable,
    }
    for code, name in (
        (400, "HTTPBadRequest"),
        (401, "HTTPUnauthorized"),
        (403, "HTTPForbidden"),
        (404, "HTTPNotFound"),
        (409, "HTTPConflict"),
        (500, "HTTPInternalServerError"),
    ):
        names[name] = _http_error(name, code)
    web = types.ModuleType("aiohttp.web", "comfy-env stand-in for aiohttp.web (routes only)")
    web.__dict__.update(names)
    aiohttp = types.ModuleType("aiohttp", "comfy-env stand-in for aiohttp (routes only)")
    aiohttp.web = web  # type: ignore[attr-defined]
    aiohttp.__path__ = []
    for module in (aiohttp, web):
        module.__comfy_env_standin__ = True  # type: ignore[attr-defined]
        setattr(module, "__getattr__", _lacks(module.__name__))  # noqa: B010 - PEP 562
    sys.modules["aiohttp"] = aiohttp
    sys.modules["aiohttp.web"] = web


# ---- serving ------------------------------------------------------------------------------


def _body_bytes(response: Any) -> bytes:
    body = getattr(response, "body", None)
    if isinstance(body, (bytes, bytearray, memoryview)):
        return bytes(body)
    value = getattr(body, "_value", None)  # an aiohttp payload
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    text = getattr(response, "text", None)
    if isinstance(text, str):
        return text.encode("utf-8")
    if body is None:
        return b""
    raise TypeError("cannot forward a response body of type %s" % type(body).__name__)


def reply_of(response: Any) -> Dict[str, Any]:
    """A handler's response (aiohttp's or the stand-in's, a ``FileResponse``) as plain data."""
    if response is None:
        raise TypeError("the route handler returned None instead of a response")
    headers = {
        str(k): str(v)
        for k, v in dict(getattr(response, "headers", {}) or {}).items()
        if str(k).lower() not in ("content-length", "content-type", "transfer-encoding")
    }
    reply: Dict[str, Any] = {
        "status": int(getattr(response, "status", 200)),
        "headers": headers,
        "content_type": getattr(response, "content_type", None),
    }
    path = getattr(response, "_path", None)
    if path is not None and type(response).__name__ == "FileResponse":
        reply["file"] = os.path.abspath(os.fspath(path))
        return reply
    reply["body"] = _body_bytes(response)
    return reply


def serve(pack: Pack, method: str, path: str, request: Dict[str, Any]) -> Dict[str, Any]:
    """Run the handler ``pack`` registered for ``(method, path)`` on ``request``."""
    handlers = [
        h for owner, m, template, h in ROUTES if (owner, m, template) == (pack, method, path)
    ]
    if not handlers:
        return {"status": 404, "headers": {}, "content_type": "text/plain", "body": b""}
    handler = handlers[0]
    try:
        result = handler(Request(request))
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
    except Exception as exc:  # aiohttp's HTTP exceptions are responses
        if hasattr(exc, "status") and (hasattr(exc, "body") or hasattr(exc, "text")):
            return reply_of(exc)
        raise
    return reply_of(result)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable

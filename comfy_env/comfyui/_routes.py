"""A pack's HTTP routes, served by ComfyUI and answered in the pack's env.

A pack that registers routes on ``PromptServer.instance.routes`` at import does so in its env,
where the stand-in records them (``comfy_env_worker.comfyui.routes``); the scan reports them.
``register`` adds one forwarding handler per route to the server's real route table (ComfyUI
adds that table to its aiohttp app after loading the custom nodes)::

    request -> forward (the server's event loop) -> await worker.arun(serve_route, request as
        plain data: method, path, query, match_info, headers, body) -> the pack's handler in
        the env -> its response as plain data -> aiohttp Response (or FileResponse)

A failure on the way (the worker crashed, the deadline passed, the handler raised) is a 502
whose JSON body says what happened; the server and the next request are unaffected (a crashed
worker is replaced as for a node call). Static directories (``routes.static``) are served by
the server itself, from the same path. Outside a ComfyUI server nothing is registered.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from ._scan import server_directories

if TYPE_CHECKING:
    from . import _Pack

log = logging.getLogger("comfy_env.comfyui")

ROUTE_TARGET = "comfy_env_worker.comfyui.scan:serve_route"
ROUTE_TIMEOUT = 60.0  # deadline of a forwarded request when the pack sets no timeout


def register(pack: _Pack) -> int:
    """Register the pack's routes and static directories with the running ComfyUI server;
    returns how many. No server (``server.PromptServer.instance``): nothing, 0."""
    routes = pack.scan.get("routes") or []
    static = pack.scan.get("static") or []
    if not routes and not static:
        return 0
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    table = getattr(instance, "routes", None)
    if table is None:
        log.debug("comfy-env: no ComfyUI server here; routes of %s not served", pack.spec.pack_dir)
        return 0
    for method, path in routes:
        table.route(method, path)(_forwarder(pack, method, path))
    for prefix, directory in static:
        table.static(prefix, directory)
    log.info(
        "comfy-env: node pack %s serves %d route(s) from its env: %s",
        pack.spec.shown_package,
        len(routes),
        ", ".join(f"{m} {p}" for m, p in routes) or "(static only)",
    )
    return len(routes) + len(static)


def _forwarder(pack: _Pack, method: str, path: str) -> Any:
    async def forward(request: Any) -> Any:
        from aiohttp import web  # ComfyUI's; imported when a request comes

        # Plain str, bytes, lists and dicts only: aiohttp's own types (multidict's istr, ...)
        # need not be importable in the env.
        data = {
            "method": str(request.method),
            "path": str(request.path),
            "query": [(str(k), str(v)) for k, v in request.query.items()],
            "match_info": {str(k): str(v) for k, v in request.match_info.items()},
            "headers": {str(k): str(v) for k, v in request.headers.items()},
            "content_type": str(request.content_type),
            "body": bytes(await request.read()),
        }
        spec = pack.spec
        kind = pack.scan.get("kind", "v1")
        args = (spec.pack_dir, spec.module, kind, method, path, data, server_directories(spec))
        try:
            reply = await pack.worker.arun(
                ROUTE_TARGET, args, timeout=pack.timeout or ROUTE_TIMEOUT
            )
        except Exception as exc:  # noqa: BLE001 - told to the client; the server goes on
            log.warning(
                "comfy-env: %s %s of node pack %s failed in its env: %s: %s",
                method,
                path,
                spec.shown_package,
                type(exc).__name__,
                exc,
            )
            return web.json_response(
                {
                    "error": f"comfy-env: the pack's handler failed in its env: "
                    f"{type(exc).__name__}: {exc}"
                },
                status=502,
            )
        headers = reply.get("headers") or {}
        if reply.get("file"):
            return web.FileResponse(reply["file"], status=reply["status"], headers=headers)
        return web.Response(
            body=reply.get("body") or b"",
            status=reply["status"],
            headers=headers,
            content_type=reply.get("content_type") or "application/octet-stream",
        )

    forward.__name__ = f"comfy_env_route_{method.lower()}"
    return forward

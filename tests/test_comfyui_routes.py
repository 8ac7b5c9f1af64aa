"""A pack's HTTP routes (``PromptServer.instance.routes``) registered in its env and answered
there: the scan reports them, each request runs the pack's handler in the worker, and the
host registers one forwarder per route with the server (``comfyui._routes``). The real server
path (aiohttp in ComfyUI) is in ``tests_comfyui/test_comfyui.py``."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import comfy_env
from comfy_env.comfyui import isolate
from comfy_env.comfyui._routes import ROUTE_TARGET

NODES = """
import os

from aiohttp import web
from server import PromptServer

routes = PromptServer.instance.routes


@routes.get("/{prefix}/info/{{name}}")
async def info(request):
    if request.match_info["name"] == "missing":
        raise web.HTTPNotFound(text="no such thing")
    return web.json_response(
        {{"name": request.match_info["name"], "q": request.query.get("q"), "pid": os.getpid()}}
    )


@routes.post("/{prefix}/echo")
async def echo(request):
    body = await request.json()
    return web.json_response({{"echo": body, "method": request.method}}, status=201)


routes.static("/{prefix}/static", os.path.dirname(__file__))


class Noop:
    RETURN_TYPES = ()
    FUNCTION = "run"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{}}}}

    def run(self):
        return ()


NODE_CLASS_MAPPINGS = {{"Noop": Noop}}
"""


def _pack(root: Path, prefix: str) -> Path:
    root.mkdir()
    (root / "__init__.py").write_text("raise RuntimeError('the pack init must not run')\n")
    (root / "nodes.py").write_text(NODES.format(prefix=prefix))
    return root


def _pack_of(mappings: dict[str, type]) -> Any:
    return mappings["Noop"]._comfy_env_node.pack  # type: ignore[attr-defined]


def _serve(pack: Any, method: str, path: str, **request: Any) -> dict[str, Any]:
    spec = pack.spec
    data = {"method": method, "path": path, **request}
    args = (spec.pack_dir, spec.module, "v1", method, path, data, {})
    reply: dict[str, Any] = pack.worker.run(ROUTE_TARGET, args, timeout=30)
    return reply


def test_a_pack_s_routes_are_recorded_in_its_env_and_answered_there(
    pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings, _ = isolate(
        str(_pack(tmp_path / "a", "a")), None, "nodes", pool=pool, cache_dir=str(tmp_path / "c")
    )
    pack = _pack_of(mappings)
    assert pack.scan["routes"] == [["GET", "/a/info/{name}"], ["POST", "/a/echo"]]
    assert pack.scan["static"] == [["/a/static", str(tmp_path / "a")]]
    got = _serve(pack, "GET", "/a/info/{name}", match_info={"name": "box"}, query=[("q", "1")])
    assert got["status"] == 200 and got["content_type"] == "application/json"
    body = json.loads(got["body"])
    assert body["name"] == "box" and body["q"] == "1"
    assert body["pid"] == pool.stats()[sys.prefix].pid  # answered in the worker
    posted = _serve(
        pack,
        "POST",
        "/a/echo",
        body=json.dumps({"x": [1, 2]}).encode(),
        content_type="application/json",
    )
    assert posted["status"] == 201 and json.loads(posted["body"]) == {
        "echo": {"x": [1, 2]},
        "method": "POST",
    }
    missing = _serve(pack, "GET", "/a/info/{name}", match_info={"name": "missing"})
    assert missing["status"] == 404 and missing["body"] == b"no such thing"
    assert _serve(pack, "GET", "/a/nothing")["status"] == 404


def test_two_packs_in_one_env_each_report_only_their_own_routes(
    pool: comfy_env.Pool, tmp_path: Path
) -> None:
    cache = str(tmp_path / "c")
    a, _ = isolate(str(_pack(tmp_path / "a", "a")), None, "nodes", pool=pool, cache_dir=cache)
    b, _ = isolate(str(_pack(tmp_path / "b", "b")), None, "nodes", pool=pool, cache_dir=cache)
    assert [p for _, p in _pack_of(a).scan["routes"]] == ["/a/info/{name}", "/a/echo"]
    assert [p for _, p in _pack_of(b).scan["routes"]] == ["/b/info/{name}", "/b/echo"]
    assert pool.stats()[sys.prefix].spawns == 1  # one worker scanned both


def test_the_routes_are_registered_with_the_running_server(
    pool: comfy_env.Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a server, each route gets a forwarder on ``PromptServer.instance.routes`` (ComfyUI
    adds that table to its app after loading the packs), static directories are served by
    the server itself."""
    registered: list[tuple[str, str, Any]] = []
    static: list[tuple[str, str]] = []

    class Table:
        def route(self, method: str, path: str) -> Any:
            return lambda handler: registered.append((method, path, handler))

        def static(self, prefix: str, path: str) -> None:
            static.append((prefix, path))

    server = types.ModuleType("server")
    server.PromptServer = types.SimpleNamespace(  # type: ignore[attr-defined]
        instance=types.SimpleNamespace(routes=Table())
    )
    monkeypatch.setitem(sys.modules, "server", server)
    isolate(str(_pack(tmp_path / "a", "a")), None, "nodes", pool=pool, cache_dir=str(tmp_path))
    assert [(m, p) for m, p, _ in registered] == [("GET", "/a/info/{name}"), ("POST", "/a/echo")]
    assert static == [("/a/static", str(tmp_path / "a"))]


def test_the_aiohttp_stand_in_says_what_it_lacks() -> None:
    """An env without aiohttp gets a stand-in with the route helpers only; anything else is
    an AttributeError that says so, not a bare one. (Pure module logic: run here.)"""
    import importlib.util

    from comfy_env_worker.comfyui import routes

    if importlib.util.find_spec("aiohttp") is not None:
        pytest.skip("aiohttp is installed here: the stand-in is never installed over it")
    try:
        routes.install_aiohttp()
        import aiohttp  # the stand-in

        with pytest.raises(AttributeError, match="install aiohttp in the env"):
            aiohttp.ClientSession  # noqa: B018 - the lookup is the test
        assert aiohttp.web.json_response({"a": 1}).body == b'{"a": 1}'
        assert aiohttp.web.HTTPNotFound().status == 404
    finally:
        sys.modules.pop("aiohttp", None)
        sys.modules.pop("aiohttp.web", None)

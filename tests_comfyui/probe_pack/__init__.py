"""A test-only custom node pack that runs *inside* the ComfyUI server (not isolated): HTTP routes
that show and instrument ComfyUI's model manager, for the integration tests of worker-resident
models. It adds no nodes.

- ``GET /ce_probe/models``: ComfyUI's ``current_loaded_models`` and comfy-env's registry.
- ``POST /ce_probe/arm``: the next ``unload_all_models`` (the one ``POST /free`` runs on the
  prompt thread) runs over a list that records every mutation with its thread and stack, and
  every retirement callback of the registry is recorded (and followed by a full garbage
  collection: the worst moment for a finalizer to pop entries).
- ``GET /ce_probe/report``: what the armed run saw (``done`` once it ran).
- ``POST /ce_probe/reap``: runs the default pool's idle reaper as if a day had passed.
"""

import gc
import threading
import time
import traceback

import comfy.model_management as mm
from aiohttp import web
from server import PromptServer

import comfy_env
from comfy_env.comfyui import _models

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}

_REPORT = {"armed": False, "done": False}


def _model(m):
    return {
        "label": m.label,
        "env": m.env,
        "generation": m.generation,
        "state": m.state,
        "size": m.model_size(),
        "measured": m.size,
        "detach_calls": m.detach_calls,
        "evicted_by": m.evicted_by,
    }


def _entry(entry):
    model = entry.model
    if isinstance(model, _models.WorkerModel):
        return {"ours": True, "dead": False, **_model(model)}
    return {"ours": False, "dead": model is None, "class": type(model).__name__}


def _snapshot():
    registry = _models.REGISTRY
    return {
        "entries": [_entry(e) for e in list(mm.current_loaded_models)],
        "live": [_model(m) for m in registry.live()],
        "retired": [_model(m) for m in registry.retired()],
        "retirements": registry.retirements,
        "purged": registry.purged_entries,
    }


class _GuardedList(list):
    """ComfyUI's list, recording who mutates it (and from where) while the armed run goes."""

    def _note(self, op):
        stack = [f.name for f in traceback.extract_stack()[:-2]]
        _REPORT["mutations"].append(
            {"op": op, "thread": threading.current_thread().name, "stack": stack[-8:]}
        )

    def pop(self, *args):
        self._note("pop")
        return super().pop(*args)

    def insert(self, *args):
        self._note("insert")
        return super().insert(*args)

    def remove(self, *args):
        self._note("remove")
        return super().remove(*args)

    def append(self, *args):
        self._note("append")
        return super().append(*args)

    def __delitem__(self, *args):
        self._note("delitem")
        return super().__delitem__(*args)

    def __setitem__(self, *args):
        self._note("setitem")
        return super().__setitem__(*args)


_real_unload_all = mm.unload_all_models


def _armed_unload_all():
    registry = _models.REGISTRY
    real_retired = registry.generation_retired
    state = {"in_free": True}

    def traced(env, generation):
        moved = real_retired(env, generation)
        _REPORT["retirements"].append(
            {
                "generation": generation,
                "moved": moved,
                "in_free": state["in_free"],
                "thread": threading.current_thread().name,
            }
        )
        gc.collect()  # a finalizer of a dropped proxy would run now, mid-iteration
        return moved

    original = mm.current_loaded_models
    guarded = _GuardedList(original)
    _REPORT["before"] = _snapshot()
    registry.generation_retired = traced
    mm.current_loaded_models = guarded
    try:
        _real_unload_all()
        _REPORT["error"] = None
    except Exception:
        _REPORT["error"] = traceback.format_exc()
        raise
    finally:
        state["in_free"] = False
        mm.current_loaded_models = original
        original[:] = guarded
        del registry.generation_retired
        mm.unload_all_models = _real_unload_all
        _REPORT["after"] = _snapshot()
        _REPORT["done"] = True


@PromptServer.instance.routes.get("/ce_probe/models")
async def models(request):
    return web.json_response(_snapshot())


@PromptServer.instance.routes.post("/ce_probe/arm")
async def arm(request):
    _REPORT.clear()
    _REPORT.update(armed=True, done=False, mutations=[], retirements=[], error=None)
    mm.unload_all_models = _armed_unload_all
    return web.json_response({"armed": True})


@PromptServer.instance.routes.get("/ce_probe/report")
async def report(request):
    return web.json_response(_REPORT)


@PromptServer.instance.routes.post("/ce_probe/reap")
async def reap(request):
    pool = comfy_env.default_pool()
    reaped = pool.reap_idle(time.monotonic() + 10 * (pool.config.idle_timeout or 0) + 86400)
    refs = {env: [w.live_refs for w in st.workers] for env, st in pool.stats().items()}
    return web.json_response({"reaped": reaped, "live_refs": refs, **_snapshot()})

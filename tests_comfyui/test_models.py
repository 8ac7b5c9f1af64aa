"""Worker-resident models inside ComfyUI's memory management, on the real server.

The numpy example pack's ``CE_LoadBigModel`` keeps a large array in its worker; each run is
registered with ComfyUI's model manager. The test-only probe pack (``probe_pack``, running in
the server) shows ``current_loaded_models`` and comfy-env's registry, and instruments one
``unload_all_models`` run (the one ``POST /free`` makes on ComfyUI's prompt thread).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import psutil
from conftest import Server

MIB = 1024 * 1024
_tags = itertools.count(1000)


def _load_prompt(*loaders: dict[str, Any]) -> dict[str, Any]:
    """Loaders as nodes with fresh ids (labels of registered models name the node id) and
    fresh tags (no earlier cache entry matches), in order, all used by the output node "99"."""
    prompt: dict[str, Any] = {}
    use: dict[str, Any] = {}
    for n, inputs in enumerate(loaders):
        node = str(next(_tags))
        prompt[node] = {
            "class_type": "CE_LoadBigModel",
            "inputs": {"tag": next(_tags), "crash_on_release": False, **inputs},
        }
        use[("model", "model2", "model3")[n]] = [node, 0]
    prompt["99"] = {"class_type": "CE_UseBigModel", "inputs": use}
    return prompt


def _report(server: Server, prompt: dict[str, Any]) -> dict[str, Any]:
    history, _ = server.run(prompt)
    assert history["status"]["status_str"] == "success", history["status"]
    report: dict[str, Any] = history["outputs"]["99"]["report"][0]
    return report


def _probe(server: Server) -> dict[str, Any]:
    snapshot: dict[str, Any] = server.get("/ce_probe/models")
    return snapshot


def _ours(entries: list[dict[str, Any]], labels: set[str]) -> list[dict[str, Any]]:
    return [e for e in entries if e.get("label") in labels]


def _labels(prompt: dict[str, Any]) -> set[str]:
    loaders = [n for n, v in prompt.items() if v["class_type"] == "CE_LoadBigModel"]
    return {f"CE_LoadBigModel#{n}" for n in loaders}


def _wait(predicate: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _free(server: Server) -> None:
    status, _ = server.post("/free", {"unload_models": True})
    assert status == 200


def test_a_worker_model_is_counted_by_comfyui_and_post_free_returns_its_memory(
    server: Server,
) -> None:
    prompt = _load_prompt({"megabytes": 256})
    labels = _labels(prompt)
    first = _report(server, prompt)
    [entry] = _ours(_probe(server)["entries"], labels)
    assert entry["state"] == "loaded" and entry["size"] == entry["measured"] == 256 * MIB
    rss_loaded = psutil.Process(first["pid"]).memory_info().rss
    # ComfyUI's INFO line for each registration goes to comfy-env's debug log instead
    assert "Requested to load WorkerResident" not in server.log_text()

    _free(server)
    _wait(lambda: not _ours(_probe(server)["entries"], labels))
    rss_freed = psutil.Process(first["pid"]).memory_info().rss
    print(
        f"\nworker RSS: {rss_loaded / MIB:.0f} MiB with a 256 MiB model, "
        f"{rss_freed / MIB:.0f} MiB after POST /free (drop {(rss_loaded - rss_freed) / MIB:.0f})"
    )
    assert rss_loaded - rss_freed >= 200 * MIB  # the worker released it; the worker lives on
    [evicted] = _ours(_probe(server)["retired"], labels)
    assert evicted["evicted_by"] == "comfyui" and evicted["size"] == 0

    second = _report(server, prompt)  # the same prompt: the loader runs again, no failure
    assert second["pid"] == first["pid"] and second["loads"] == first["loads"] + 1
    [entry] = _ours(_probe(server)["entries"], labels)
    assert entry["state"] == "loaded" and entry["size"] == 256 * MIB
    assert not _ours(_probe(server)["retired"], labels)  # dropped at that registration


def test_a_worker_models_size_follows_the_worker(server: Server) -> None:
    prompt = _load_prompt({"megabytes": 8})
    prompt["99"]["inputs"]["grow_megabytes"] = 16  # the user node loads more into the model
    _report(server, prompt)
    [entry] = _ours(_probe(server)["entries"], _labels(prompt))
    assert entry["measured"] == entry["size"] == 24 * MIB


def test_a_worker_crash_during_an_eviction_pass_leaves_comfyuis_list_consistent(
    server: Server,
) -> None:
    # The smallest model sorts first in free_memory's order; freeing it kills the worker.
    prompt = _load_prompt(
        {"megabytes": 1, "crash_on_release": True}, {"megabytes": 16}, {"megabytes": 32}
    )
    crasher, *others = [f"CE_LoadBigModel#{n}" for n in list(prompt)[:3]]
    first = _report(server, prompt)
    before = _ours(_probe(server)["entries"], {crasher, *others})
    assert len(before) == 3
    generation = before[0]["generation"]

    status, _ = server.post("/ce_probe/arm", {})
    assert status == 200
    _free(server)
    report = _wait(lambda: (r := server.get("/ce_probe/report"))["done"] and r)

    # no exception out of ComfyUI's free_memory
    assert report["error"] is None, report["error"]
    # the replacement's callback fired inside the iteration (from the pool's event thread, and
    # again, finding nothing left to do, from the eviction that met the dead worker on the
    # prompt thread) and retired the proxies ComfyUI had not reached yet
    inside = [r for r in report["retirements"] if r["in_free"] and r["generation"] == generation]
    assert sum(r["moved"] for r in inside) >= 2, report["retirements"]
    assert "comfy-env-events" in {r["thread"] for r in inside} or len(inside) == 1
    # nobody mutated the list during the iteration: the only mutations are free_memory's own
    # pops after it, on the prompt thread (no finalizer, no callback, no other thread)
    mutations = report["mutations"]
    assert mutations and all(m["op"] == "pop" for m in mutations), mutations
    threads = {m["thread"] for m in mutations}
    assert len(threads) == 1 and "comfy-env-events" not in threads, threads
    for m in mutations:
        assert m["stack"][-1] == "free_memory", m
        assert not {"detach", "model_unload", "cleanup_models", "generation_retired"} & set(
            m["stack"]
        ), m
    # no skipped entry: ComfyUI unloaded each exactly once, and none of them is listed now
    after = report["after"]
    mine = {m["label"]: m for m in after["retired"] if m["label"] in {crasher, *others}}
    assert set(mine) == {crasher, *others}  # retired proxies are kept alive ...
    assert all(m["detach_calls"] == 1 for m in mine.values()), mine
    assert mine[crasher]["state"] == "evicted"
    assert all(mine[label]["state"] == "stale" and mine[label]["size"] == 0 for label in others)
    assert not _ours(after["entries"], {crasher, *others})
    assert not any(e["dead"] for e in after["entries"])
    assert _wait(lambda: _gone(first["pid"]))

    # ... until the next registration, which runs in the next generation
    again = _load_prompt({"megabytes": 4})
    second = _report(server, again)
    assert second["pid"] != first["pid"]
    snapshot = _probe(server)
    assert not _ours(snapshot["retired"], {crasher, *others})
    [entry] = _ours(snapshot["entries"], _labels(again))
    assert entry["generation"] > generation and entry["state"] == "loaded"
    assert not [e for e in snapshot["entries"] if e.get("state") == "stale"]


def test_after_a_crash_a_proxy_reports_itself_unloaded_and_leaves_at_the_next_load(
    server: Server,
) -> None:
    prompt = _load_prompt({"megabytes": 8})
    labels = _labels(prompt)
    _report(server, prompt)
    # The same loader (cached by ComfyUI, so its model stays in ComfyUI's hands) and a node
    # that crashes the worker.
    crash = {
        **prompt,
        "1": {"class_type": "CE_Segfault", "inputs": {"value": next(_tags)}},
        "98": {"class_type": "CE_Digest", "inputs": {"number": ["1", 0]}},
    }
    history, _ = server.run(crash)
    assert history["status"]["status_str"] == "error"
    [stale] = _wait(lambda: [e for e in _ours(_probe(server)["entries"], labels) if e["size"] == 0])
    assert not stale["dead"]  # still listed, kept alive, reporting 0 bytes
    _wait(lambda: _ours(_probe(server)["retired"], labels))  # the retirement event arrived
    purged = _probe(server)["purged"]

    again = _load_prompt({"megabytes": 8})
    _report(server, again)
    snapshot = _probe(server)
    assert not _ours(snapshot["entries"], labels)  # the stale entry is gone
    assert snapshot["purged"] > purged
    assert [e["state"] for e in _ours(snapshot["entries"], _labels(again))] == ["loaded"]


def test_the_reaper_evicts_through_the_model_manager_before_retiring_the_worker(
    server: Server,
) -> None:
    prompt = _load_prompt({"megabytes": 64})
    labels = _labels(prompt)
    first = _report(server, prompt)
    [entry] = _ours(_probe(server)["entries"], labels)
    reaped = server.post("/ce_probe/reap", {})[1]
    assert reaped["reaped"] >= 1, reaped
    assert not any(n for env in reaped["live_refs"].values() for n in env), reaped
    assert not _ours(reaped["entries"], labels)  # gone from ComfyUI's list ...
    [evicted] = _ours(reaped["retired"], labels)
    assert evicted["evicted_by"] == "reaper" and evicted["detach_calls"] == 1  # ... unloaded
    assert _wait(lambda: _gone(first["pid"]))

    second = _report(server, prompt)  # the same prompt: like a first use, in a fresh worker
    assert second["pid"] != first["pid"] and second["loads"] == 1
    [again] = _ours(_probe(server)["entries"], labels)
    assert again["generation"] > entry["generation"] and again["state"] == "loaded"


def test_a_model_the_output_cache_drops_frees_the_workers_memory_without_another_call(
    server: Server,
) -> None:
    # A kept model, then a workflow that reaches no worker of its env: ComfyUI's output cache
    # drops the loader's outputs, the run's RemoteRef is garbage collected, and the worker
    # frees the model at once (before, it kept it until the env's next call, or the reaper).
    prompt = _load_prompt({"megabytes": 256})
    labels = _labels(prompt)
    first = _report(server, prompt)
    pid = first["pid"]
    [entry] = _ours(_probe(server)["entries"], labels)
    assert entry["state"] == "loaded"
    rss_loaded = psutil.Process(pid).memory_info().rss

    other = {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": next(_tags)},
        },
        "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
    }
    history, _ = server.run(other)
    assert history["status"]["status_str"] == "success", history["status"]
    started = time.monotonic()
    _wait(lambda: rss_loaded - psutil.Process(pid).memory_info().rss >= 200 * MIB, 5.0)
    took = time.monotonic() - started
    rss_freed = psutil.Process(pid).memory_info().rss
    print(
        f"\nworker RSS: {rss_loaded / MIB:.0f} MiB with a 256 MiB model, {rss_freed / MIB:.0f} "
        f"MiB {took:.2f}s after a workflow that dropped it from the cache (no call to its env)"
    )
    # ComfyUI's list lets it go too (its entry is cleaned up with the dropped proxy).
    _wait(lambda: not _ours(_probe(server)["entries"], labels), 10.0)

    again = _report(server, prompt)  # the worker lived on; the loader runs again
    assert again["pid"] == pid and again["loads"] == first["loads"] + 1

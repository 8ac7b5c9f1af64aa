"""The example packs on a real ComfyUI server, through its HTTP API and websocket."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any

import numpy as np
import psutil
from conftest import Server

COLOR = 0x336699  # EmptyImage's fill: r=0x33, g=0x66, b=0x99


def _empty_image(width: int = 8, height: int = 6, batch: int = 2, color: int = COLOR) -> dict:
    return {
        "class_type": "EmptyImage",
        "inputs": {"width": width, "height": height, "batch_size": batch, "color": color},
    }


def _expected_image(width: int = 8, height: int = 6, batch: int = 2, color: int = COLOR):
    # As ComfyUI builds it: torch.full(..., c / 0xFF) per channel, float32.
    rgb = [np.float32(((color >> s) & 0xFF) / 0xFF) for s in (16, 8, 0)]
    return np.broadcast_to(np.array(rgb, np.float32), (batch, height, width, 3))


def _digest(history: dict[str, Any], node: str = "99") -> dict[str, Any]:
    assert history["status"]["status_str"] == "success", history["status"]
    return history["outputs"][node]["digest"][0]


def _error(history: dict[str, Any]) -> dict[str, Any]:
    assert history["status"]["status_str"] == "error", history["status"]
    errors = [m[1] for m in history["status"]["messages"] if m[0] == "execution_error"]
    assert errors, history["status"]["messages"]
    return errors[0]


def _values(report: dict[str, Any]) -> np.ndarray:
    assert report["dtype"] == "float32"
    return np.array(report["values"], np.float32).reshape(report["shape"])


def test_isolated_nodes_are_listed_and_a_pack_without_env_fails_loudly(server: Server) -> None:
    info = server.get("/object_info")
    for name in ("CE_InvertImage", "CE_TorchInvert", "CE_ScaleImageV3", "CE_Digest"):
        assert name in info, name
    assert info["CE_InvertImage"]["display_name"] == "Invert image (isolated, numpy)"
    assert info["CE_InvertImage"]["description"] == "1 - image, in the pack's own env"
    assert info["CE_SaveImagePNG"]["output_node"] is True
    assert info["CE_ScaleImageV3"]["display_name"] == "Scale image (isolated, V3)"
    log = server.log_text()
    assert "IMPORT FAILED" in log and "broken_pack" in log
    assert "the env of node pack" in log and "no-such-env" in log
    # the broken pack's node module was never imported into the server
    assert "must never be imported" not in log


def test_image_mask_latent_cross_with_exact_values(server: Server) -> None:
    prompt = {
        "1": _empty_image(),
        "2": {"class_type": "CE_InvertImage", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SolidMask", "inputs": {"value": 0.25, "width": 8, "height": 6}},
        "4": {
            "class_type": "EmptyLatentImage",
            "inputs": {"width": 64, "height": 48, "batch_size": 1},
        },
        "5": {
            "class_type": "CE_MaskAndLatent",
            "inputs": {"mask": ["3", 0], "latent": ["4", 0], "add": 1.5},
        },
        "99": {
            "class_type": "CE_Digest",
            "inputs": {"image": ["2", 0], "mask": ["5", 0], "latent": ["5", 1], "text": ["2", 1]},
        },
    }
    history, _ = server.run(prompt)
    report = _digest(history)
    expected = np.float32(1.0) - _expected_image()
    assert np.array_equal(_values(report["image"]), expected)
    assert report["text"] == "numpy"  # the numpy env got numpy arrays
    assert report["mask"]["shape"] == [1, 6, 8]
    assert np.all(_values(report["mask"]) == np.float32(0.5))
    assert report["latent"]["shape"] == [1, 4, 6, 8]
    assert np.all(_values(report["latent"]) == np.float32(1.5))


def test_a_torch_env_gets_torch_tensors_both_ways(server: Server) -> None:
    prompt = {
        "1": _empty_image(),
        "2": {"class_type": "CE_TorchInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SolidMask", "inputs": {"value": 0.25, "width": 8, "height": 6}},
        "4": {
            "class_type": "EmptyLatentImage",
            "inputs": {"width": 64, "height": 48, "batch_size": 1},
        },
        "5": {"class_type": "CE_TorchLatent", "inputs": {"latent": ["4", 0], "mask": ["3", 0]}},
        "99": {
            "class_type": "CE_Digest",
            "inputs": {"image": ["2", 0], "text": ["2", 1], "mask": ["5", 1], "latent": ["5", 0]},
        },
    }
    history, _ = server.run(prompt)
    report = _digest(history)
    assert np.array_equal(_values(report["image"]), np.float32(1.0) - _expected_image())
    assert report["text"].startswith("torch ")  # a torch tensor arrived in the torch env
    assert np.all(_values(report["mask"]) == np.float32(0.75))
    assert np.all(_values(report["latent"]) == np.float32(0.0))


def test_a_v3_node_runs_isolated(server: Server) -> None:
    prompt = {
        "1": _empty_image(),
        "2": {"class_type": "CE_ScaleImageV3", "inputs": {"image": ["1", 0], "factor": 0.5}},
        "99": {"class_type": "CE_Digest", "inputs": {"image": ["2", 0], "text": ["2", 1]}},
    }
    report = _digest(server.run(prompt)[0])
    assert np.array_equal(_values(report["image"]), _expected_image() * np.float32(0.5))
    assert report["text"] == "numpy node=2"  # cls.hidden.unique_id reached the V3 node


def test_a_segfault_fails_its_prompt_and_the_next_prompt_runs(server: Server) -> None:
    before = _digest(server.run(_kernel_prompt(scale=5.0))[0])["text"]
    history, messages = server.run(
        {
            "1": {"class_type": "CE_Segfault", "inputs": {"value": 3}},
            "99": {"class_type": "CE_Digest", "inputs": {"number": ["1", 0]}},
        }
    )
    error = _error(history)
    assert error["exception_type"] == "comfy_env._errors.WorkerCrashed"
    message = error["exception_message"]
    assert "SIGSEGV" in message and "generation" in message and "pid" in message
    assert "about to touch address 0" in message  # the worker's last output
    assert "Fatal Python error" in message or "Segmentation fault" in message  # faulthandler
    assert any(m["type"] == "execution_error" for m in messages)
    after = _digest(server.run(_kernel_prompt(scale=5.0))[0])["text"]
    assert after.split()[0] != before.split()[0]  # another worker process ran it
    assert server.get("/system_stats")  # and the server is up


def test_a_raising_node_keeps_its_exception_type_and_shows_the_worker_traceback(
    server: Server,
) -> None:
    error = _error(
        server.run(
            {
                "1": {"class_type": "CE_Raise", "inputs": {"value": 0}},
                "99": {"class_type": "CE_Digest", "inputs": {"number": ["1", 0]}},
            }
        )[0]
    )
    assert error["exception_type"] == "ValueError"
    assert "bad value 0" in error["exception_message"]
    assert "worker traceback" in error["exception_message"]
    assert "nodes_impl.py" in error["exception_message"]
    # a class the server cannot import arrives as RemoteError naming it
    error = _error(
        server.run(
            {
                "1": {"class_type": "CE_Raise", "inputs": {"value": 1}},
                "99": {"class_type": "CE_Digest", "inputs": {"number": ["1", 0]}},
            }
        )[0]
    )
    assert "MeshError" in error["exception_message"]
    assert "degenerate mesh" in error["exception_message"]


def _interrupt_when_running(server: Server, node: str, delay: float) -> Any:
    def on_message(message: dict[str, Any]) -> None:
        if message["type"] == "executing" and message["data"].get("node") == node:
            threading.Timer(delay, server.post, ("/interrupt", {})).start()

    return on_message


def test_a_cooperative_interrupt_keeps_the_worker_and_its_loaded_objects(
    server: Server,
) -> None:
    before = _fields(_digest(server.run(_kernel_prompt(scale=9.0))[0])["text"])
    # the same kernel graph (all cached: it stays in ComfyUI's cache) plus a long loop
    prompt = _kernel_prompt(scale=9.0)
    prompt["10"] = {"class_type": "CE_SlowSteps", "inputs": {"steps": 2000, "delay": 0.05}}
    prompt["98"] = {"class_type": "CE_Digest", "inputs": {"number": ["10", 0]}}
    _, messages = server.run(
        prompt, timeout=60, on_message=_interrupt_when_running(server, "10", 0.5)
    )
    assert any(m["type"] == "execution_interrupted" for m in messages), messages
    # the flag was cleared (the next prompt runs), and the node stopped at its own check: the
    # same worker still holds the kernel loaded before (ComfyUI's cache hands it out again)
    after = _fields(_digest(server.run(_kernel_prompt(scale=9.0, color=0x010203))[0])["text"])
    assert after["pid"] == before["pid"] and after["loads"] == before["loads"]
    assert after["uses"] == before["uses"] + 1


def test_an_interrupt_kills_a_node_stuck_in_native_code(server: Server) -> None:
    before = _fields(_digest(server.run(_kernel_prompt(scale=11.0))[0])["text"])
    started = time.monotonic()
    _, messages = server.run(
        {
            "1": {"class_type": "CE_StuckNative", "inputs": {"seconds": 600}},
            "99": {"class_type": "CE_Digest", "inputs": {"number": ["1", 0]}},
        },
        timeout=60,
        on_message=_interrupt_when_running(server, "1", 0.5),
    )
    assert any(m["type"] == "execution_interrupted" for m in messages), messages
    assert time.monotonic() - started < 60
    after = _fields(_digest(server.run(_kernel_prompt(scale=11.0))[0])["text"])
    assert after["pid"] != before["pid"]  # the stuck worker was stopped; the kernel reloaded


def test_progress_bars_and_send_sync_reach_the_websocket(server: Server) -> None:
    tag = time.time_ns() % 1000  # defeats ComfyUI's cache
    history, messages = server.run(
        {
            "1": {"class_type": "CE_SlowSteps", "inputs": {"steps": 4 + tag % 3, "delay": 0.12}},
            "99": {"class_type": "CE_Digest", "inputs": {"number": ["1", 0]}},
        }
    )
    steps = 4 + tag % 3
    progress = [m["data"] for m in messages if m["type"] == "progress"]
    assert progress, [m["type"] for m in messages]
    prompt_id = history["prompt"][1]
    assert all(p["prompt_id"] == prompt_id and p["node"] == "1" for p in progress)
    assert all(p["max"] == steps for p in progress)
    values = [p["value"] for p in progress]
    assert values == sorted(values) and values[-1] == steps  # in order, ending complete
    custom = [m["data"] for m in messages if m["type"] == "comfy_env.example"]
    assert custom and custom[0]["steps"] == steps


def _kernel_prompt(scale: float = 2.0, color: int = COLOR, crash: bool = False) -> dict:
    return {
        "1": {"class_type": "CE_LoadKernel", "inputs": {"scale": scale}},
        "2": _empty_image(color=color),
        "3": {
            "class_type": "CE_UseKernel",
            "inputs": {"kernel": ["1", 0], "image": ["2", 0], "crash": crash},
        },
        "99": {"class_type": "CE_Digest", "inputs": {"image": ["3", 0], "text": ["3", 1]}},
    }


def _fields(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in text.split())}


def test_an_object_stays_in_the_worker_and_a_crash_makes_its_producer_run_again(
    server: Server,
) -> None:
    first = _digest(server.run(_kernel_prompt(scale=3.0))[0])
    assert np.array_equal(_values(first["image"]), _expected_image() * np.float32(3.0))
    second = _digest(server.run(_kernel_prompt(scale=3.0, color=0x102030))[0])
    a, b = _fields(first["text"]), _fields(second["text"])
    # the loader's output was cached by ComfyUI and is the same live object in the same worker
    assert b["pid"] == a["pid"] and b["uses"] == a["uses"] + 1 and b["loads"] == a["loads"]
    error = _error(server.run(_kernel_prompt(scale=3.0, crash=True))[0])
    assert error["exception_type"] == "comfy_env._errors.WorkerCrashed"
    third = _digest(server.run(_kernel_prompt(scale=3.0, color=0x102030))[0])
    c = _fields(third["text"])
    # no StaleGenerationError: the loader ran again in the new worker
    assert c["pid"] != a["pid"] and c["uses"] == 1 and c["loads"] == 1
    assert np.array_equal(
        _values(third["image"]), _expected_image(color=0x102030) * np.float32(3.0)
    )


def test_two_isolated_nodes_of_different_envs_overlap(server: Server) -> None:
    tag = str(time.time())  # defeats ComfyUI's cache
    prompt = {
        "1": {"class_type": "CE_SleepStamp", "inputs": {"seconds": 2.0, "tag": tag}},
        "2": {"class_type": "CE_TorchSleepStamp", "inputs": {"seconds": 2.0, "tag": tag}},
        "99": {"class_type": "CE_Digest", "inputs": {"text": ["1", 0], "text2": ["2", 0]}},
    }
    report = _digest(server.run(prompt)[0])
    s1, e1 = map(float, report["text"].split())
    s2, e2 = map(float, report["text2"].split())
    assert s1 < e2 and s2 < e1, (s1, e1, s2, e2)  # the two sleeps ran at the same time


def test_an_output_node_saves_its_image_where_comfyui_shows_it(server: Server) -> None:
    prompt = {
        "1": _empty_image(width=16, height=8, batch=1),
        "9": {
            "class_type": "CE_SaveImagePNG",
            "inputs": {"images": ["1", 0], "filename_prefix": f"ce/{time.time_ns()}"},
        },
    }
    history, messages = server.run(prompt)
    assert history["status"]["status_str"] == "success"
    ui = history["outputs"]["9"]
    image = ui["images"][0]
    assert image["type"] == "output" and image["subfolder"] == "ce"
    assert ui["node"] == ["9"]  # hidden UNIQUE_ID reached the node
    assert ui["prompt_nodes"] == [2]  # and so did PROMPT
    path = server.output / image["subfolder"] / image["filename"]
    assert path.is_file()
    body = server.get(f"/view?filename={image['filename']}&subfolder=ce&type=output")
    assert body[:8] == b"\x89PNG\r\n\x1a\n" and body == path.read_bytes()
    assert any(m["type"] == "executed" and m["data"]["node"] == "9" for m in messages)


def test_validate_inputs_is_changed_and_lazy_inputs_are_forwarded(server: Server) -> None:
    status, body = server.post(
        "/prompt",
        {
            "prompt": {
                "1": {
                    "class_type": "CE_Lazy",
                    "inputs": {"use_b": False, "a": 1, "b": 2, "limit": 5000},
                },
                "99": {"class_type": "CE_Digest", "inputs": {"number": ["1", 0]}},
            }
        },
    )
    assert status == 400 and "over 1000" in str(body)
    for use_b, expected in ((False, 1), (True, 2)):
        report = _digest(
            server.run(
                {
                    "1": {
                        "class_type": "CE_Lazy",
                        "inputs": {"use_b": use_b, "a": 1, "b": 2, "limit": 10},
                    },
                    "99": {"class_type": "CE_Digest", "inputs": {"number": ["1", 0]}},
                }
            )[0]
        )
        assert report["number"] == expected


def test_a_v3_object_stays_in_the_worker_and_its_producer_reruns_after_a_crash(
    server: Server,
) -> None:
    def prompt(salt: int) -> dict:
        return {
            "1": {"class_type": "CE_MakeThingV3", "inputs": {"start": 10}},
            "2": {"class_type": "CE_BumpThingV3", "inputs": {"thing": ["1", 0], "salt": salt}},
            "99": {"class_type": "CE_Digest", "inputs": {"text": ["2", 0]}},
        }

    a = _fields(_digest(server.run(prompt(1))[0])["text"])
    b = _fields(_digest(server.run(prompt(2))[0])["text"])
    assert b["pid"] == a["pid"] and b["value"] == a["value"] + 1  # the same live object
    _error(
        server.run(
            {
                "1": {"class_type": "CE_Segfault", "inputs": {"value": 5}},
                "99": {"class_type": "CE_Digest", "inputs": {"number": ["1", 0]}},
            }
        )[0]
    )
    c = _fields(_digest(server.run(prompt(3))[0])["text"])
    assert c["pid"] != a["pid"] and c["value"] == 11  # made again in the new worker


def test_a_pack_reading_the_servers_directories_at_import_gets_them_after_a_crash_too(
    server: Server,
) -> None:
    """``INPUT_DIR = folder_paths.get_input_directory()`` at module level (as many packs do)
    names the server's directories, at the scan and in the fresh worker after a crash."""
    prompt = {
        "1": {"class_type": "CE_Directories", "inputs": {}},
        "99": {"class_type": "CE_Digest", "inputs": {"text": ["1", 0], "number": ["1", 1]}},
    }
    first = _digest(server.run(prompt)[0])
    assert first["text"] == f"{server.base / 'input'}|{server.output}"
    history, _ = server.run(
        {
            "1": {"class_type": "CE_Segfault", "inputs": {"value": 4}},
            "99": {"class_type": "CE_Digest", "inputs": {"number": ["1", 0]}},
        }
    )
    assert _error(history)["exception_type"] == "comfy_env._errors.WorkerCrashed"
    again = _digest(server.run(prompt)[0])
    assert again["number"] != first["number"]  # a fresh worker imported the module again
    assert again["text"] == first["text"]


def _torch_workers(server: Server) -> set[int]:
    """The live workers of the torch pack's env (their interpreter is the env's)."""
    env = os.environ["COMFY_ENV_TEST_PACK_ENV_TORCH"]
    found = set()
    for child in psutil.Process(server.process.pid).children(recursive=True):
        try:
            command = child.cmdline()
        except psutil.Error:
            continue
        if command and command[0].startswith(env):
            found.add(child.pid)
    return found


def _has_torch_loaded(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as fh:
            return "libtorch" in fh.read()
    except OSError:
        return False


def test_a_warm_pack_s_worker_is_back_with_its_module_imported_before_the_next_prompt(
    server: Server,
) -> None:
    """The torch pack is isolated with ``warm=True``: when its worker dies, a fresh one starts
    and imports the pack's module (torch) at once, with no prompt asking for it."""
    run = {
        "1": {"class_type": "CE_TorchSleepStamp", "inputs": {"seconds": 0.0, "tag": "w"}},
        "99": {"class_type": "CE_Digest", "inputs": {"text": ["1", 0]}},
    }
    server.run(run)  # the pack's worker is up
    before = _torch_workers(server)
    assert before
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 90
    fresh: set[int] = set()
    while time.monotonic() < deadline:
        fresh = {pid for pid in _torch_workers(server) - before if _has_torch_loaded(pid)}
        if fresh:
            break
        time.sleep(0.1)
    assert fresh, "no warm worker of the torch pack came back with torch imported"
    server.run(run)  # and the next prompt runs on it
    assert _torch_workers(server) - before == fresh


def test_a_list_of_input_files_follows_uploads_in_object_info_and_validation(
    server: Server,
) -> None:
    """An isolated node listing the input directory (as LoadImage does) shows a file written
    after the server started, and a prompt choosing it validates and runs."""
    warm = {
        "1": {"class_type": "CE_Directories", "inputs": {}},
        "99": {"class_type": "CE_Digest", "inputs": {"number": ["1", 1]}},
    }
    server.run(warm)  # the pack's worker is up (a pack without a live worker shows its scan)
    name = f"upload-{uuid.uuid4().hex[:8]}.bin"
    (server.base / "input").mkdir(exist_ok=True)
    (server.base / "input" / name).write_bytes(b"x" * 1234)

    def listed() -> list[str]:
        info = server.get("/object_info/CE_LoadInputFile")
        return list(info["CE_LoadInputFile"]["input"]["required"]["file"][0])

    deadline = time.monotonic() + 10
    while name not in listed() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert name in listed()
    history, _ = server.run(
        {
            "1": {"class_type": "CE_LoadInputFile", "inputs": {"file": name}},
            "99": {"class_type": "CE_Digest", "inputs": {"number": ["1", 0]}},
        }
    )
    assert _digest(history)["number"] == 1234


def test_a_pack_s_routes_are_served_by_the_server_and_answered_in_its_env(
    server: Server,
) -> None:
    """The numpy pack registers GET and POST routes on PromptServer.instance.routes in its env
    (which has no aiohttp: the stand-in); the server serves them, each request answered by
    the pack's handler in its worker."""
    got = server.get("/comfy_env_example/info/box?q=7")
    assert got["name"] == "box" and got["q"] == "7"
    assert got["pid"] != server.process.pid
    assert got["pid"] in {p.pid for p in psutil.Process(server.process.pid).children(True)}
    status, body = server.post("/comfy_env_example/echo", {"a": [1, 2, 3]})
    assert status == 200 and body == {"echo": {"a": [1, 2, 3]}}


def test_a_pack_s_web_directory_is_served_when_its_nodes_are_isolated(server: Server) -> None:
    """WEB_DIRECTORY in the pack's __init__.py (which runs in the server) is served as for any
    pack; the isolated module's own attributes never reach ComfyUI."""
    listed = server.get("/extensions")
    assert any(path.endswith("/example.js") and "numpy_pack" in path for path in listed)
    script = server.get("/extensions/numpy_pack/example.js")
    assert b"comfy-env example pack loaded" in script

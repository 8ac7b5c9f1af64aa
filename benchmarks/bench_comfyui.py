"""The cost of running a ComfyUI node isolated, against the same node in-process.

Run with ``python3 dev.py bench-comfyui`` (it prepares ComfyUI's venv and the example envs, then
runs this script with ComfyUI's interpreter, which has torch). No server is started: the node
proxies are called the way ComfyUI's executor calls them (an ``await`` of the proxy's coroutine
FUNCTION on an event loop), with the 512x512 IMAGE ComfyUI would pass (a torch CPU tensor,
``[1, 512, 512, 3]`` float32, made under ``torch.inference_mode()``).

Measured, in interleaved rounds (so drift of the machine hits all variants alike):

- ``in-process``: the torch pack's passthrough node called directly inside a coroutine;
- ``isolated, torch env``: the same node through ``isolate()`` (torch tensor out of band both
  ways);
- ``isolated, numpy env``: the numpy pack's passthrough node (tensor -> numpy in the env ->
  torch back);
- a reference: the library's own round trip of the same tensor (``Worker.arun`` of an echo),
  which bounds from below what any isolated node can cost;
- crash to next prompt: a node that segfaults, then the next node call on the fresh worker
  (detection, and recovery including the new worker's start and the pack's import);
- warm starts (``isolate(..., warm=True)``) with the torch pack, whose module imports torch:
  the first node call after a server start with a cached scan, cold and warm (the warm-up
  given time to finish, as it has while ComfyUI finishes starting), and the first call after
  its worker was killed, cold and warm, in interleaved rounds.

Writes its section, section 7 of ``benchmarks/RESULTS.md``, between markers into that file
(``--no-write`` to skip): in place of the block already there, else before section 8. The rest
of the file is ``benchmarks/run_all.py``'s, which keeps this block when it rewrites the file
(``section_block``, ``place_section``): the two commands never erase each other's sections.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples" / "comfyui"
BEGIN, END = "<!-- bench_comfyui:begin -->", "<!-- bench_comfyui:end -->"
# A heading that comes after section 7 in the results file: where a missing block goes.
_LATER_HEADING = re.compile(r"## (?:(?:[89]|[1-9][0-9]+)\. |Process hygiene$)")


def section_block(results: str) -> str | None:
    """The section-7 block of a results file's text, markers included; None when it has none
    (or only half of its markers)."""
    if BEGIN not in results:
        return None
    inner, end, _ = results.split(BEGIN, 1)[1].partition(END)
    return BEGIN + inner + END if end else None


def place_section(results: str, block: str) -> str:
    """``results`` with ``block`` (markers included) as its section 7: in place of the block
    already there; else before the first later section (``## 8.`` on, or ``## Process
    hygiene``), where the sections' order puts it; else appended."""
    old = section_block(results)
    if old is not None:
        return results.replace(old, block, 1)
    lines = results.split("\n")
    for i, line in enumerate(lines):
        if _LATER_HEADING.match(line):
            return "\n".join([*lines[:i], block, "", *lines[i:]])
    return results.rstrip("\n") + "\n\n" + block + "\n"


def _load_in_process(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("bench_torch_nodes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _time_calls(fn: Any, image: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        result = await fn(image)
        out.append(time.perf_counter() - t0)
        assert result[0].shape == image.shape
    return out


def _server_folder_paths() -> None:
    """No server runs here: play its ``folder_paths`` (what the proxies send to the env), as
    ComfyUI's own is when it loads a pack; the numpy pack reads the directories at import."""
    import types

    root = tempfile.mkdtemp(prefix="bench-comfyui-dirs-")
    module = types.ModuleType("folder_paths")
    for name in ("input", "output", "temp"):
        path = os.path.join(root, name)
        os.makedirs(path)
        setattr(module, f"get_{name}_directory", lambda path=path: path)
    sys.modules["folder_paths"] = module


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numpy-env", default=os.environ.get("COMFY_ENV_EXAMPLE_NUMPY_ENV"))
    parser.add_argument("--torch-env", default=os.environ.get("COMFY_ENV_EXAMPLE_TORCH_ENV"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--crashes", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if not args.numpy_env or not args.torch_env:
        parser.error("needs --numpy-env and --torch-env (python3 dev.py bench-comfyui sets them)")

    import torch

    import comfy_env
    from comfy_env.comfyui import isolate

    _server_folder_paths()
    cache = tempfile.mkdtemp(prefix="bench-comfyui-scan-")
    pool = comfy_env.Pool(comfy_env.PoolConfig(log_level="WARNING"))
    numpy_nodes, _ = isolate(
        str(EXAMPLES / "numpy_pack"), args.numpy_env, "nodes_impl", pool=pool, cache_dir=cache
    )
    torch_nodes, _ = isolate(
        str(EXAMPLES / "torch_pack"), args.torch_env, "nodes_impl", pool=pool, cache_dir=cache
    )
    local = _load_in_process(EXAMPLES / "torch_pack" / "nodes_impl.py").TorchPassthrough()
    iso_torch = torch_nodes["CE_TorchPassthrough"]()
    iso_numpy = numpy_nodes["CE_Passthrough"]()
    with torch.inference_mode():
        image = torch.rand(1, 512, 512, 3, dtype=torch.float32)

    async def in_process(x: Any) -> Any:
        return local.run(image=x)

    async def torch_env(x: Any) -> Any:
        return await iso_torch.run(image=x)

    async def numpy_env(x: Any) -> Any:
        return await iso_numpy.run(image=x)

    raw = pool.get_worker(args.torch_env)

    async def library_echo(x: Any) -> Any:
        return await raw.arun("comfy_env_worker.tasks:echo", ([x],))

    variants = {
        "in-process": in_process,
        "isolated, torch env": torch_env,
        "isolated, numpy env": numpy_env,
        "reference: Worker.arun echo of the tensor (torch env)": library_echo,
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}

    async def bench() -> None:
        for fn in variants.values():  # warm up: spawn, import, shm blocks
            await _time_calls(fn, image, 10)
        for _ in range(args.rounds):
            for name, fn in variants.items():
                calls = await _time_calls(fn, image, args.calls)
                samples[name].append(statistics.median(calls))

    asyncio.run(bench())
    out = iso_torch.run(image=image)
    assert torch.equal(asyncio.run(out)[0], image)

    crash = numpy_nodes["CE_Segfault"]()
    detect, recover = [], []
    for _ in range(args.crashes):
        t0 = time.perf_counter()
        try:
            asyncio.run(crash.run(value=0))
        except comfy_env.WorkerCrashed:
            pass
        t1 = time.perf_counter()
        asyncio.run(iso_numpy.run(image=image))
        t2 = time.perf_counter()
        detect.append(t1 - t0)
        recover.append(t2 - t1)
    pool.close()
    warm_lines = _bench_warm(args.torch_env, image, args.crashes)

    base = samples["in-process"]
    lines = [
        BEGIN,
        "## 7. ComfyUI: one isolated node on a 512x512 IMAGE",
        "",
        f"`python3 dev.py bench-comfyui`, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, "
        f"torch {torch.__version__}, {args.rounds} interleaved rounds x {args.calls} calls; "
        "each figure is the median per call of a round, shown as the range over rounds "
        "(min / median / max). Load average at the end: "
        + " / ".join(f"{x:.2f}" for x in os.getloadavg())
        + ".",
        "",
        "| variant | per call (min / median / max over rounds) | added over in-process (median) |",
        "|---|---|---|",
    ]
    for name, values in samples.items():
        added = statistics.median(values) - statistics.median(base)
        added_text = "-" if name == "in-process" else f"{added * 1e3:.3f} ms"
        lines.append(
            f"| {name} | {min(values) * 1e3:.3f} / {statistics.median(values) * 1e3:.3f} / "
            f"{max(values) * 1e3:.3f} ms | {added_text} |"
        )
    worst = max(statistics.median(samples[k]) for k in samples if k.startswith("isolated"))
    verdict = "MET" if worst - statistics.median(base) <= 0.002 else "**NOT MET**"
    lines += [
        "",
        f"Target: at most 2 ms added per node call: {verdict} "
        f"(worst variant adds {(worst - statistics.median(base)) * 1e3:.3f} ms).",
        "",
        f"Crash to next prompt ({args.crashes} times, numpy env): the segfaulting node fails "
        f"with `WorkerCrashed` after {statistics.median(detect) * 1e3:.1f} ms "
        f"(min {min(detect) * 1e3:.1f}, max {max(detect) * 1e3:.1f}); the next node call, "
        "which starts generation g+1 and imports the pack again, takes "
        f"{statistics.median(recover) * 1e3:.1f} ms (min {min(recover) * 1e3:.1f}, "
        f"max {max(recover) * 1e3:.1f}).",
        "",
        *warm_lines,
        END,
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        results = HERE / "RESULTS.md"
        current = results.read_text() if results.exists() else ""
        results.write_text(place_section(current, text))
    return 0


def _bench_warm(torch_env: str, image: Any, rounds: int) -> list[str]:
    """First node call after a cached start and after a kill, with and without ``warm``."""
    import signal

    import comfy_env
    from comfy_env.comfyui import isolate

    cache = tempfile.mkdtemp(prefix="bench-comfyui-warm-scan-")
    with comfy_env.Pool(comfy_env.PoolConfig(log_level="WARNING")) as pool:
        isolate(str(EXAMPLES / "torch_pack"), torch_env, "nodes_impl", pool=pool, cache_dir=cache)
    first: dict[bool, list[float]] = {False: [], True: []}
    after_kill: dict[bool, list[float]] = {False: [], True: []}
    warmup: list[float] = []
    for _ in range(rounds):
        for warm in (False, True):
            with comfy_env.Pool(comfy_env.PoolConfig(log_level="WARNING")) as pool:
                t0 = time.perf_counter()
                nodes, _ = isolate(
                    str(EXAMPLES / "torch_pack"),
                    torch_env,
                    "nodes_impl",
                    pool=pool,
                    cache_dir=cache,
                    warm=warm,
                )
                node = nodes["CE_TorchPassthrough"]
                warmer = node._comfy_env_node.pack.warmer
                if warmer is not None:
                    warmer.join(120)
                    warmup.append(time.perf_counter() - t0)
                t1 = time.perf_counter()
                asyncio.run(node().run(image=image))
                first[warm].append(time.perf_counter() - t1)
                # A death while idle (as after a crashed prompt); the next prompt comes once
                # the warm-up (if any) is done.
                key = next(iter(pool.stats()))
                pid = pool.stats()[key].pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while pool.stats()[key].pid == pid and time.monotonic() < deadline:
                    time.sleep(0.01)
                if warmer is not None:
                    deadline = time.monotonic() + 30
                    while warmer.warmups < 2 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    warmer.join(120)
                t2 = time.perf_counter()
                asyncio.run(node().run(image=image))
                after_kill[warm].append(time.perf_counter() - t2)

    def ms(values: list[float]) -> str:
        return (
            f"{statistics.median(values) * 1e3:.1f} ms (min {min(values) * 1e3:.1f}, "
            f"max {max(values) * 1e3:.1f})"
        )

    return [
        f"Warm starts (torch pack, whose module imports torch; {rounds} interleaved rounds, a "
        "fresh pool each): the first node call after a server start with a cached scan takes "
        f"{ms(first[False])} cold and {ms(first[True])} with `isolate(..., warm=True)`, whose "
        f"warm-up ran in the background for {ms(warmup)} from `isolate`'s call. The first call "
        f"after the worker was killed while idle takes {ms(after_kill[False])} cold and "
        f"{ms(after_kill[True])} warm (the next prompt arriving after the re-warm finished).",
    ]


if __name__ == "__main__":
    sys.exit(main())

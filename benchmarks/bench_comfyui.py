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
- a chain of six isolated nodes (``benchmarks/chain_pack``: an IMAGE through a node that loads
  an object kept in the worker, two that use it, three that transform the image), with
  ComfyUI's own model manager imported (``--comfyui-dir``, on the CPU as ``--cpu``) so each kept
  run is registered as in a server, against the same six nodes called in-process; reported as
  added time per node;
- threads: a multi-threaded torch node (``GrowMaskBlur`` on a 1024x1024 MASK) and a node of
  small tensor ops (``Invert`` on the IMAGE), in-process, isolated as workers start by default
  (``OMP_WAIT_POLICY=PASSIVE``) and isolated with OpenMP's spinning default
  (``OMP_WAIT_POLICY=ACTIVE``), in interleaved rounds;
- warm starts (``isolate(..., warm=True)``) with the torch pack, whose module imports torch:
  the first node call after a server start with a cached scan, cold and warm (the warm-up
  given time to finish, as it has while ComfyUI finishes starting), and the first call after
  its worker was killed, cold and warm, in interleaved rounds.

Writes its section, section 7 of ``benchmarks/RESULTS.md``, between markers into that file
(``--no-write`` to skip): in place of the block already there, else before section 8. The rest
of the file is ``benchmarks/run_all.py``'s, which keeps this block when it rewrites the file
(``sections.keep_sections``): the two commands never erase each other's sections.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import sections

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples" / "comfyui"
SECTION = sections.COMFYUI
BEGIN, END = SECTION.begin, SECTION.end


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
    parser.add_argument("--comfyui-dir", help="ComfyUI's source (for its model manager)")
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
    chain_lines = _bench_chain(args.torch_env, args.comfyui_dir, image, args.rounds, args.calls)
    thread_lines = _bench_threads(args.torch_env, image, args.rounds)
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
        *chain_lines,
        "",
        *thread_lines,
        "",
        *warm_lines,
        END,
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        SECTION.write(HERE / "RESULTS.md", text)
    return 0


def _model_manager(comfyui_dir: str | None) -> Any:
    """ComfyUI's ``comfy.model_management`` on the CPU (as a server started with ``--cpu``),
    imported from its source; None without one (kept runs are then not registered)."""
    if not comfyui_dir:
        return None
    sys.path.insert(0, comfyui_dir)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    import comfy.model_management

    return comfy.model_management


def _bench_chain(
    torch_env: str, comfyui_dir: str | None, image: Any, rounds: int, calls: int
) -> list[str]:
    """Six isolated nodes in a row, against the same six in-process: added time per node."""
    import comfy_env
    from comfy_env.comfyui import isolate

    mm = _model_manager(comfyui_dir)
    local = _load_in_process(HERE / "chain_pack" / "nodes_impl.py")
    cache = tempfile.mkdtemp(prefix="bench-comfyui-chain-scan-")
    pool = comfy_env.Pool(comfy_env.PoolConfig(log_level="WARNING"))
    nodes, _ = isolate(
        str(HERE / "chain_pack"), torch_env, "nodes_impl", pool=pool, cache_dir=cache
    )
    load, use, invert = nodes["BenchLoadKernel"], nodes["BenchUseKernel"], nodes["BenchInvert"]
    il, iu1, iu2, ii1, ii2, ii3 = load(), use(), use(), invert(), invert(), invert()
    ll, lu, li = local.LoadKernel(), local.UseKernel(), local.Invert()
    uid = {"comfy_env_unique_id": "1"}

    registrations = [0]

    async def isolated(x: Any) -> Any:
        (kernel,) = await il.run(scale=1.0, **uid)  # a kept output, registered each run
        registrations[0] += kernel.model is not None
        (y,) = await iu1.run(kernel=kernel, image=x)
        (y,) = await ii1.run(image=y)
        (y,) = await iu2.run(kernel=kernel, image=y)
        (y,) = await ii2.run(image=y)
        return await ii3.run(image=y)

    async def in_process(x: Any) -> Any:
        (kernel,) = ll.run(scale=1.0)
        (y,) = lu.run(kernel=kernel, image=x)
        (y,) = li.run(image=y)
        (y,) = lu.run(kernel=kernel, image=y)
        (y,) = li.run(image=y)
        return li.run(image=y)

    per_round: dict[str, list[float]] = {"in-process": [], "isolated": []}

    async def bench() -> None:
        await _time_calls(isolated, image, 10)
        await _time_calls(in_process, image, 10)
        for _ in range(rounds):
            for name, fn in (("in-process", in_process), ("isolated", isolated)):
                per_round[name].append(statistics.median(await _time_calls(fn, image, calls)))

    asyncio.run(bench())
    registered = registrations[0]
    pool.close()
    pairs = zip(per_round["isolated"], per_round["in-process"], strict=True)
    added = [(isolated_s - local_s) / 6 for isolated_s, local_s in pairs]
    verdict = "MET" if statistics.median(added) <= 0.002 else "**NOT MET**"
    manager = (
        f"ComfyUI's model manager imported (`--cpu`): {registered} kept runs registered with it"
        if mm is not None
        else "no ComfyUI model manager (kept runs not registered)"
    )
    return [
        "Chain of six isolated nodes (torch env; load a kept object, use it twice, invert three "
        f"times, on the 512x512 IMAGE; {manager}): a chain run takes "
        f"{statistics.median(per_round['isolated']) * 1e3:.2f} ms isolated against "
        f"{statistics.median(per_round['in-process']) * 1e3:.2f} ms in-process (medians over "
        f"{rounds} rounds of {calls}); added per node {statistics.median(added) * 1e3:.3f} ms "
        f"(rounds: {min(added) * 1e3:.3f} to {max(added) * 1e3:.3f}). Target: at most 2 ms per "
        f"node: {verdict}.",
    ]


def _bench_threads(torch_env: str, image: Any, rounds: int) -> list[str]:
    """Threaded and small-op torch nodes: in-process, isolated (passive OpenMP, the default)
    and isolated with OpenMP spinning (the library's earlier default)."""
    import torch

    import comfy_env
    from comfy_env.comfyui import isolate

    local = _load_in_process(HERE / "chain_pack" / "nodes_impl.py")
    with torch.inference_mode():
        mask = (torch.rand(1, 1024, 1024) > 0.5).float()
    pools, blur, invert = {}, {}, {}
    for name, env_vars in (("passive", {}), ("spinning", {"OMP_WAIT_POLICY": "ACTIVE"})):
        pools[name] = comfy_env.Pool(comfy_env.PoolConfig(log_level="WARNING", env_vars=env_vars))
        nodes, _ = isolate(
            str(HERE / "chain_pack"),
            torch_env,
            "nodes_impl",
            pool=pools[name],
            cache_dir=tempfile.mkdtemp(prefix="bench-comfyui-threads-"),
        )
        blur[name], invert[name] = nodes["BenchGrowMaskBlur"](), nodes["BenchInvert"]()
    lblur, linvert = local.GrowMaskBlur(), local.Invert()

    async def local_blur() -> Any:
        return lblur.run(mask=mask, grow=5, blur=15)

    async def local_invert() -> Any:
        return linvert.run(image=image)

    variants = {
        ("blur", "in-process"): local_blur,
        ("blur", "isolated"): lambda: blur["passive"].run(mask=mask, grow=5, blur=15),
        ("blur", "isolated, OpenMP spinning"): lambda: blur["spinning"].run(
            mask=mask, grow=5, blur=15
        ),
        ("invert", "in-process"): local_invert,
        ("invert", "isolated"): lambda: invert["passive"].run(image=image),
        ("invert", "isolated, OpenMP spinning"): lambda: invert["spinning"].run(image=image),
    }
    samples: dict[tuple[str, str], list[float]] = {k: [] for k in variants}

    async def timed(fn: Any, n: int) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    async def bench() -> None:
        for fn in variants.values():
            await timed(fn, 3)
        for _ in range(rounds):
            for key, fn in variants.items():
                samples[key].append(await timed(fn, 5 if key[0] == "blur" else 30))

    asyncio.run(bench())
    for pool in pools.values():
        pool.close()
    med = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
    ratio = med[("blur", "isolated")] / med[("blur", "in-process")]
    verdict = "MET" if ratio <= 1.2 else "**NOT MET**"
    return [
        f"Threads ({rounds} interleaved rounds; medians, ms; load average "
        + " / ".join(f"{x:.2f}" for x in os.getloadavg())
        + "): a multi-threaded torch node (grow a 1024x1024 MASK, then a separable blur) takes "
        f"{med[('blur', 'in-process')]:.1f} in-process, {med[('blur', 'isolated')]:.1f} "
        f"isolated ({ratio:.2f}x; target at most 1.2x: {verdict}) and "
        f"{med[('blur', 'isolated, OpenMP spinning')]:.1f} isolated with OpenMP spinning; a "
        f"node of small tensor ops (invert the IMAGE) takes {med[('invert', 'in-process')]:.2f} "
        f"in-process, {med[('invert', 'isolated')]:.2f} isolated and "
        f"{med[('invert', 'isolated, OpenMP spinning')]:.2f} isolated with OpenMP spinning "
        "(workers start with `OMP_WAIT_POLICY=PASSIVE` unless told otherwise).",
    ]


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

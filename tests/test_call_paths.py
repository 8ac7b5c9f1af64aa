"""The paths a call and a crash take through the modules, traced on a real worker.

``sys.setprofile`` on the calling thread records every Python call as an edge from the
caller's module to the callee's. The structure tests (``test_structure.py``) hold what may
*import* what; these hold what a call actually *runs*:

* the common call (``Worker.call`` of a target string with scalar arguments, a warm worker)
  goes down the floors and never back up, and never enters the pool: handle -> call object ->
  leasing, codec, status -> gate, channel -> lifecycle table, frames; no call through a
  handle (``call``, ``run``, ``submit``, ``acall``, ``arun``) enters the pool;
* the common call enters few modules again: each of its two descents from the call object
  (the start, then the settle) and its exchange of frames goes down once, so a module is
  entered again only by the next descent (``COMMON_CALL_REENTRIES`` at most);
* a crash, from the reply read's EOF to ``WorkerCrashed``, never calls into the pool, stays on
  seven floors (``CRASH_FLOORS``: the frames, the channel, the call, the generation's exit
  watch, the gate, the spawner's report, the words), and the words of the error
  (``_failures``) call nothing but the exit-status words and the error classes (``_errors``)
  and the lifecycle's names: they read facts, they do not gather them.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest

import comfy_env
from comfy_env import _exchange

pytestmark = [
    pytest.mark.timeout(60),
    # A module compiled by ``dev.py compile`` runs no Python frames: a trace cannot see it.
    pytest.mark.skipif(
        not str(_exchange.__file__).endswith(".py"),
        reason="the per-call modules are compiled (dev.py compile): their calls are not traced",
    ),
]

# The floor of each module the common call may run, from the handle down. A call from one
# module into another must go to a lower floor (a higher number).
COMMON_CALL_FLOORS = {
    "comfy_env._worker": 0,
    "comfy_env._exchange": 1,
    "comfy_env._lease": 2,
    "comfy_env._codec": 2,
    "comfy_env._entry": 3,
    "comfy_env._channel": 3,
    "comfy_env._status": 3,  # the status file throttle, at a call's end
    "comfy_env._lifecycle": 4,
    "comfy_env_worker.protocol": 4,
    "comfy_env_worker.shm": 4,
    "comfy_env._spawner": 4,  # the throttle's first change in a window asks for the timer
    "comfy_env._reactor": 4,  # ... and queues the write on it
}


# The most times the common call enters a module it entered before. Each descent from the call
# object enters its modules once: the start (``_lease`` -> ``_lifecycle``, ``_channel`` ->
# frames, ``_entry`` -> ``_lifecycle``), the exchange of frames (``_channel`` -> frames), the
# decode (``_codec``) and the settle (``_lease`` -> ``_entry`` -> ``_lifecycle``, ``_status``).
# The start asks the table once more (is a ping due?) before the gate applies ``CallStarted``.
COMMON_CALL_REENTRIES = 8

# The floors a crash passes from the reply read's EOF to ``WorkerCrashed``, and the modules of
# each: the frames, the channel (was our request read?), the call's object, the generation's
# exit watch (the facade whose kill is the gate's effect, the exit status, the output and its
# log lines, the memory leaf's verdict: facts about how it ended), the gate, the spawner's
# report of the death (the breaker, ``WorkerRetired``), and the words.
CRASH_FLOORS = {
    "comfy_env_worker.protocol": "frames",
    "comfy_env._channel": "channel",
    "comfy_env._exchange": "call",
    "comfy_env._process": "exit watch",
    "comfy_env._exitwatch": "exit watch",
    "comfy_env._outputpipes": "exit watch",
    "comfy_env._logs": "exit watch",
    "comfy_env._memlimit": "exit watch",
    "comfy_env._entry": "gate",
    "comfy_env._lifecycle": "gate",
    "comfy_env._spawner": "report",
    "comfy_env._policies": "report",
    "comfy_env._events": "report",
    "comfy_env._failures": "words",
    "comfy_env._errors": "words",
    "comfy_env._codec": "words",  # the target's name in the error (``target_label``)
}


def _ours(module: str) -> bool:
    return module.startswith(("comfy_env.", "comfy_env_worker."))


@pytest.fixture
def traced() -> Iterator[Callable[[Callable[[], object]], list[tuple[str, str, str]]]]:
    """Run a function under ``sys.setprofile`` and return its edges between our modules:
    (caller's module, callee's module, callee's function), in order."""

    def run(fn: Callable[[], object]) -> list[tuple[str, str, str]]:
        edges: list[tuple[str, str, str]] = []

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            # Marks for a crash's slice: where the call object hears of the EOF, and the end
            # of its story (calls within one module leave no edge).
            if event == "call" and frame.f_code.co_name == "read_failed":
                edges.append(("", "comfy_env._exchange", "read_failed"))
            if event == "return" and frame.f_code.co_name == "crash_story":
                edges.append(("", "comfy_env._failures", "crash_story returned"))
            if event != "call":
                return
            callee = frame.f_globals.get("__name__", "")
            caller_frame = frame.f_back
            caller = caller_frame.f_globals.get("__name__", "") if caller_frame else ""
            if _ours(callee) and caller != callee:
                edges.append((caller, callee, frame.f_code.co_name))

        sys.setprofile(profile)
        try:
            fn()
        except comfy_env.WorkerCrashed:
            pass
        finally:
            sys.setprofile(None)
        return edges

    yield run
    sys.setprofile(None)


def _check_floors(edges: list[tuple[str, str, str]]) -> set[str]:
    entered = {callee for _, callee, _ in edges}
    assert "comfy_env._pool" not in entered, edges
    assert entered <= set(COMMON_CALL_FLOORS), entered - set(COMMON_CALL_FLOORS)
    # The path is the whole stack: the handle, the call, leasing, the gate, the frames.
    assert {"comfy_env._exchange", "comfy_env._lease", "comfy_env._entry"} <= entered
    assert {"comfy_env._lifecycle", "comfy_env._channel", "comfy_env_worker.protocol"} <= entered
    for caller, callee, function in edges:
        if caller not in COMMON_CALL_FLOORS:
            continue  # the test's own frame calling the handle
        assert COMMON_CALL_FLOORS[caller] < COMMON_CALL_FLOORS[callee], (caller, callee, function)
    entered_before: set[str] = set()
    reentries = []
    for caller, callee, function in edges:
        if caller in COMMON_CALL_FLOORS and callee in entered_before:
            reentries.append((caller, callee, function))
        entered_before.add(callee)
    assert len(reentries) <= COMMON_CALL_REENTRIES, reentries
    return {function for _, _, function in edges}


def test_the_common_call_goes_down_the_floors_and_never_enters_the_pool(
    pool: comfy_env.Pool, traced: Callable[[Callable[[], object]], list[tuple[str, str, str]]]
) -> None:
    worker = pool.get_worker()
    for _ in range(20):  # warm: the handshake, the first call's own path are behind us
        assert worker.call("tasks.remote:add", 1, 2) == 3
    # A call inside the status file's throttle window (its end only marks the change).
    _check_floors(traced(lambda: worker.call("tasks.remote:add", 1, 2)))
    # A call that opens a new window (its end queues the write): once the last one closed.
    for _ in range(20):
        time.sleep(0.6)  # (the window is 0.5 s)
        if "status_timer" in _check_floors(traced(lambda: worker.call("tasks.remote:add", 1, 2))):
            break
    else:
        pytest.fail("no traced call opened a status window")


@pytest.mark.parametrize(
    "how", ["call", "run_with_timeout", "submit", "acall", "arun_with_timeout"]
)
def test_no_call_through_a_handle_enters_the_pool(
    pool: comfy_env.Pool,
    traced: Callable[[Callable[[], object]], list[tuple[str, str, str]]],
    how: str,
) -> None:
    # Each call is its own object, run by the call's module: the pool only wires the parts. (A
    # RemoteRef's calls go through the pool's ``CallSite.call``: ``_refs`` sits below the call's
    # module, which imports it.)
    worker = pool.get_worker()
    calls: dict[str, Callable[[], object]] = {
        "call": lambda: worker.call("tasks.remote:add", 1, 2),
        "run_with_timeout": lambda: worker.run("tasks.remote:add", (1, 2), timeout=30),
        "submit": lambda: worker.submit("tasks.remote:add", (1, 2)).result(),
        "acall": lambda: asyncio.run(worker.acall("tasks.remote:add", 1, 2)),
        "arun_with_timeout": lambda: asyncio.run(
            worker.arun("tasks.remote:add", (1, 2), timeout=30)
        ),
    }
    for _ in range(5):
        calls[how]()  # warm, and the asyncio module loaded
    edges = traced(calls[how])
    assert any(callee == "comfy_env._exchange" for _, callee, _ in edges)
    assert "comfy_env._pool" not in {callee for _, callee, _ in edges}, edges


def test_a_crash_never_calls_into_the_pool_and_its_words_gather_no_facts(
    pool: comfy_env.Pool, traced: Callable[[Callable[[], object]], list[tuple[str, str, str]]]
) -> None:
    worker = pool.get_worker()
    assert worker.call("tasks.remote:add", 1, 2) == 3
    edges = traced(lambda: worker.call("tasks.remote:kill_self", int(signal.SIGKILL)))
    assert edges, "nothing traced"
    assert worker.stats().crashed == 1
    entered = {callee for _, callee, _ in edges}
    assert "comfy_env._pool" not in entered, [e for e in edges if e[1] == "comfy_env._pool"]
    assert "comfy_env._failures" in entered  # the story was told on this thread
    words_call = {callee for caller, callee, _ in edges if caller == "comfy_env._failures"}
    assert words_call <= {"comfy_env._errors", "comfy_env._lifecycle"}, words_call
    # Nothing below the call object calls back up into it (its facts come back as values).
    up = [e for e in edges if e[1] == "comfy_env._exchange" and _ours(e[0])]
    assert all(caller == "comfy_env._worker" for caller, _, _ in up), up
    # From the EOF (the read that raised ``ChannelClosed``: the frames' floor) to the error.
    functions = [function for _, _, function in edges]
    start = functions.index("read_failed")
    end = functions.index("crash_story returned")
    crash = edges[start:end]
    assert all(callee in CRASH_FLOORS for _, callee, _ in crash), [
        e for e in crash if e[1] not in CRASH_FLOORS
    ]
    floors = {CRASH_FLOORS[callee] for _, callee, _ in crash} | {"frames"}
    assert floors == set(CRASH_FLOORS.values()), floors  # all seven: the whole story
    assert len(floors) == 7

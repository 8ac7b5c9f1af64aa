"""The worker's own threads never load a library while the env's code may be loading one.

A native library whose load-time initialiser drops the GIL and takes it again (USD inside
Blender's ``bpy``) runs that initialiser inside ``dlopen``, under the dynamic loader's lock. If
another thread of the worker takes the GIL meanwhile and then calls ``dlopen`` or ``dlsym`` (a
first ``import ctypes``, a ``CDLL``, a symbol lookup), each thread waits for what the other
holds, forever. The watchdog thread did exactly that 0.1 s after the handshake, to arm the
parent-death signal (a first call importing ``bpy`` hung 5 times out of 5), and again when it
interrupted a cancelled call (``PyThreadState_SetAsyncExc`` looked up through ctypes).

These tests build a real extension module whose C constructor does what USD's does: with the
GIL held by the importing thread, it lets go of it, waits (``GIL_PROBE_SLEEP_MS``), and takes
it back. Built with the machine's C compiler against this interpreter's headers, once per test
session; skipped where there is no compiler or no headers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest
from conftest import wait_until

import comfy_env
from comfy_env import CallCancelled

_MODULE = "gil_dropping_init"

_SOURCE = r"""
#include <Python.h>
#include <stdlib.h>
#include <unistd.h>

/* Runs inside dlopen, under the dynamic loader's lock, on the thread importing the module,
   which holds the GIL: drop it, wait, take it back (what USD's registry initialiser does). */
__attribute__((constructor)) static void gil_dropping_constructor(void) {
    const char *ms = getenv("GIL_PROBE_SLEEP_MS");
    if (!Py_IsInitialized() || !PyGILState_Check()) return;
    PyThreadState *state = PyEval_SaveThread();
    usleep((useconds_t)(ms ? atoi(ms) : 1000) * 1000u);
    PyEval_RestoreThread(state);
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gil_dropping_init", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_gil_dropping_init(void) { return PyModule_Create(&module); }
"""

# The call target: imports the module (a first import in a fresh worker, hence a dlopen).
_TASKS = """
import importlib


def load(name):
    importlib.import_module(name)
    return "loaded"
"""


@pytest.fixture(scope="session")
def probe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the built extension module and its call target."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    include = sysconfig.get_paths().get("include")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if not compiler or not include or not suffix or not Path(include, "Python.h").exists():
        pytest.skip("no C compiler or no Python headers to build the test's extension module")
    root = tmp_path_factory.mktemp("loader-lock")
    (root / "probe.c").write_text(_SOURCE)
    (root / "probe_tasks.py").write_text(_TASKS)
    target = str(root / f"{_MODULE}{suffix}")
    built = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", f"-I{include}", str(root / "probe.c"), "-o", target],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if built.returncode != 0:
        pytest.skip(f"the test's extension module did not build: {built.stderr[-2000:]}")
    return root


def _config(probe_dir: Path, sleep_ms: int, **more: object) -> comfy_env.PoolConfig:
    return comfy_env.PoolConfig(
        sys_path=(str(probe_dir),),
        env_vars={"GIL_PROBE_SLEEP_MS": str(sleep_ms)},
        kill_grace=0.5,
        close_timeout=3.0,
        **more,  # type: ignore[arg-type]
    )


@pytest.mark.timeout(60)
def test_a_first_call_loading_a_gil_dropping_library_does_not_deadlock_the_worker(
    probe_dir: Path,
) -> None:
    # The constructor holds the loader's lock for 1.5 s from the first call on, which starts
    # within a few ms of the handshake: the old watchdog's ctypes load at +0.1 s fell inside.
    # The deadline turns the old deadlock into a failure instead of a hang.
    with comfy_env.Pool(_config(probe_dir, 1500, call_timeout=15.0)) as pool:
        w = pool.get_worker()
        assert w.call("probe_tasks:load", _MODULE) == "loaded"
        assert w.generation == 1
        # The worker is sound afterwards and still answers.
        assert w.call("comfy_env_worker.tasks:echo", 7) == 7


@pytest.mark.timeout(60)
def test_a_cancel_during_a_gil_dropping_load_interrupts_the_call_without_deadlock(
    probe_dir: Path,
) -> None:
    # cancel_grace 4 s: the watchdog interrupts the call 2 s after the cancel, while the
    # constructor (3.5 s) still holds the loader's lock. The interrupt's C function was
    # resolved during the handshake: it lands once the import returns, the call ends
    # cancelled and the worker lives on. (The old watchdog looked it up through ctypes right
    # then, a dlsym under the loader's lock: deadlock, and the worker was killed at the grace.)
    with comfy_env.Pool(_config(probe_dir, 3500, cancel_grace=4.0, call_timeout=30.0)) as pool:
        w = pool.get_worker()
        assert w.call("comfy_env_worker.tasks:echo", 1) == 1
        pid = w.pid
        call = w.submit("probe_tasks:load", (_MODULE,))
        assert wait_until(lambda: call.call_id != 0 and w.stats().in_flight == 1)
        time.sleep(0.3)  # the worker reads the CALL and enters the import
        call.cancel()
        with pytest.raises(CallCancelled, match="lives on"):
            call.result(timeout=20)
        assert (w.pid, w.generation) == (pid, 1)
        assert w.call("comfy_env_worker.tasks:echo", 2) == 2

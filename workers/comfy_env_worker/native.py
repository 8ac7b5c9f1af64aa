"""What the worker takes from C, loaded once on the main thread before the first call.

The worker needs two C functions that the standard library does not wrap: ``prctl`` (to arm
``PR_SET_PDEATHSIG``, the second line of defence when the host dies during a long native call)
and ``PyThreadState_SetAsyncExc`` (call control's interrupt of a cancelled call that never
checks). Both come through ``_ctypes``, and loading it is a ``dlopen`` (of ``_ctypes`` and
libffi), as is every first symbol lookup (``dlsym`` takes the dynamic loader's lock too).

**The race this module closes.** A ``dlopen`` runs under the loader's lock with the GIL held
(CPython does not release it there). Some native libraries (USD inside Blender's ``bpy``) have
load-time initialisers (C constructors, run by ``dlopen`` under that lock) that drop the GIL
and take it again. If, while the env's code imports such a library on the main thread, another
thread of the worker takes the GIL and then calls ``dlopen`` (a first ``import ctypes``, a
first ``CDLL`` or symbol lookup), each waits for what the other holds: the worker hangs
forever, a call without a deadline with it. That was the watchdog thread, which loaded ctypes
0.1 s after the handshake to arm the parent-death signal: a first call importing ``bpy`` hung
5 times out of 5. So ``load`` runs on the thread that serves, during the handshake (after
HELLO, before CONFIG is read), before any of the env's code can run; the worker's other threads
then only call what was resolved here, and never load a library.

Why ``_ctypes`` and not ``ctypes``: measured in fresh interpreters, the package with the same
lookups takes 3-4.5 ms (its Python code, ``struct``, ``_endian``, ``pythonapi``), ``load`` about
0.5 ms, which lands on every worker's start (the host's turn after HELLO is shorter than the
worker's own work there, so it hides little); the few C types needed here are three lines.
``shm`` still imports ``ctypes`` when it first maps a block (on the thread that serves, or, for
a spare block, before its helper thread starts: see ``shm.load_native``).

Stdlib only; parses under Python 3.8. Without ``_ctypes`` (a build without it, another
implementation) nothing is armed: the channel watchdog still sees the host go away, and a
cancelled call is only stopped where it checks.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing costs ~3-5 ms at worker start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Optional

PR_SET_PDEATHSIG = 1
SIGKILL = 9  # the same number on every Linux architecture; ``signal`` costs ~1 ms to import

# ``PyThreadState_SetAsyncExc`` and the C types its arguments need, once ``load`` ran (None
# until then, or where ``_ctypes`` is missing).
_set_async_exc: Any = None
_ulong: Any = None
_pyobject: Any = None
loaded = False


def load(arm_parent_death: bool = True) -> None:
    """Load ``_ctypes``, resolve what the worker calls later, and arm ``PR_SET_PDEATHSIG``
    (Linux, where ``arm_parent_death``). Call on the thread that serves, before any of the
    env's code runs; idempotent. Never raises: whatever is missing stays unarmed."""
    global _set_async_exc, _ulong, _pyobject, loaded
    if loaded:
        return
    loaded = True
    try:
        import _ctypes as _loaded
    except ImportError:
        return
    _ctypes: Any = _loaded  # (its stubs know neither dlopen(None) nor these subclasses)
    try:
        simple, function = _ctypes._SimpleCData, _ctypes.CFuncPtr
        c_int = type("c_int", (simple,), {"_type_": "i"})
        c_ulong = type("c_ulong", (simple,), {"_type_": "L"})
        py_object = type("py_object", (simple,), {"_type_": "O"})
        # dlopen(NULL): the program itself and what it loaded (libc, libpython).
        program = _ctypes.dlopen(None, getattr(os, "RTLD_NOW", 2))
        # Called with the GIL held, as ctypes.pythonapi's functions are.
        python_api = type(
            "python_api",
            (function,),
            {
                "_flags_": _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_PYTHONAPI,
                "_restype_": c_int,
            },
        )
        _set_async_exc = python_api(_ctypes.dlsym(program, "PyThreadState_SetAsyncExc"))
        _ulong, _pyobject = c_ulong, py_object
        if arm_parent_death and sys.platform.startswith("linux"):
            prctl_type = type(
                "prctl",
                (function,),
                {
                    "_flags_": _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO,
                    "_restype_": c_int,
                    "_argtypes_": (c_int, c_ulong, c_ulong, c_ulong, c_ulong),
                },
            )
            prctl = prctl_type(_ctypes.dlsym(program, "prctl"))
            # SIGKILL when the thread that spawned us (the host's reactor thread) exits.
            prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - a symbol missing: the channel watchdog covers it
        pass


def set_async_exc(thread_id: int, exc: Optional[type]) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode (None: disarm a pending one).
    A no-op where ``_ctypes`` is missing (cooperative checks only)."""
    if not loaded:
        # Outside a worker's serve loop only (a CallControl in a test): a worker loaded it
        # during the handshake, so its watchdog never gets here.
        load(arm_parent_death=False)
    fn = _set_async_exc
    if fn is None:
        return
    fn(_ulong(thread_id), _pyobject(exc) if exc is not None else None)

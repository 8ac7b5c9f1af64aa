"""Worker-side helpers for tests/test_usercode.py: env code that misbehaves without crashing.

Each function does, inside a worker, what a native library or a node pack sometimes does to
its own process (closes descriptors, forks, installs signal handlers, reconfigures logging,
monkeypatches modules the worker runtime relies on) and then returns normally.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def pid() -> int:
    return os.getpid()


def echo(x: Any) -> Any:
    return x


def say(text: str) -> str:
    print(text)
    return text


def log(text: str, level: int = 20) -> str:
    import logging

    logging.getLogger("usercode").log(level, text)
    return text


# ---- descriptors --------------------------------------------------------------------------


def closerange_all() -> int:
    """A daemon-style library closing every descriptor above stdio."""
    os.closerange(3, 65536)
    return os.getpid()


def close_fd(fd: int) -> int:
    os.close(fd)
    return os.getpid()


def dup2_devnull_over(fds: list[int]) -> int:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        os.dup2(null, fd)
    os.close(null)
    return os.getpid()


def set_std_stream(name: str, value: str) -> int:
    """``sys.stdout``/``sys.stderr`` replaced: ``none``, ``closed``, ``devnull``."""
    if value == "none":
        setattr(sys, name, None)
    elif value == "closed":
        getattr(sys, name).close()
    elif value == "devnull":
        setattr(sys, name, open(os.devnull, "w"))
    return os.getpid()


# ---- processes ----------------------------------------------------------------------------


def fork_child_returns(tag: str) -> str:
    """``os.fork()`` whose child returns normally from the call (it must never answer it)."""
    child = os.fork()
    if child == 0:
        time.sleep(0.05)  # let the parent answer first: the child's answer would come second
        return "child-" + tag
    os.waitpid(child, 0)
    return "parent-" + tag


def fork_child_lingers(seconds: float) -> int:
    """A forked child that lives on after the call, printing and logging now and then."""
    import logging

    child = os.fork()
    if child == 0:
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                print("child still here")
                logging.getLogger("usercode.child").warning("child logging")
                time.sleep(0.02)
        finally:
            os._exit(0)
    return child


def fork_child_prints_in_call() -> str:
    """A forked child printing while the call runs, then exiting before the call returns."""
    child = os.fork()
    if child == 0:
        for i in range(50):
            print(f"child line {i}")
        os._exit(0)
    os.waitpid(child, 0)
    return "ok"


def _square(x: int) -> int:
    print(f"square {x}")
    return x * x


def mp_pool(method: str) -> list[int]:
    import multiprocessing

    ctx = multiprocessing.get_context(method)
    with ctx.Pool(2) as p:
        return p.map(_square, range(4))


def popen_lingers(seconds: float, close_fds: bool) -> int:
    """A child process that inherits what it may and outlives the call (and the worker)."""
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-c", f"import time; time.sleep({seconds!r})"],
        close_fds=close_fds,
    )
    return proc.pid


def popen_lingers_in_session(seconds: float) -> int:
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-c", f"import time; time.sleep({seconds!r})"],
        close_fds=False,
        start_new_session=True,
    )
    return proc.pid


def die() -> None:
    os._exit(3)


# ---- process-wide settings ----------------------------------------------------------------


def set_signal(name: str, action: str) -> int:
    import signal

    sig = getattr(signal, name)
    if action == "ignore":
        signal.signal(sig, signal.SIG_IGN)
    elif action == "default":
        signal.signal(sig, signal.SIG_DFL)
    elif action == "handler":
        signal.signal(sig, lambda *_: None)
    elif action == "raise":

        def raise_it(*_: Any) -> None:
            raise RuntimeError(f"user handler for {name}")

        signal.signal(sig, raise_it)
    return os.getpid()


def setsid() -> str:
    try:
        os.setsid()
    except OSError as exc:
        return f"refused: {exc}"
    return "ok"


def setpgrp() -> str:
    try:
        os.setpgrp()
    except OSError as exc:
        return f"refused: {exc}"
    return "ok"


def set_umask(mask: int) -> int:
    os.umask(mask)
    return os.getpid()


def chdir_deleted() -> int:
    import tempfile

    path = tempfile.mkdtemp()
    os.chdir(path)
    os.rmdir(path)
    return os.getpid()


def limit_files(n: int) -> int:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return os.getpid()


def recursion_limit(n: int) -> int:
    sys.setrecursionlimit(n)
    return os.getpid()


def raise_error() -> None:
    raise ValueError("user error")


def gc_disable() -> int:
    import gc

    gc.disable()
    return os.getpid()


def faulthandler_elsewhere(path: str) -> int:
    import faulthandler

    fh = open(path, "w")
    faulthandler.enable(fh)
    globals()["_FAULT_FILE"] = fh
    return os.getpid()


def threading_excepthook() -> int:
    import threading

    def hook(args: Any) -> None:
        raise RuntimeError("user excepthook")

    threading.excepthook = hook
    return os.getpid()


# ---- logging ------------------------------------------------------------------------------


def logging_reconfigure(how: str) -> int:
    import logging

    if how == "basicconfig":
        logging.basicConfig(force=True, level=logging.DEBUG)
    elif how == "clear":
        logging.getLogger().handlers.clear()
    elif how == "disable":
        logging.disable(logging.CRITICAL)
    elif how == "shutdown":
        logging.shutdown()
    return os.getpid()


def thread_keeps_talking(seconds: float, daemon: bool) -> int:
    import logging
    import threading

    def talk() -> None:
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            print(f"thread line {i}")
            logging.getLogger("usercode.thread").warning("thread record %d", i)
            i += 1
            time.sleep(0.01)

    threading.Thread(target=talk, daemon=daemon).start()
    return os.getpid()


# ---- monkeypatching -----------------------------------------------------------------------


def patch(module: str, attr: str, value: str) -> int:
    """``module.attr = value`` where value is ``none``, ``frozen`` (a constant clock),
    ``raise`` (a callable that raises) or ``delete``."""
    mod = sys.modules.get(module) or __import__(module)
    if value == "none":
        setattr(mod, attr, None)
    elif value == "frozen":
        setattr(mod, attr, lambda: 1.0)
    elif value == "raise":

        def boom(*_: Any, **__: Any) -> Any:
            raise RuntimeError(f"patched {module}.{attr}")

        setattr(mod, attr, boom)
    elif value == "delete":
        delattr(mod, attr)
    return os.getpid()


def progress_and_cancelled() -> bool:
    import comfy_env_worker

    comfy_env_worker.progress(1, 2)
    return comfy_env_worker.cancelled()


def fork_child_returns_first(tag: str) -> str:
    """The child answers at once; the parent answers after the child has gone."""
    child = os.fork()
    if child == 0:
        return f"child-{tag}-{os.getpid()}"
    os.waitpid(child, 0)
    return f"parent-{tag}-{os.getpid()}"


def fork_child_returns_later(tag: str, delay: float) -> str:
    """The parent answers at once; the child answers ``delay`` seconds later."""
    child = os.fork()
    if child == 0:
        time.sleep(delay)
        return f"child-{tag}-{os.getpid()}"
    return f"parent-{tag}-{os.getpid()}"

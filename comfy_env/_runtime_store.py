"""A pool's runtime directory and the runtime store it is linked from.

Data flow: the pool names a ``RuntimeDir`` before its first spawn (a private directory under
the runtime root, see ``_rundir``); the first spawn launches its worker, then calls ``ready``
while the worker's interpreter starts, which links both packages (``comfy_env_worker`` and
cloudpickle) from a runtime store ``<root>/store-<content key>`` into the directory, making
the store first if no host of this user made it yet. The host writes the worker's ``GO`` byte
only after ``ready`` returned (``_handshake``), so no worker imports from a directory half made.

Races it prevents: a store is built under a ``host-<token>-`` name and published whole by a
rename, so a store that exists is complete and two hosts building the same one at once both
end with one; a store pruned by another host while this one links from it falls back to a
copy; a fill interrupted by Ctrl-C leaves the directory marked made (``Deferred``), so the
next start does not fail with EEXIST.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import threading
import time
from typing import Any

import comfy_env_worker

from ._identity import host_id, host_token
from ._interrupts import Deferred
from ._rundir import (
    check_private_dir,
    copy_tree,
    link_tree,
    make_private_dir,
    private_dir_suffix,
    runtime_root,
)


class RuntimeDir:
    """A pool's private runtime directory, holding the worker package and cloudpickle: the
    ONLY path the host adds to a worker's ``sys.path``.

    Named at once (a private directory under the runtime root: the worker's command line
    carries the path), made and filled once by the first caller of ``ready``. The pool names
    it before its first spawn; that spawn launches its worker first and makes and fills the
    directory while the worker's interpreter starts (15-40 ms here, against 1.5-2 ms for the
    links), off the first call's path when the host has a CPU of its own. BOOT reads the
    host's ``GO`` byte before it imports anything from the directory, and the host writes
    ``GO`` only after ``ready`` returned: no worker ever sees it missing or half made. A fill
    that fails leaves it empty, and the next spawn tries again.

    Its files are hard links into a runtime store, ``<runtime root>/store-<content key>``: a
    complete copy of both packages made once (by the first host that needs it) and shared by
    every later host of this user whose packages have the same files (the key hashes every
    file's path, size and modification time, byte code included). A store is published by
    renaming a finished directory, so a store that exists is complete; like everything under
    the root it is ours (checked: owned, not a symlink), and nobody else can create one there.
    A fresh host then pays one ``link`` a file instead of a copy (measured on a busy 2-core
    machine: 1.5-2 ms instead of 5-9.5 ms). Without a store (none could be made, a link
    failed), the packages are copied as before. Stores of other package versions are pruned
    once unused for an hour (``_prune_stores``)."""

    def __init__(self) -> None:
        # Made and filled relative to descriptors of directories checked to be ours (see
        # _rundir): nobody else can put code where the worker imports it from. Only named
        # here: the directory is made by ``ready``, after the worker's launch (0.1-0.3 ms
        # that were on the first call's path).
        self._root = runtime_root()
        self._prefix = f"host-{host_id()}-"
        self._suffix = private_dir_suffix()
        self.path = os.path.join(self._root, self._prefix + self._suffix)
        self._lock = threading.Lock()
        self._made = False
        self._filled = False

    def ready(self) -> str:
        """The path, made and filled (by this call if no earlier one did). Raises ``OSError``
        (or ``ImportError`` without cloudpickle) when it cannot be."""
        # Held against Ctrl-C (it runs inside the first worker's handshake, which a user may
        # interrupt): a directory made but not yet marked made failed every later start of the
        # pool with EEXIST.
        with self._lock, Deferred():
            if not self._filled:
                if not self._made:
                    make_private_dir(self._root, self._prefix, self._suffix)
                    self._made = True
                _fill_runtime_dir(self.path, self._root)
                self._filled = True
        return self.path


def _fill_runtime_dir(path: str, root: str) -> None:
    """Link (or copy) both packages into the empty ``path``, from the store under ``root``."""
    # Found, not imported: importing cloudpickle costs the host 2-4 ms it does not need for
    # calls by reference.
    sources = [("comfy_env_worker", os.path.dirname(comfy_env_worker.__file__ or ""))]
    spec = importlib.util.find_spec("cloudpickle")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("cloudpickle is not installed (a dependency of comfy-env)")
    sources.append(("cloudpickle", next(iter(spec.submodule_search_locations))))
    try:
        store = _runtime_store(root, sources)
        for name, source in sources:
            dest = os.path.join(path, name)
            os.mkdir(dest, 0o700)
            if store is not None:
                try:
                    link_tree(os.path.join(store, name), dest)
                    continue
                except OSError:  # pruned by a host of another version meanwhile: copy
                    shutil.rmtree(dest)
                    os.mkdir(dest, 0o700)
            # Modification times are kept, so the byte code copied along stays valid and a
            # worker of the same Python version does not recompile the runtime at every start.
            copy_tree(source, dest)
    except BaseException:
        for name, _ in sources:  # empty again: the next spawn tries afresh
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
        raise


_STORE_PREFIX = "store-"


def _content_key(sources: list[tuple[str, str]]) -> str:
    """A hash of every file's path, size and modification time under ``sources`` (byte code
    included): equal keys, equal files (a file rewritten in the same nanosecond with the same
    size is not told apart; pip and editors give new times)."""
    digest = _sha256(sys.implementation.cache_tag.encode() if sys.implementation.cache_tag else b"")
    lines: list[str] = []
    for name, source in sources:
        _stat_lines(source, name, lines)
    digest.update("".join(lines).encode())
    key: str = digest.hexdigest()[:32]
    return key


def _stat_lines(directory: str, rel: str, lines: list[str]) -> None:
    """``rel/name size mtime`` of every file under ``directory``, in name order (one
    ``scandir`` a directory and one ``lstat`` a file)."""
    with os.scandir(directory) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            _stat_lines(entry.path, f"{rel}/{entry.name}", lines)
        else:
            st = entry.stat(follow_symlinks=False)
            lines.append(f"{rel}/{entry.name}\0{st.st_size}\0{st.st_mtime_ns}\0")


def _sha256(data: bytes) -> Any:
    """A SHA-256 object from the interpreter's built-in module (as the stdlib's ``random``
    does): ``hashlib`` loads OpenSSL first, about 4 ms of a fresh host's first call. The
    module is named by version: a failed import searches all of ``sys.path`` again."""
    try:
        module = importlib.import_module("_sha2" if sys.version_info >= (3, 12) else "_sha256")
        return module.sha256(data)
    except (ImportError, AttributeError):  # a build without it
        import hashlib

        return hashlib.sha256(data)


def _runtime_store(root: str, sources: list[tuple[str, str]]) -> str | None:
    """The runtime store for ``sources`` under ``root``, made if missing; None if none can be
    used (the caller copies)."""
    try:
        store = os.path.join(root, _STORE_PREFIX + _content_key(sources))
        if check_private_dir(store, create=False) is None:
            return _used(store)
        for _, source in sources:
            _precompile(source)
        store = os.path.join(root, _STORE_PREFIX + _content_key(sources))
        if check_private_dir(store, create=False) is None:
            return _used(store)
        # Built under a host-<token>- name (the sweep removes it if this host dies meanwhile),
        # then published whole by a rename.
        building = make_private_dir(root, f"host-{host_token()}-")
        try:
            for name, source in sources:
                os.mkdir(os.path.join(building, name), 0o700)
                copy_tree(source, os.path.join(building, name))
            try:
                os.rename(building, store)
            except OSError:  # another host published the same store first: use that one
                shutil.rmtree(building, ignore_errors=True)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        if check_private_dir(store, create=False) is not None:
            return None
        _prune_stores(root, os.path.basename(store))
        return store
    except OSError:
        return None


def _used(store: str) -> str:
    """Mark ``store`` used now (its modification time), so no host prunes it for a while."""
    try:
        os.utime(store)
    except OSError:
        pass
    return store


# Stores of other package versions (or another Python: the key includes the byte code) unused
# this long are removed when a new store is made; two versions in use side by side keep both.
_STORE_IDLE_S = 3600.0


def _prune_stores(root: str, keep: str) -> None:
    """Remove the stores of other package versions not used for ``_STORE_IDLE_S`` (best
    effort): a host still linking from one of them copies instead."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    now = time.time()
    for name in names:
        if not name.startswith(_STORE_PREFIX) or name == keep:
            continue
        path = os.path.join(root, name)
        try:
            if now - os.lstat(path).st_mtime < _STORE_IDLE_S:
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def _precompile(source: str) -> None:
    """Byte-compile a package in place for this Python, once (best effort: it may be
    read-only); up-to-date files are only stat-ed."""
    if _byte_code_current(source):
        return  # the usual case (pip compiles on install): no need to import compileall
    import compileall

    try:
        compileall.compile_dir(source, quiet=2, workers=1)
    except OSError:
        pass


def _byte_code_current(source: str) -> bool:
    """Whether every ``.py`` under ``source`` has byte code for this Python that matches it
    (the header's source mtime and size, as the import system checks them): one ``stat`` and
    one 16-byte read a file."""
    from importlib.util import MAGIC_NUMBER

    tag = sys.implementation.cache_tag
    if tag is None:
        return False
    try:
        for directory, subdirs, files in os.walk(source):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            cache = os.path.join(directory, "__pycache__")
            for name in files:
                if not name.endswith(".py"):
                    continue
                st = os.stat(os.path.join(directory, name))
                with open(os.path.join(cache, f"{name[:-3]}.{tag}.pyc"), "rb") as fh:
                    header = fh.read(16)
                expected = (
                    MAGIC_NUMBER
                    + b"\0\0\0\0"  # flags: checked by timestamp
                    + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                    + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
                )
                if header != expected:
                    return False
    except OSError:
        return False
    return True

"""The runtime root: a per-user directory that is ours, or is not used.

Everything comfy-env writes or runs code from lives under one root: each pool's runtime
directory (the worker package the env's interpreter imports), and the status directory. The
root is ``$XDG_RUNTIME_DIR/comfy-env`` when ``XDG_RUNTIME_DIR`` is set and ours, else
``$TMPDIR/comfy-env-<uid>``: a path in a shared, world-writable place that another local user
can create first. Whoever controls the root controls the code our workers import, so it is
trusted only after a check on an opened descriptor (no race between check and use):

- ``O_DIRECTORY | O_NOFOLLOW`` open: a symlink planted at the path is refused, not followed;
- ``fstat``: a directory owned by our uid; group or other write permission is removed when the
  directory is ours (``fchmod``), and a foreign directory is refused whatever its mode;
- ``lstat`` of the path names the same inode (it was not swapped between ``mkdir`` and open).

The same check applies to the status directory inside it, and to the runtime stores
(``store-<content key>``, see ``_process.RuntimeDir``) that per-host runtime directories
are hard-linked from. Below a checked root, nobody else
can create, rename or remove entries, so paths under it are stable; new directories are made
with ``mkdir(dir_fd=...)`` and files with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to the
opened parent.

A root that fails the check is never used: this process takes a private ``mkdtemp`` root
instead (one warning that says what was wrong and how to fix it), removed at interpreter exit,
or by a later sweep if the process was killed: its name carries the host's token
(``comfy-env-<uid>-private-<token>-<random>``).
If even that fails, ``RuntimeRootError`` says why. Never a bare ``PermissionError``.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat

from ._errors import RuntimeRootError
from ._identity import host_id

_log = logging.getLogger("comfy_env")

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)

# (owner pid, path) of this process's private fallback root; a forked child makes its own.
_private: tuple[int, str] | None = None


def check_private_dir(path: str, *, create: bool = True) -> str | None:
    """Make ``path`` (mode 0700) if missing and check it is ours: None if it is, else why not.
    A directory of ours with group or other permissions gets mode 0700."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            return f"cannot create it: {exc.strerror or exc}"
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                return "it is a symbolic link"
        except OSError:
            pass
        return f"cannot open it as a directory: {exc.strerror or exc}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            return "it is not a directory"
        if st.st_uid != os.getuid():
            return f"it belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
        try:
            lst = os.lstat(path)
        except OSError as exc:
            return f"it vanished while being checked: {exc.strerror or exc}"
        if (lst.st_dev, lst.st_ino) != (st.st_dev, st.st_ino):
            return "it was replaced while being checked"
        if st.st_mode & 0o077:
            try:
                os.fchmod(fd, 0o700)
            except OSError as exc:
                return f"its mode {stat.S_IMODE(st.st_mode):o} cannot be made 0700: {exc}"
    finally:
        os.close(fd)
    return None


def _candidate() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isabs(base):
        try:
            st = os.stat(base)
            usable = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
        except OSError:
            usable = False
        if usable and os.access(base, os.W_OK):
            return os.path.join(base, "comfy-env")
    return os.path.join(_temp_dir(), f"comfy-env-{os.getuid()}")


def _temp_dir() -> str:
    """The directory ``tempfile.gettempdir()`` would choose, in the common cases: the first
    of ``$TMPDIR``, ``$TEMP``, ``$TMP``, /tmp, /var/tmp, /usr/tmp that is a directory we may
    write to. Not ``tempfile`` itself: importing it (and ``random``) and its probe file cost
    a fresh host 1.5-5 ms on the first call's path. The root found there is checked as ever
    (``check_private_dir``), and an unusable one still falls back to a private directory."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        value = os.environ.get(name)
        if value and os.path.isdir(value) and os.access(value, os.W_OK | os.X_OK):
            return os.path.abspath(value)
    for path in ("/tmp", "/var/tmp", "/usr/tmp"):
        if os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK):
            return path
    import tempfile  # nothing usable in the usual places: let tempfile search (the cwd too)

    return tempfile.gettempdir()


def runtime_root() -> str:
    """The per-user runtime root (mode 0700, ours), checked on every call; a private fallback
    when the shared one is not ours (see the module docstring)."""
    global _private
    if _private is not None and _private[0] == os.getpid():
        return _private[1]
    path = _candidate()
    why = check_private_dir(path)
    if why is None:
        return path
    try:
        import tempfile

        private = tempfile.mkdtemp(
            prefix=private_root_prefix() + host_id() + "-", dir=private_root_parent()
        )
    except OSError as exc:
        raise RuntimeRootError(
            f"the comfy-env runtime root {path} is unusable ({why}), and no private one could "
            f"be made either ({exc}); remove {path} or set XDG_RUNTIME_DIR to a directory of "
            "yours (mode 0700)",
            path=path,
            reason=why,
        ) from None
    _private = (os.getpid(), private)
    atexit.register(_remove_private, os.getpid(), private)
    _log.warning(
        "comfy-env: the runtime root %s is not safe to use (%s); using a private one, %s, for "
        "this process (comfy-env status and sweep from other processes will not see into it; "
        "a sweep removes it if this process is killed). Fix: "
        "remove %s (if it is not yours, ask its owner or an administrator) or set "
        "XDG_RUNTIME_DIR to a directory of yours with mode 0700",
        path,
        why,
        private,
        path,
    )
    return private


def private_root_prefix() -> str:
    """How the names of private fallback roots start, ``comfy-env-<uid>-private-``; the
    owning host's token follows (``<pid>-t<ticks>-n<namespace>-<random>``), so that a sweep
    can remove the root of a host killed before its ``atexit`` ran (``_sweep``)."""
    return f"comfy-env-{os.getuid()}-private-"


def private_root_parent() -> str:
    """The directory private fallback roots are made in (``tempfile.mkdtemp``'s)."""
    import tempfile

    return tempfile.gettempdir()


def _remove_private(owner: int, path: str) -> None:
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def private_subdir(parent: str, name: str) -> str:
    """``parent/name`` made (mode 0700) and checked like the root; ``RuntimeRootError`` if it
    cannot be made ours."""
    path = os.path.join(parent, name)
    why = check_private_dir(path)
    if why is not None:
        raise RuntimeRootError(
            f"the comfy-env directory {path} is unusable ({why}); remove it",
            path=path,
            reason=why,
        )
    return path


def private_dir_suffix() -> str:
    """The random part of a ``make_private_dir`` name, for a caller that names the directory
    before it makes it."""
    return os.urandom(6).hex()


def make_private_dir(parent: str, prefix: str, suffix: str | None = None) -> str:
    """A new directory ``parent/<prefix><random>`` (mode 0700), made relative to an opened
    descriptor of ``parent``, which is checked again to be ours and closed to others (the
    path may have been swapped since ``runtime_root()`` looked, where the place above it is
    not sticky). With ``suffix`` (from ``private_dir_suffix``) the name is
    ``<prefix><suffix>`` and ``FileExistsError`` is raised if it is taken."""
    fd = os.open(parent, _DIR_FLAGS)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise RuntimeRootError(
                f"the comfy-env directory {parent} changed owner or mode since it was checked",
                path=parent,
                reason="replaced while in use",
            )
        for _ in range(100):
            name = prefix + (private_dir_suffix() if suffix is None else suffix)
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
            except FileExistsError:
                if suffix is not None:
                    raise
                continue
            return os.path.join(parent, name)
    finally:
        os.close(fd)
    raise FileExistsError(f"no free directory name under {parent}")  # pragma: no cover


def copy_tree(source: str, dest: str) -> None:
    """Copy the regular files and directories of ``source`` into the existing directory
    ``dest`` (ours), creating everything relative to opened directory descriptors, files with
    ``O_EXCL | O_NOFOLLOW``. Modification times are kept (byte code stays valid); symlinks and
    special files in ``source`` are skipped."""
    dest_fd = os.open(dest, _DIR_FLAGS)
    try:
        _copy_into(source, dest_fd)
    finally:
        os.close(dest_fd)


def link_tree(source: str, dest: str) -> None:
    """Fill the existing directory ``dest`` (ours) with hard links to the regular files of
    ``source`` (a runtime store of ours: see ``_process.RuntimeDir``), directories made
    anew. Everything is created relative to opened directory descriptors; symlinks and special
    files are skipped; nothing is followed. One ``link`` a file instead of a read and a write:
    the per-host copy costs a fraction of a millisecond. Raises ``OSError`` if any link
    fails (the store was pruned meanwhile, a file system without hard links): the caller
    copies instead."""
    source_fd = os.open(source, _DIR_FLAGS)
    try:
        dest_fd = os.open(dest, _DIR_FLAGS)
        try:
            _link_into(source_fd, dest_fd)
        finally:
            os.close(dest_fd)
    finally:
        os.close(source_fd)


def _link_into(source_fd: int, dest_fd: int) -> None:
    with os.scandir(source_fd) as entries:
        for entry in entries:
            if entry.is_symlink():
                continue
            if entry.is_dir(follow_symlinks=False):
                os.mkdir(entry.name, 0o700, dir_fd=dest_fd)
                sub_source = os.open(entry.name, _DIR_FLAGS, dir_fd=source_fd)
                try:
                    sub_dest = os.open(entry.name, _DIR_FLAGS, dir_fd=dest_fd)
                    try:
                        _link_into(sub_source, sub_dest)
                    finally:
                        os.close(sub_dest)
                finally:
                    os.close(sub_source)
            elif entry.is_file(follow_symlinks=False):
                os.link(
                    entry.name,
                    entry.name,
                    src_dir_fd=source_fd,
                    dst_dir_fd=dest_fd,
                    follow_symlinks=False,
                )


def _copy_into(source: str, dest_fd: int) -> None:
    with os.scandir(source) as entries:
        for entry in entries:
            if entry.is_symlink():
                continue
            if entry.is_dir():
                os.mkdir(entry.name, 0o700, dir_fd=dest_fd)
                sub = os.open(entry.name, _DIR_FLAGS, dir_fd=dest_fd)
                try:
                    _copy_into(entry.path, sub)
                finally:
                    os.close(sub)
            elif entry.is_file():
                st = entry.stat()
                with open(entry.path, "rb") as src:
                    fd = os.open(entry.name, _FILE_FLAGS, 0o600, dir_fd=dest_fd)
                    with os.fdopen(fd, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                        dst.flush()
                        os.utime(dst.fileno(), ns=(st.st_atime_ns, st.st_mtime_ns))

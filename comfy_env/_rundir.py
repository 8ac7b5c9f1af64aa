"""The runtime root: a per-user directory that is ours, or is not used.

Everything comfy-env writes or runs code from lives under one root: each pool's runtime
directory (the worker package the env's interpreter imports), and the status directory. The
root is ``$XDG_RUNTIME_DIR/comfy-env`` when ``XDG_RUNTIME_DIR`` is set, ours and safe (below),
else ``<temp dir>/comfy-env-<uid>``: a path in a shared, world-writable place that another
local user can create first. Whoever controls the root controls the code our workers import,
so it is trusted only after a check on an opened descriptor (no race between check and use):

- ``O_DIRECTORY | O_NOFOLLOW`` open: a symlink planted at the path is refused, not followed;
- ``fstat``: a directory owned by our uid; group or other write permission is removed when the
  directory is ours (``fchmod``), and a foreign directory is refused whatever its mode;
- ``lstat`` of the path names the same inode (it was not swapped between ``mkdir`` and open).

A checked root is not enough: the host names the root by its path at every later spawn (the
worker's ``sys.path[0]``, ``RuntimeDir.path``), and whoever may write to a directory above the
root without the sticky bit can rename the root away and put a directory of their own, with
their own ``comfy_env_worker``, at the same path. So the root's parent must be safe too
(``unsafe_path``, the classic secure-path rule, as OpenSSH's ``safe_path``): every directory
from ``/`` down to it, along the path as written and along every symbolic link it goes through
(so its ``realpath`` too), is owned by root or by us and is not group- or other-writable unless
it has the sticky bit (``/tmp``: mode 1777), and every symbolic link on the way is owned by
root or by us. An ``XDG_RUNTIME_DIR`` that fails this is not used (one warning naming the
directory and why); a temp dir candidate (``$TMPDIR``, ``$TEMP``, ``$TMP``, /tmp, ...) that
fails it is skipped for the next (one warning), so a hostile ``TMPDIR`` falls through to /tmp.
A few ``lstat`` calls, on every ``runtime_root()``.

The same check applies to the status directory inside the root, and to the runtime stores
(``store-<content key>``, see ``_runtime_store.RuntimeDir``) that per-host runtime directories
are hard-linked from. Below a checked root with a safe parent, nobody else can create, rename
or remove entries, so paths under it are stable; new directories are made with
``mkdir(dir_fd=...)`` and files with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to the opened
parent.

A root that fails the check is never used: this process takes a private ``mkdtemp`` root
instead, made in a safe temp dir and named
``comfy-env-<uid>-private-<host token>-<random>`` (one warning that says what was wrong and
how to fix it). It is removed at interpreter exit, after every pool has closed
(``install_exit_hook``: the pools' close still writes the status file under it). If the
process is killed, its pools' host watcher removes it at once, or a later sweep does (its name
carries the host's token; see ``_leftovers``). If no safe place is left for it,
``RuntimeRootError`` says why. Never a bare ``PermissionError``.
"""

from __future__ import annotations

import errno
import os
import stat

from ._errors import RuntimeRootError
from ._identity import host_id
from ._leftovers import private_root_prefix as private_root_prefix  # (public here too)
from ._say import package_logger

# shutil and atexit are imported where they are used, logging through ``package_logger``:
# ``comfy-env status`` finds the runtime root through this module and needs none of them
# (logging alone is about a sixth of its start-up).


_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)

# (owner pid, path) of this process's private fallback root; a forked child makes its own.
_private: tuple[int, str] | None = None


# The host's own shortages, never a property of the path being checked.
_HOST_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def check_private_dir(path: str, *, create: bool = True) -> str | None:
    """Make ``path`` (mode 0700) if missing and check it is ours: None if it is, else why not.
    A directory of ours with group or other permissions gets mode 0700.

    Raises ``OSError`` when this process is out of descriptors or memory (EMFILE, ENFILE,
    ENOMEM): that says nothing about the directory, and a reason returned for it would make the
    caller give the directory up (``runtime_root`` would move this process to a private root
    for good, or refuse with a ``RuntimeRootError``) over a shortage that passes."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno in _HOST_OUT_OF_RESOURCES:
                raise
            return f"cannot create it: {exc.strerror or exc}"
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in _HOST_OUT_OF_RESOURCES:
            raise
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


# Symbolic links followed at most while checking a path (the kernel's own limit is 40).
_MAX_LINKS = 40


def unsafe_path(path: str) -> str | None:
    """Why another user could swap what lives at the absolute ``path`` (a directory), or None
    if nobody but root and us can: the secure-path rule of the module docstring.

    The path is resolved here component by component, as the kernel does: every directory on
    the way (from ``/``, through the targets of symbolic links, down to ``path`` itself) must be
    owned by root or by our uid and not be group- or other-writable unless it has the sticky
    bit; every symbolic link on the way must be owned by root or by us (its directory was
    checked first, so nobody else can replace it). ``..`` goes back to a directory already
    checked. One ``lstat`` a component, one ``readlink`` a link."""
    uid = os.getuid()
    pending = [part for part in reversed(path.split("/")) if part]
    current = "/"
    try:
        why = _dir_problem(current, os.lstat(current), uid)
    except OSError as exc:
        return f"{current} cannot be examined: {exc.strerror or exc}"
    if why is not None:
        return why
    links = 0
    while pending:
        name = pending.pop()
        if name == ".":
            continue
        if name == "..":
            # ``current`` was reached from / through checked directories only, so its parent
            # is one of them: nothing new to check.
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, name)
        try:
            st = os.lstat(candidate)
        except OSError as exc:
            return f"{candidate} cannot be examined: {exc.strerror or exc}"
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, uid):
                return (
                    f"the symbolic link {candidate} belongs to uid {st.st_uid}, neither root nor "
                    f"this user (uid {uid})"
                )
            links += 1
            if links > _MAX_LINKS:
                return f"too many symbolic links resolving {path}"
            try:
                target = os.readlink(candidate)
            except OSError as exc:
                return f"the symbolic link {candidate} cannot be read: {exc.strerror or exc}"
            if target.startswith("/"):
                current = "/"
            pending.extend(part for part in reversed(target.split("/")) if part)
            continue
        if not stat.S_ISDIR(st.st_mode):
            return f"{candidate} is not a directory"
        why = _dir_problem(candidate, st, uid)
        if why is not None:
            return why
        current = candidate
    return None


def _dir_problem(path: str, st: os.stat_result, uid: int) -> str | None:
    """Why the directory ``path`` (its ``lstat``) is not safe to be above the root, or None."""
    if st.st_uid not in (0, uid):
        return (
            f"the directory {path} belongs to uid {st.st_uid}, neither root nor this user "
            f"(uid {uid})"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        who = "others" if st.st_mode & 0o002 else "its group"
        return (
            f"the directory {path} is writable by {who} without the sticky bit (mode "
            f"{stat.S_IMODE(st.st_mode):o}): another user can rename what comfy-env makes there "
            "and put their own in its place"
        )
    return None


# Directories already warned about (once a process each: runtime_root() runs at every spawn).
_warned: set[str] = set()


def _warn_unsafe(path: str, source: str, why: str, instead: str) -> None:
    if path in _warned:
        return
    _warned.add(path)
    package_logger().warning(
        "comfy-env: not using %s (%s) for the runtime root: %s; using %s instead. Fix: point %s "
        "at a directory of yours (mode 0700) whose every parent is writable only by root or "
        "you (or sticky, like /tmp)",
        path,
        source,
        why,
        instead,
        "XDG_RUNTIME_DIR" if source == "$XDG_RUNTIME_DIR" else "TMPDIR",
    )


def _candidate() -> str:
    """The shared runtime root's path: under ``XDG_RUNTIME_DIR`` if it is ours and safe, else
    in the first safe temp dir; ``RuntimeRootError`` if there is no safe place at all."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isabs(base):
        try:
            st = os.stat(base)
            usable = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
        except OSError:
            usable = False
        if usable and os.access(base, os.W_OK):
            why = unsafe_path(base)
            if why is None:
                return os.path.join(base, "comfy-env")
            root = os.path.join(_safe_temp_dir(), f"comfy-env-{os.getuid()}")
            _warn_unsafe(base, "$XDG_RUNTIME_DIR", why, root)
            return root
    return os.path.join(_safe_temp_dir(), f"comfy-env-{os.getuid()}")


def _temp_dirs() -> list[tuple[str, str]]:
    """The directories ``tempfile.gettempdir()`` would choose from, in its order, as (path,
    where it came from): ``$TMPDIR``, ``$TEMP``, ``$TMP``, /tmp, /var/tmp, /usr/tmp, each only
    if it is a directory we may write to. Not ``tempfile`` itself: importing it (and
    ``random``) and its probe file cost a fresh host 1.5-5 ms on the first call's path."""
    found = []
    for name in ("TMPDIR", "TEMP", "TMP"):
        value = os.environ.get(name)
        if value and os.path.isdir(value) and os.access(value, os.W_OK | os.X_OK):
            found.append((os.path.abspath(value), f"${name}"))
    for path in ("/tmp", "/var/tmp", "/usr/tmp"):
        if os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK):
            found.append((path, "a standard temp dir"))
    return found


def _safe_temp_dir() -> str:
    """The first of ``_temp_dirs()`` that is safe (``unsafe_path``); each unsafe one skipped
    is warned about once. Without any, ``tempfile.gettempdir()`` (which also tries the working
    directory), if safe; else ``RuntimeRootError`` naming every directory refused and why."""
    refused: list[tuple[str, str, str]] = []
    chosen = None
    for path, source in _temp_dirs():
        why = unsafe_path(path)
        if why is None:
            chosen = path
            break
        refused.append((path, source, why))
    if chosen is None:
        import tempfile  # nothing usable in the usual places: let tempfile search (the cwd too)

        path = tempfile.gettempdir()
        why = unsafe_path(path)
        if why is None:
            chosen = path
        elif all(path != seen for seen, _, _ in refused):  # (usually /tmp, named already)
            refused.append((path, "tempfile.gettempdir()", why))
    if chosen is None:
        said = "; ".join(f"{path} ({source}): {why}" for path, source, why in refused)
        first = refused[0][0] if refused else "/tmp"
        raise RuntimeRootError(
            f"no safe directory for the comfy-env runtime root: {said}. Set XDG_RUNTIME_DIR "
            "to a directory of yours (mode 0700) whose every parent is writable only by root "
            "or you",
            path=first,
            reason=said,
        )
    for path, source, why in refused:
        _warn_unsafe(path, source, why, chosen)
    return chosen


def runtime_root() -> str:
    """The per-user runtime root (mode 0700, ours, below safe directories only), checked on
    every call; a private fallback when the shared one is not ours (see the module
    docstring)."""
    global _private
    if _private is not None and _private[0] == os.getpid():
        return _private[1]
    path = _candidate()
    why = check_private_dir(path)
    if why is None:
        return path
    try:
        import tempfile

        # In a safe temp dir (not merely $TMPDIR): the private root's path is used at every
        # spawn too, so it must not be renamed away under us either. Its name carries our
        # token, so a sweep can remove it if this process is killed.
        private = tempfile.mkdtemp(
            prefix=private_root_prefix() + host_id() + "-", dir=private_root_parent()
        )
    except (OSError, RuntimeRootError) as exc:
        raise RuntimeRootError(
            f"the comfy-env runtime root {path} is unusable ({why}), and no private one could "
            f"be made either ({exc}); remove {path} or set XDG_RUNTIME_DIR to a directory of "
            "yours (mode 0700)",
            path=path,
            reason=why,
        ) from None
    _private = (os.getpid(), private)
    install_exit_hook()
    package_logger().warning(
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


_exit_hook_installed = False


def install_exit_hook() -> None:
    """Once a process: remove this process's private root (if it made one) at interpreter
    exit. ``_shutdown`` calls this before it registers its own exit hook, which closes every
    pool, and ``atexit`` runs hooks last-registered first: the pools close (and write their
    status files under the root) before the root is removed, whichever was set up first."""
    global _exit_hook_installed
    if not _exit_hook_installed:
        _exit_hook_installed = True
        import atexit

        atexit.register(remove_private_root)


def remove_private_root() -> None:
    """Remove this process's private root, if it made one (a forked child: only its own).
    At interpreter exit (``install_exit_hook``), after every pool has closed."""
    private = _private
    if private is not None and private[0] == os.getpid():
        import shutil

        shutil.rmtree(private[1], ignore_errors=True)


def private_root_parent() -> str:
    """The directory private fallback roots are made in: the first safe temp dir
    (``_safe_temp_dir``; ``RuntimeRootError`` if there is none)."""
    return _safe_temp_dir()


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
    ``source`` (a runtime store of ours: see ``_runtime_store.RuntimeDir``), directories made
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
    import shutil

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

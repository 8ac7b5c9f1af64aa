"""A dead host's leftovers: how each is named, and the one test for removing it.

Two removers share this module, so they can never disagree about what is a dead host's::

    sweep() (_sweep; any process, any time)          host watcher (_descendants.watch_host)
      every host of this user: host=None               one host, the moment it died:
      shm dir, runtime root, status dir,                host=<its token>, its own root
      private roots in the temp dir                     (and the root itself, if private)
                        \\                                 /
                         remove_blocks / remove_runtime_dirs / remove_status_files /
                         private_root_removable
                           name -> owner (``_identity.owner_of``, one parse for all)
                           -> restricted to ``host``, if given
                           -> owner proven dead (``_identity.owner_dead``)
                           -> ``ours_to_remove`` (lstat: a regular file, or a real directory,
                              owned by our uid) -> unlink / rmtree

What a host leaves behind, all named after its ``host_token()`` (``<pid>-t<ticks>-n<ns>``):

- shared-memory blocks ``/dev/shm/ce-<token>-h...`` (the host's) and ``ce-<token>-w<pid>-...``
  (its workers');
- runtime directories ``<runtime root>/host-<token>-...``;
- its status file ``<runtime root>/status/<token>.json`` (and ``.<token>.json.tmp``);
- where the shared root was not safe: its private root ``<temp dir>/comfy-env-<uid>-private-
  <token>-<random>``, with all of the above inside.

Races it prevents. A name is no proof of ownership in ``/dev/shm`` or ``/tmp``, where anyone
can create any name: only what ``lstat`` shows to be a plain file (a real directory) of our uid
is removed, so root never deletes another user's look-alike and a symlink is never followed.
A host's death is proven, never assumed from a closed pipe: the watcher's end of file also
comes from a host that ``exec``'d (its close-on-exec write end closes, the process lives on),
and a pid that names another process, a host in another pid namespace, or a name in an older
format never count as dead (``owner_dead``). Whatever disappears between the listing and the
removal (a dying worker unlinks its own blocks; two pools' watchers, or a watcher and a sweep,
remove the same host's things) is skipped quietly.

Imports only ``_identity`` and the standard library: the watcher imports this module after its
host died, so nothing here may need the host's third-party packages (it runs ``python -I -S``).
"""

from __future__ import annotations

import os
import re
import stat
import time

from ._identity import owner_dead, owner_of

TYPE_CHECKING = False  # (``comfy-env status`` imports this module: no typing at run time)
if TYPE_CHECKING:
    from collections.abc import Iterator

Owner = tuple[int, int, int]  # (pid, start ticks, pid namespace), as ``owner_of`` parses names

STATUS_DIR_NAME = "status"  # under runtime_root(); must not start with "host-" (sweep's names)
# ``<pid>-t<ticks>-n<ns>.json`` and a write in progress, ``.<pid>-t<ticks>-n<ns>.json.tmp``.
STATUS_FILE = re.compile(r"^\.?(\d+)-t(\d+)-n(\d+)\.json(?:\.tmp)?$")
RUNTIME_DIR_PREFIX = "host-"

# How long a watcher waits, after its host's pipe closed, for the death to be provable (a
# zombie, or gone). The kernel closes the pipe while the process exits, and it becomes a
# zombie a moment later; a host that closes its descriptors slowly (a GPU driver's teardown)
# takes longer. A host that exec'd never dies here: after this wait nothing is removed.
DEATH_PROOF_WAIT = 10.0


def host_owner(token: str) -> Owner | None:
    """(pid, ticks, namespace) of a host token ``<pid>-t<ticks>-n<ns>``, parsed as the names
    made with it are; None if it is not one."""
    return owner_of(f"{RUNTIME_DIR_PREFIX}{token}-")


def private_root_prefix() -> str:
    """How the names of private fallback roots start, ``comfy-env-<uid>-private-``; the
    owning host's token follows (``<pid>-t<ticks>-n<namespace>-<random>``), so that a sweep
    or the host's watcher can remove the root of a host killed before its ``atexit`` ran."""
    return f"comfy-env-{os.getuid()}-private-"


def ours_to_remove(path: str, *, directory: bool) -> bool:
    """Is ``path`` ours to remove? Checked with ``lstat`` (a symlink is never followed): a
    regular file (``directory``: a real directory) owned by our uid. A name proves only who
    made a thing if nobody else can make one by that name; in ``/dev/shm`` anybody can, so a
    block of another user named like a dead host's is not ours, even to root. The dry run and
    the real sweep both decide by this one test, so ``--dry-run`` lists exactly what a sweep
    removes. (In a sticky directory such as ``/dev/shm`` nobody else can rename or remove an
    entry of ours between this check and the unlink.)"""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    kind = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    return kind and st.st_uid == os.getuid()


def _of_dead_host(owner: Owner | None, host: Owner | None) -> bool:
    """Does a name's ``owner`` belong to a host proven dead (to ``host`` itself, if given)?"""
    if owner is None or (host is not None and owner != host):
        return False
    return owner_dead(*owner)


def _listdir(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def _unlink(path: str, dry_run: bool) -> bool:
    """Unlink ``path`` (``dry_run``: nothing). False if it went first (a dying worker unlinks
    its own blocks, another remover was quicker) or cannot be removed."""
    if dry_run:
        return True
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def _left_by_dead_hosts(
    directory: str, prefix: str, host: Owner | None, *, directories: bool
) -> Iterator[tuple[str, str]]:
    """(name, path) of each entry of ``directory`` named ``<prefix><token>-...`` whose host
    is proven dead (``host``: that host only) and that is ours to remove (``directories``:
    real directories, else regular files), in name order. Each is checked as it is reached,
    so the caller removes one before the next is looked at."""
    for name in _listdir(directory):
        if not name.startswith(prefix):
            continue
        path = os.path.join(directory, name)
        if _of_dead_host(owner_of(name), host) and ours_to_remove(path, directory=directories):
            yield name, path


def remove_blocks(
    shm_dir: str, name_prefix: str, *, host: Owner | None = None, dry_run: bool = False
) -> list[str]:
    """Unlink the shared-memory blocks in ``shm_dir`` (named ``<name_prefix><token>-...``) of
    dead hosts (``host``: of that host only); returns their names (``dry_run``: what would be
    removed; nothing is)."""
    blocks = _left_by_dead_hosts(shm_dir, name_prefix, host, directories=False)
    return [name for name, path in blocks if _unlink(path, dry_run)]


def remove_runtime_dirs(
    root: str, *, host: Owner | None = None, dry_run: bool = False
) -> list[str]:
    """Remove the runtime directories (``host-<token>-...``) under ``root`` of dead hosts
    (``host``: of that host only); returns their names."""
    removed = []
    for name, path in _left_by_dead_hosts(root, RUNTIME_DIR_PREFIX, host, directories=True):
        if not dry_run:
            import shutil  # (here: ``comfy-env status`` imports this module)

            shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


def remove_status_files(
    directory: str, *, host: Owner | None = None, dry_run: bool = False
) -> list[str]:
    """Remove the status files (and temporary files) in ``directory`` of dead hosts
    (``host``: of that host only); returns their names. ``OSError`` if ``directory`` cannot
    be listed."""
    removed = []
    for name in sorted(os.listdir(directory)):
        match = STATUS_FILE.match(name)
        if match is None:
            continue
        owner = (int(match.group(1)), int(match.group(2)), int(match.group(3)))
        path = os.path.join(directory, name)
        if _of_dead_host(owner, host) and ours_to_remove(path, directory=False):
            if _unlink(path, dry_run):
                removed.append(name)
    return removed


def private_root_removable(path: str, *, host: Owner | None = None) -> bool:
    """Is ``path`` the private fallback root (``<temp dir>/comfy-env-<uid>-private-<token>-
    <random>``) of a dead host (``host``: of that host)? Checked like a root itself: a real
    directory (never a symlink) of our uid, closed to group and other writes; the temp dir is
    shared, so a look-alike of anyone else's is never removed."""
    name = os.path.basename(path)
    prefix = private_root_prefix()
    if not name.startswith(prefix):
        return False
    owner = owner_of(RUNTIME_DIR_PREFIX + name[len(prefix) :])  # the token, as in a runtime dir
    if not _of_dead_host(owner, host) or not ours_to_remove(path, directory=True):
        return False
    try:
        return not os.lstat(path).st_mode & 0o022
    except OSError:
        return False


def remove_dead_host(
    token: str, *, root: str, shm_dir: str, block_prefix: str, wait: float = DEATH_PROOF_WAIT
) -> list[str]:
    """The host watcher's clean-up: everything the host ``token`` left behind, once its
    death is proven (waiting up to ``wait`` seconds for the proof; nothing is removed without
    it). ``root``: the host's runtime root ("" if it had none); ``shm_dir`` and
    ``block_prefix``: where and under which prefix its blocks are named. Returns what was
    removed, as paths."""
    host = host_owner(token)
    if host is None:
        return []
    deadline = time.monotonic() + wait
    while not owner_dead(*host):
        if time.monotonic() >= deadline:
            return []  # alive (it exec'd), or its death cannot be proven from here
        time.sleep(0.01)
    removed = [
        os.path.join(shm_dir, name) for name in remove_blocks(shm_dir, block_prefix, host=host)
    ]
    if not root:
        return removed
    if private_root_removable(root, host=host):
        # The root is the host's own (a private fallback): everything of it is inside.
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        return [*removed, root]
    removed += [os.path.join(root, n) for n in remove_runtime_dirs(root, host=host)]
    status = os.path.join(root, STATUS_DIR_NAME)
    if ours_to_remove(status, directory=True):  # never through a symlink planted there
        try:
            removed += [os.path.join(status, n) for n in remove_status_files(status, host=host)]
        except OSError:
            pass  # gone, or not listable: the next sweep tries again
    return removed

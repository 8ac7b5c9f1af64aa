"""Objects kept resident in the worker for ``Worker.call_ref``, and the worker's release hooks.

A kept object is named by an id that is unique within this worker process; the host's
``RemoteRef`` carries that id *and* the generation of this worker. ``resolve`` checks both, so
a reference that outlived its worker can never silently resolve to some other object in a
replacement (which could reuse the id): it raises instead. The host checks the generation before
sending, too; this is the second line.

Release hooks (``on_release``) let an env's code drop caches cleanly before the pool reaps an
idle worker (they run when the worker is asked to shut down). Stdlib only.
"""

from __future__ import annotations

import itertools
import sys

TYPE_CHECKING = False  # typing costs ~3-5 ms at worker start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Sequence, Tuple

_OBJECTS: Dict[int, Any] = {}
_IDS = itertools.count(1)
GENERATION = 0  # set from the host's CONFIG at start-up
_RELEASE_HOOKS: List[Callable[[], Any]] = []


class StaleRefError(LookupError):
    """A reference from another worker generation, or to an object already released."""


def keep(value: Any) -> int:
    ref_id = next(_IDS)
    _OBJECTS[ref_id] = value
    return ref_id


def call_and_keep(target: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> int:
    """Run ``target`` and keep its result here; return the id the host wraps in a RemoteRef."""
    if isinstance(target, str):
        from .main import resolve_target

        target = resolve_target(target)
    return keep(target(*args, **kwargs))


def resolve(ref_id: int, generation: int) -> Any:
    """The live object behind a RemoteRef (runs while unpickling the call's arguments)."""
    if generation != GENERATION:
        raise StaleRefError(
            "RemoteRef %d belongs to worker generation %d, this is generation %d"
            % (ref_id, generation, GENERATION)
        )
    try:
        return _OBJECTS[ref_id]
    except KeyError:
        raise StaleRefError("RemoteRef %d was released" % ref_id) from None


def call_method(obj: Any, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return getattr(obj, name)(*args, **kwargs)


def release(ref_ids: Sequence[int]) -> int:
    """Drop kept objects; returns how many were still held."""
    return sum(1 for i in ref_ids if _OBJECTS.pop(i, None) is not None)


def count() -> int:
    return len(_OBJECTS)


def on_release(hook: Callable[[], Any]) -> Callable[[], Any]:
    """Register ``hook`` to run before this worker is retired for being idle (or the pool
    closes). Use it to drop caches and models cleanly. Usable as a decorator."""
    _RELEASE_HOOKS.append(hook)
    return hook


def run_release_hooks() -> None:
    for hook in list(_RELEASE_HOOKS):
        try:
            hook()
        except Exception:  # noqa: BLE001 - one hook's failure must not skip the others
            sys.stderr.write("comfy-env worker: release hook %r failed:\n" % (hook,))
            import traceback  # only when a hook failed: slow to import at start-up

            traceback.print_exc()
    _OBJECTS.clear()

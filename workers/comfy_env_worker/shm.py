"""Out-of-band buffers: large buffers travel beside the pickle, in shared memory or inline.

Both sides use this module (stdlib only, Python 3.8+).

**Encoding.** ``encode`` pickles with protocol 5 and a buffer callback: every buffer of at least
``threshold`` bytes (numpy arrays at any depth; bytes, bytearray, memoryview and torch CPU
tensors that are an argument or the result, or directly inside a tuple, list or dict that is)
is taken out of band. Those bytes-like objects are swapped for stand-ins first (``_swap``,
with a memo, so an object met twice is still one object); a memoryview of any size is, since
pickle refuses memoryviews, and it arrives with its format, shape and writability.
The sender then places those buffers either in one shared-memory *block* from its own
``BlockPool`` (one memcpy), or, when shared memory is off, unavailable or full, inline after the
pickle in the same frame (written straight from the caller's memory by ``sendmsg``: the
streaming fallback). The frame carries flag ``FLAG_OOB`` and this payload::

    u32 table length | table (pickled: [("shm", name, offset, length) | ("inline", offset,
    length), ...], list of retained block names) | body (the pickle) | inline buffers

**Decoding.** ``decode`` maps the blocks named in the table through ``PeerMappings`` (validated:
the name must carry the expected owner prefix, the range must lie inside the block; a forged
table is a ``FrameError``, never a mapping of arbitrary memory) and unpickles with
``buffers=``. Received numpy arrays are then zero-copy views on the block or on the received
frame.

**Lifetimes** (who may reuse what, and when):
- Argument blocks (host -> worker) belong to the host. The worker's arrays view them only for the
  duration of the call; if the function kept a view (a cache), the worker reports the block as
  *retained* in its reply and the host gives the block up instead of reusing it (the worker's
  mapping keeps the memory alive).
- Reply blocks (worker -> host) belong to the worker and stay *pinned* until the host sends
  ``CONSUMED`` for that call id. The host either copies the buffers out and acks at once, or
  *lends* them: the result views the block through a loan root (``loan_root``), and the ack
  goes out when the root's last view dies, so nothing the caller keeps aliases memory the
  worker will reuse. A timer-driven TTL unlinks pinned blocks the host never acks (it lost
  the ack, or keeps the result long); only time the host is seen running counts toward it, so
  a stopped host still finds its reply (``main.Worker.expire_pins``).
- Echoed blocks: a result whose buffers all lie in the call's argument blocks goes back as
  ``("echo", name, offset, length)`` entries naming the host's own block (``echo_table``): no
  reply block, no copy. The host keeps that block out of its pool until the result's last view
  dies, so no later request writes into memory a result still shows. A result the function
  also kept (a retained block) is copied into a reply block instead: the caller never shares
  memory with the worker's cache.

**Names** carry the owning host's token (``ce-<pid>-t<start ticks>-n<pid namespace>-...``) so
the orphan sweep can tell a dead host's blocks from a live one's even when the pid is reused,
the owner: ``h<serial>`` for a host's pool, ``w<pid>`` for a worker, then a random part and
the block's serial (``ce-<token>-w812-9c0ffee1-3``). The random part keeps another user from
creating our next names first; a name found taken is skipped with a new random part
(``BlockPool``). Blocks are created with ``O_EXCL``, mode 0600, and never registered with
``multiprocessing.resource_tracker``.
"""

from __future__ import annotations

import _thread
import errno
import io
import mmap
import os
import pickle
import stat
import struct
import sys

from . import arrays

# Bound at import: the env's code may replace ``pickle.dumps``/``pickle.loads`` in a worker.
_dumps = pickle.dumps
_loads = pickle.loads
_BytesIO = io.BytesIO
# The pickler class behind a ``dumps`` (``encode``): the C pickler for pickle's own.
_PICKLERS_BY_DUMPS = {pickle.dumps: pickle.Pickler}

TYPE_CHECKING = False  # typing costs ~3-5 ms at worker start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Set, Tuple

SHM_DIR = "/dev/shm"
NAME_PREFIX = "ce-"
MIN_BLOCK = 1 << 20  # smallest size class
ALIGN = 64

_U32 = struct.Struct("<I")

if TYPE_CHECKING:
    Table = List[Tuple[Any, ...]]
else:
    Table = list  # for annotations only


_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def reserve(fd: int, size: int) -> None:
    """Size a new block *and* reserve its memory now.

    ``ftruncate`` alone succeeds on a full tmpfs; the first write into the mapping then raises
    SIGBUS, which kills the process (the host, on an argument). ``posix_fallocate`` makes a
    full /dev/shm an ``OSError`` (ENOSPC) here, which the sender answers by streaming the
    buffers inline. Where the call is missing or the file system cannot reserve space, the
    block is refused too (``OSError``): an unreserved block is exactly the SIGBUS risk."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # pragma: no cover - not Linux: no /dev/shm either
        raise OSError(errno.EOPNOTSUPP, "posix_fallocate is not available")
    fallocate(fd, 0, size)


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def size_class(nbytes: int) -> int:
    """Blocks come in powers of two from 1 MiB, so a freed block fits the next similar call.
    Pages past what is written are never touched, so rounding up costs no memory."""
    size = MIN_BLOCK
    while size < nbytes:
        size <<= 1
    return size


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


# ---- rebuilding bytes-like objects taken out of band -----------------------------------------


def rebuild_bytes(buf: Any) -> bytes:
    return bytes(buf)


def rebuild_bytearray(buf: Any) -> bytearray:
    return bytearray(buf)


def rebuild_memoryview(
    buf: Any, fmt: str = "B", shape: Optional[Tuple[int, ...]] = None, readonly: bool = False
) -> memoryview:
    """A private copy of a memoryview's bytes (C order), as a view of the original's format,
    shape and writability where ``memoryview.cast`` can take them (native single-character
    formats); else as flat bytes (``'B'``)."""
    view = memoryview(bytes(buf) if readonly else bytearray(buf))
    if fmt == "B" and (shape is None or len(shape) == 1):
        return view
    flat: Any = view  # (typeshed's cast takes only literal formats)
    shaped: memoryview
    try:
        shaped = flat.cast(fmt, shape)
    except (TypeError, ValueError):  # a shape with a zero, or a format cast refuses
        try:
            shaped = flat.cast(fmt)
        except (TypeError, ValueError):
            shaped = view
    return shaped


_REBUILD: Dict[type, Callable[[Any], Any]] = {
    bytes: rebuild_bytes,
    bytearray: rebuild_bytearray,
    memoryview: rebuild_memoryview,
}


class _OutOfBand:
    """Stands in for a large bytes-like object while pickling, so that it travels out of band:
    the C pickler writes bytes and bytearray in band without asking anyone, but any other
    object reduces through ``__reduce_ex__``, and a ``PickleBuffer`` there reaches the buffer
    callback. A memoryview of any size stands in too, since pickle refuses memoryviews: it
    goes as its bytes in C order (a copy where it is not C-contiguous), with its format,
    shape and writability (``rebuild_memoryview``)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce_ex__(self, _protocol: Any) -> Any:
        obj = self.obj
        if type(obj) is memoryview:
            data = pickle.PickleBuffer(obj if obj.c_contiguous else obj.tobytes())
            return rebuild_memoryview, (data, obj.format, obj.shape, obj.readonly)
        return _REBUILD[type(obj)], (pickle.PickleBuffer(obj),)


def rebuild_tensor(buf: Any, dtype: str, shape: Tuple[int, ...], requires_grad: bool) -> Any:
    """A torch CPU tensor over ``buf``, zero-copy (torch imported lazily).

    Built through numpy on purpose: a numpy array holds a buffer *export* of ``buf`` for as
    long as it lives, and ``torch.from_numpy`` keeps that array alive. That export is what makes
    a tensor a call kept count as retaining its block, and what stops the mapping from ever
    being closed under it (``torch.frombuffer`` keeps only the owning object, not an export).
    Without numpy the tensor is copied."""
    import torch

    target = getattr(torch, dtype)
    try:
        import numpy

        flat = torch.from_numpy(numpy.frombuffer(buf, dtype=numpy.uint8))
    except ImportError:
        flat = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    tensor = flat.view(target).reshape(shape) if flat.numel() else torch.empty(shape, dtype=target)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


class _TensorOutOfBand:
    """Stands in for a large torch CPU tensor: its bytes travel out of band (torch's own
    pickling would copy them into the pickle)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __reduce_ex__(self, _protocol: Any) -> Any:
        t = self.tensor.detach().contiguous()
        raw = t.reshape(-1).view(__import__("torch").uint8).numpy()
        dtype = str(t.dtype).rpartition(".")[2]
        grad = bool(self.tensor.requires_grad)
        return rebuild_tensor, (pickle.PickleBuffer(raw), dtype, tuple(t.shape), grad)


def _is_torch_cpu_tensor(value: Any, threshold: int) -> bool:
    kind = type(value)
    if kind.__name__ not in ("Tensor", "Parameter") or not kind.__module__.startswith("torch"):
        return False
    try:
        return bool(
            value.device.type == "cpu"
            and not value.is_sparse
            and value.element_size() * value.nelement() >= threshold
        )
    except Exception:  # noqa: BLE001 - anything unusual goes through torch's own pickling
        return False


def _is_large_bytes(value: Any, threshold: int) -> bool:
    """Large bytes-like objects and torch CPU tensors, which need a stand-in to travel out of
    band (numpy arrays do it on their own), and memoryviews of any size (pickle refuses
    them; see ``_OutOfBand``)."""
    kind = type(value)
    if kind is bytes or kind is bytearray:
        return len(value) >= threshold
    if kind is memoryview:
        return True
    return _is_torch_cpu_tensor(value, threshold)


def _swap(obj: Any, threshold: int, depth: int, memo: Dict[int, Tuple[Any, Any]]) -> Any:
    """``obj`` with large bytes-like objects replaced by ``_OutOfBand`` stand-ins, looking
    ``depth`` levels into tuples, lists and dicts (deeper ones travel in band).

    ``memo`` (id -> (original, replacement); the original is held so its id stays its own)
    keeps what pickle's memo keeps: an object met twice is replaced by one object, so a
    buffer found twice travels once and arrives as one object, a container shared by two
    arguments stays shared, and one that holds itself still does (a list or dict is
    remembered before its items are looked at)."""
    key = id(obj)
    seen = memo.get(key)
    if seen is not None:
        return seen[1]
    kind = type(obj)
    if _is_large_bytes(obj, threshold):
        if kind is bytes or kind is bytearray or kind is memoryview:
            stand_in: Any = _OutOfBand(obj)
        else:
            stand_in = _TensorOutOfBand(obj)
        memo[key] = (obj, stand_in)
        return stand_in
    if kind is tuple or kind is list or kind is dict:
        if depth <= 0:
            memo[key] = (obj, obj)  # met higher up again: still the same object
            return obj
    if kind is tuple:
        items = tuple([_swap(v, threshold, depth - 1, memo) for v in obj])
        seen = memo.get(key)  # (an item's list or dict held this tuple: the one made there)
        if seen is not None:
            return seen[1]
        memo[key] = (obj, items)
        return items
    if kind is list:
        new_list: List[Any] = []
        memo[key] = (obj, new_list)
        new_list.extend([_swap(v, threshold, depth - 1, memo) for v in obj])
        return new_list
    if kind is dict:
        new_dict: Dict[Any, Any] = {}
        memo[key] = (obj, new_dict)
        for k, v in obj.items():
            new_dict[k] = _swap(v, threshold, depth - 1, memo)
        return new_dict
    return obj


def _has_large_bytes(values: Sequence[Any], threshold: int) -> bool:
    """Cheap check of the values and one level into their containers."""
    for v in values:
        if _is_large_bytes(v, threshold):
            return True
        kind = type(v)
        if kind is list or kind is tuple:
            if any(_is_large_bytes(w, threshold) for w in v):
                return True
        elif kind is dict:
            if any(_is_large_bytes(w, threshold) for w in v.values()):
                return True
    return False


# Values that can never hold an out-of-band buffer: calls whose arguments (or results) are all
# of these skip the buffer callback entirely (the small-call hot path).
# Types that pickle with nothing out of band and hold no RemoteRef (``encode``'s shortcut, the
# worker's small result, the host's plain call: ``comfy_env._pool._all_scalars``).
SCALARS = frozenset((int, float, bool, type(None), str, complex))
NO_BUFFERS: List[memoryview] = []  # never appended to


def encode(
    obj: Any,
    threshold: int,
    dumps: Callable[..., bytes] = pickle.dumps,
    scan: Optional[Sequence[Any]] = None,
    pickler: Optional[type] = None,
) -> Tuple[bytes, List[memoryview]]:
    """Pickle ``obj`` taking buffers of at least ``threshold`` bytes out of band.

    Returns the pickle and the raw out-of-band buffers (C-contiguous byte views of the caller's
    memory; nothing is copied yet). ``scan`` lists the values that make up ``obj`` (the call's
    arguments, or the result): if all are scalars nothing can go out of band and the plain
    pickle is returned; large bytes-like objects among them (or one container level into
    them) are swapped for out-of-band stand-ins; numpy arrays go out of band on their own at
    any depth. ``scan=None`` checks nothing beyond the buffer callback.
    ``dumps`` is ``pickle.dumps`` or ``cloudpickle.dumps``; ``pickler`` is its pickler class
    (found for ``pickle.dumps``; pass ``cloudpickle.Pickler`` with ``cloudpickle.dumps``), which
    pickles plain numpy arrays version-neutrally (``arrays``) whenever numpy is loaded.
    """
    if scan is not None:
        for value in scan:
            if type(value) not in SCALARS:
                break
        else:
            return dumps(obj, protocol=5), NO_BUFFERS
    buffers: List[memoryview] = []

    def callback(pb: pickle.PickleBuffer) -> bool:
        try:
            raw = pb.raw()
        except BufferError:  # non-contiguous: let pickle copy it in band
            return True
        if raw.nbytes < threshold:
            return True
        buffers.append(raw)
        return False

    if scan and _has_large_bytes(scan, threshold):
        obj = _swap(obj, threshold, 3, {})
    np = sys.modules.get("numpy")
    if np is None or getattr(np, "ndarray", None) is None:  # no numpy (or a stub): no arrays
        return dumps(obj, protocol=5, buffer_callback=callback), buffers
    # Plain arrays in a version-neutral form (``arrays``): numpy's own pickle names its
    # private modules, which differ between numpy 1.x and 2.x.
    if pickler is None:
        pickler = _PICKLERS_BY_DUMPS.get(dumps)
        if pickler is None:  # an unknown ``dumps``: its own rules
            return dumps(obj, protocol=5, buffer_callback=callback), buffers
    out = _BytesIO()
    p = arrays.use(arrays.array_pickler(pickler)(out, protocol=5, buffer_callback=callback), np)
    p.dump(obj)
    return out.getvalue(), buffers


# ---- blocks ----------------------------------------------------------------------------------


class Block:
    """One shared-memory block this process created (and will unlink).

    ``write`` of a large buffer never holds the GIL for long (see ``COPY_STEP``): the pages
    it is about to fill for the first time are faulted in without the GIL (``prefault``),
    then the bytes are copied in steps, through ``ctypes.memmove`` (no GIL) where the source
    is writable. ``faulted`` is how far from the start the block's pages are known to be
    faulted in (written before, or prefaulted)."""

    __slots__ = ("faulted", "mm", "name", "size")

    def __init__(self, name: str, size: int) -> None:
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW, 0o600)
        try:
            reserve(fd, size)
            try:
                # Python 3.13+: the mapping keeps no descriptor (older ones keep a dup, one per
                # pooled block: about 200 a busy env's host held idle in a soak run).
                self.mm = mmap.mmap(fd, size, trackfd=False)  # type: ignore[call-arg,unused-ignore]
            except TypeError:
                self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.name = name
        self.size = size
        self.faulted = 0

    def write(self, offset: int, data: memoryview) -> None:
        n = data.nbytes
        end = offset + n
        if n < COPY_STEP:
            self.mm[offset:end] = data
        else:
            if end > self.faulted:
                # First use of these pages: a memcpy into them would take a page fault per
                # page with the GIL held (about 0.7 ms per MiB here, 4x the copy itself).
                start = max(offset, self.faulted) // mmap.PAGESIZE * mmap.PAGESIZE
                prefault(self.mm, start, end - start)
            _copy_in_steps(self.mm, offset, data)
        if offset <= self.faulted < end:
            self.faulted = end

    def prefault(self) -> None:
        """Fault every page of the block in now (a spare, made off the hot path)."""
        prefault(self.mm)
        self.faulted = self.size

    def destroy(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass
        try:
            self.mm.close()
        except BufferError:
            pass  # a peer-side view still exports it; the mapping goes when the view does


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, in one call
# Blocks of at least this size class get a pre-faulted spare as soon as a message takes the
# last idle one: the next message of that size would fault fresh pages on its path (about
# 175 ms per 256 MiB). Smaller ones get a spare once a second block of their size is in use
# with none idle (``BlockPool.wants_spare``): the caller keeps its results, each holding its
# block, so every call of that size needs a fresh one (a 3 MiB result then costs about 2 ms
# more a call on this machine kind, twice a call's whole round trip). Never for the first
# block of a size: not for the canary's, nor for a caller that drops its results.
SPARE_MIN_BYTES = 8 << 20


# ``mmap.madvise`` holds the GIL: populating 256 MiB in one call stalls every other thread of
# the process for 60-90 ms (measured here), the host's caller thread included when the host
# makes a spare. ``prefault`` therefore calls libc's madvise through ctypes, without the GIL;
# where it cannot, it advises in steps of this size, and the other threads run between steps.
# Through ctypes it advises in steps too: the kernel holds the process's memory-map lock while
# it populates a range, and any thread that maps memory meanwhile (a thread start's stack,
# malloc of a large buffer) waits for it, the GIL possibly in hand: one call over 256 MiB held
# a thread start (and with it the event loop) for the whole of it, 0.5-2.5 s here.
_PREFAULT_STEP = 4 << 20

# Writes of at least this many bytes into a block (``Block.write``) fault fresh pages in
# without the GIL first, then copy with ``ctypes.memmove`` in one call, the GIL released for
# all of it, where the source is writable; else in slice assignments of this size, holding the
# GIL one step at a time (it can change hands between steps): a 64 MiB argument copied in one
# slice assignment into a fresh block held the GIL (the event loop of an ``acall``) for
# 45-270 ms. Not memmove in steps: glibc copies a large range with non-temporal stores, and
# 4-64 MiB pieces of a 256 MiB copy took 45-55 ms against 25-30 ms in one piece (measured here;
# the payload benchmark's 256 MiB round trip went from 1.0 to 1.6 memcpys with steps).
COPY_STEP = 4 << 20


_madvise: Any = None  # libc's madvise through ctypes, once looked up (False: unavailable)


def load_native() -> None:
    """Import ctypes and look libc's ``madvise`` up, once (idempotent, never raises).

    A worker calls this on the thread that serves before it starts a helper thread that
    prefaults a spare block beside the env's next call: a first ``import ctypes``, ``CDLL``
    or symbol lookup is a ``dlopen``/``dlsym`` under the dynamic loader's lock, with the GIL
    held, which deadlocks against a library the env's code is loading whose initialiser drops
    and retakes the GIL (see ``comfy_env_worker.native``)."""
    global _madvise
    if _madvise is not None:
        return
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        fn.restype = ctypes.c_int
        _madvise = fn
    except (ImportError, AttributeError, OSError):
        _madvise = False


def _populate_without_gil(mm: mmap.mmap, start: int, length: int) -> bool:
    """``madvise(MADV_POPULATE_WRITE)`` over ``length`` bytes of ``mm`` from ``start`` (a page
    boundary) through ctypes, which lets go of the GIL for each call: the process's other
    threads (the caller's, the serve loop) run while the kernel faults the pages in. False
    where ctypes, libc's madvise or the advice (Linux 5.14+) is missing."""
    global _madvise
    if _madvise is None:
        load_native()
    if _madvise is False:
        return False
    try:
        import ctypes

        root = loan_root(mm)
        if root is None:
            return False
        try:
            base = ctypes.addressof(root)
            end = start + length
            for at in range(start, end, _PREFAULT_STEP):
                step = min(_PREFAULT_STEP, end - at)
                if _madvise(base + at, step, _MADV_POPULATE_WRITE) != 0:
                    return at > start  # (a later failure: the rest faults in as it is written)
            return True
        finally:
            del root
    except (ImportError, AttributeError, OSError, TypeError):
        _madvise = False
        return False


def prefault(mm: mmap.mmap, start: int = 0, length: Optional[int] = None) -> None:
    """Fault the pages of ``mm`` (``length`` bytes from ``start``, a page boundary; all of it
    by default) in, writable, now: with ``madvise(MADV_POPULATE_WRITE)`` where the kernel has
    it (through ctypes, without the GIL, in steps; else a few MiB per call, the GIL held for
    each), else by touching each page."""
    size = len(mm) - start if length is None else min(length, len(mm) - start)
    if size <= 0 or _populate_without_gil(mm, start, size):
        return
    end = start + size
    try:
        for at in range(start, end, _PREFAULT_STEP):
            mm.madvise(_MADV_POPULATE_WRITE, at, min(_PREFAULT_STEP, end - at))
        return
    except (OSError, ValueError, AttributeError):
        pass
    page = mmap.PAGESIZE
    for offset in range(start, end, page):
        mm[offset] = mm[offset]


def _copy_in_steps(mm: mmap.mmap, offset: int, data: memoryview) -> None:
    """Copy ``data`` into ``mm`` at ``offset``: in one ``ctypes.memmove`` (the GIL released
    for the whole copy) where ``data`` is writable (ctypes can address only writable
    buffers), else by slice assignments of ``COPY_STEP`` bytes (the GIL held per step)."""
    n = data.nbytes
    src: Any = None
    dst: Any = None
    try:
        import ctypes

        if not data.readonly:
            src = (ctypes.c_char * n).from_buffer(data)
            dst = (ctypes.c_char * n).from_buffer(mm, offset)
    except (ImportError, TypeError, ValueError, BufferError):
        src = dst = None
    try:
        if src is not None and dst is not None:
            ctypes.memmove(ctypes.addressof(dst), ctypes.addressof(src), n)
            return
        for at in range(0, n, COPY_STEP):
            step = min(COPY_STEP, n - at)
            mm[offset + at : offset + at + step] = data[at : at + step]
    finally:
        # The ctypes arrays export ``mm`` and ``data``: gone before anyone closes or resizes.
        del src, dst


# Names are not secrets: a host's token is in /proc for anyone to read, and SHM_DIR can be
# listed. Another user who creates files at the names a pool will use next (``File exists``)
# would otherwise turn shared memory off for that host. So each pool's names carry a random
# part, drawn anew whenever a name turns out taken, this many times per block at most.
NAME_TRIES = 8


def random_name_part() -> str:
    """The random part of a pool's block names (8 hex digits)."""
    return os.urandom(4).hex()


class _NotHeld:
    """A context that holds nothing (``BlockPool.hold`` unset)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NOT_HELD = _NotHeld()


_HEX = frozenset("0123456789abcdef")


def names_a_block_of(name: str, base: str) -> bool:
    """Whether ``name`` has the shape of a block a ``BlockPool(base, ...)`` makes:
    ``<base><8 hex digits>-<sequence number>``. The host tells with it a reply block the worker
    made and that is gone (given up, removed from /dev/shm by someone else: the result is
    lost, the worker broke no rule) from a name no block of that worker can have (a forged
    envelope: a protocol error)."""
    if not name.startswith(base):
        return False
    part, sep, seq = name[len(base) :].partition("-")
    return (
        len(part) == 8
        and set(part) <= _HEX
        and sep == "-"
        and 0 < len(seq) <= 20
        and all("0" <= c <= "9" for c in seq)
    )


class BlockPool:
    """Blocks this process reuses for what it sends: pre-faulted after first use (a fresh
    block per call costs about ten memcpys in page faults), bounded in total idle bytes.

    Block names are ``<name_prefix><random>-<serial>`` (``ce-<host token>-h3-1f2e3d4c-7``):
    the caller's prefix is what the peer and the sweep check; the random part is drawn anew
    when a name is taken (see ``NAME_TRIES``)."""

    def __init__(self, name_prefix: str, max_idle_bytes: int) -> None:
        self._base = name_prefix
        self._prefix = "%s%s-" % (name_prefix, random_name_part())
        self._max_idle = max_idle_bytes
        self._free: Dict[int, List[Block]] = {}
        self._idle_bytes = 0
        self._seq = 0
        self._lock = _thread.allocate_lock()
        self.live: Dict[str, Block] = {}  # every block not destroyed, by name
        self._idle_since: Dict[str, int] = {}  # name -> release order (the oldest goes first)
        self._clock = 0
        self.dropped: List[str] = []  # destroyed since the peer last heard, so it can unmap
        self._closed = False  # after destroy_all: a late spare is destroyed, never kept
        self._making: Dict[int, int] = {}  # size class -> spares being made right now
        # Size classes under SPARE_MIN_BYTES whose spare was once too late (a message needing a
        # block of that size had to make its own while the spare was still being made): calls
        # that come back to back only contend with their spares, so they get none until a
        # block of that size is given back (the caller let go of results: another phase).
        self._late: Set[int] = set()
        # What the host holds Ctrl-C back with while a block is made and recorded, given up
        # or destroyed (its ``_interrupts.Deferred``): a block made and not yet in ``live``
        # when a KeyboardInterrupt lands is known to nobody and outlives the host. None (the
        # worker, whose main thread takes no Ctrl-C from the host's terminal): nothing held.
        self.hold: Optional[Callable[[], ContextManager[Any]]] = None

    def _held(self) -> ContextManager[Any]:
        hold = self.hold
        return _NOT_HELD if hold is None else hold()

    def acquire(self, nbytes: int) -> Block:
        size = size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                block = free.pop()
                self._idle_bytes -= size
                self._idle_since.pop(block.name, None)
                return block
            if self._making.get(size) and size < SPARE_MIN_BYTES:
                self._late.add(size)
        with self._held():
            block = self._new_block(size)
            with self._lock:
                self.live[block.name] = block
        return block

    def _new_block(self, size: int) -> Block:
        """A new block under the next name. A name someone else created first (EEXIST) is
        never touched: the pool draws a new random part and tries again, ``NAME_TRIES`` times
        in all; then ``FileExistsError``, which the sender answers by streaming inline."""
        for _ in range(NAME_TRIES):
            with self._lock:
                self._seq += 1
                prefix = self._prefix
                name = "%s%d" % (prefix, self._seq)
            try:
                return Block(name, size)
            except FileExistsError:
                with self._lock:
                    if self._prefix == prefix:  # (another thread may have drawn anew already)
                        self._prefix = "%s%s-" % (self._base, random_name_part())
        raise FileExistsError(
            errno.EEXIST,
            "%d names in a row for a new block existed already" % NAME_TRIES,
            os.path.join(SHM_DIR, self._base + "*"),
        )

    def release(self, block: Block, spare: bool = False) -> None:
        """Keep ``block`` idle for reuse. Over the idle bound, the blocks idle the longest are
        given up first (whatever their size), so the sizes in use now stay cached. A block
        given back (not a new ``spare``) means the caller lets go of results: spares of its
        size may come again after one came too late."""
        victims: List[Block] = []
        with self._lock:
            if block.name not in self.live:
                return
            if not spare:
                self._late.discard(block.size)
            if block.size > self._max_idle:
                victims.append(block)
            else:
                while self._idle_bytes + block.size > self._max_idle:
                    oldest = min(
                        (b for blocks in self._free.values() for b in blocks),
                        key=lambda b: self._idle_since[b.name],
                    )
                    self._free[oldest.size].remove(oldest)
                    self._idle_bytes -= oldest.size
                    victims.append(oldest)
                self._free.setdefault(block.size, []).append(block)
                self._idle_bytes += block.size
                self._clock += 1
                self._idle_since[block.name] = self._clock
        for victim in victims:
            self.give_up(victim)

    def give_up(self, block: Block) -> None:
        """Unlink ``block`` and never reuse it (its memory lives on in any peer mapping)."""
        with self._held():
            with self._lock:
                self._idle_since.pop(block.name, None)
                if self.live.pop(block.name, None) is None:
                    return
                for blocks in self._free.values():
                    if block in blocks:
                        blocks.remove(block)
                        self._idle_bytes -= block.size
                self.dropped.append(block.name)
            block.destroy()

    def has_idle(self, nbytes: int) -> bool:
        with self._lock:
            return bool(self._free.get(size_class(nbytes)))

    def wants_spare(self, size: int) -> bool:
        """Whether a message that just took a block of size class ``size`` (and keeps it past
        this call: a pinned reply, a lent argument) should have a spare made for the next one
        (see ``SPARE_MIN_BYTES``)."""
        with self._lock:
            if self._free.get(size) or self._closed:
                return False
            if size >= SPARE_MIN_BYTES:
                return True
            if size in self._late:
                return False
            return sum(1 for block in self.live.values() if block.size == size) > 1

    def add_spare(self, nbytes: int) -> None:
        """Create a block of ``nbytes``' size class with its pages already faulted in and
        keep it idle, so that the next call needing one does not fault fresh pages on its
        path (about 175 ms per 256 MiB). Run off the hot path (a helper thread)."""
        size = size_class(nbytes)
        with self._lock:
            if size > self._max_idle or self._closed:
                return
            self._making[size] = self._making.get(size, 0) + 1
        try:
            block = self._new_block(size)
            block.prefault()
        finally:
            with self._lock:
                self._making[size] -= 1
        with self._lock:
            closed = self._closed
            if not closed:
                self.live[block.name] = block
        if closed:  # destroy_all ran meanwhile (the pool is closing): nothing may outlive it
            block.destroy()
            return
        self.release(block, spare=True)

    def get(self, name: str) -> Optional[Block]:
        """Our live block ``name``, or None."""
        with self._lock:
            return self.live.get(name)

    def take_dropped(self) -> List[str]:
        with self._lock:
            dropped, self.dropped = self.dropped, []
        return dropped

    @property
    def idle_blocks(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._free.values())

    def destroy_all(self) -> None:
        with self._held():
            with self._lock:
                self._closed = True
                blocks = list(self.live.values())
                self.live.clear()
                self._free.clear()
                self._idle_since.clear()
                self._idle_bytes = 0
            for block in blocks:
                block.destroy()


class PeerMappings:
    """Mappings of the peer's blocks, cached by name (names are never reused), bounded."""

    def __init__(self, allowed_prefix: str, max_mappings: int = 16) -> None:
        self._prefix = allowed_prefix
        self.prefix = allowed_prefix  # (read only: what every name mapped here starts with)
        self._max = max_mappings
        self._maps: Dict[str, mmap.mmap] = {}
        self._lock = _thread.allocate_lock()

    def _check_name(self, name: str) -> None:
        if (
            not isinstance(name, str)
            or not name.startswith(self._prefix)
            or "/" in name
            or name in (".", "..")
        ):
            raise ValueError("block name %r is not one of the peer's blocks" % (name,))

    def view(self, name: str, offset: int, length: int) -> memoryview:
        return _slice(self.mapping(name), name, offset, length)

    def cached(self, name: str) -> Optional[mmap.mmap]:
        """The cached mapping of the peer's block ``name``, if there is one."""
        with self._lock:
            return self._maps.get(name)

    def map_fresh(self, name: str) -> mmap.mmap:
        """A new mapping of the peer's block ``name``, not cached: its lifetime is its
        owner's (a loan lasts exactly as long as the views of this mapping)."""
        self._check_name(name)
        return self._open(name)

    def mapping(self, name: str) -> mmap.mmap:
        """The cached mapping of the peer's block ``name``, made now if there is none."""
        self._check_name(name)
        with self._lock:
            mm = self._maps.get(name)
        return self._map(name) if mm is None else mm

    @staticmethod
    def _open(name: str) -> mmap.mmap:
        # Only a regular file of ours is a block: a symlink the peer planted under one of its
        # names is not followed (it could point anywhere), a FIFO does not block the open, a
        # directory fails it (EISDIR), another user's file is refused.
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | _O_NOFOLLOW | os.O_NONBLOCK)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise ValueError("%s is not a block (no regular file of ours)" % name)
            size = info.st_size
            if size <= 0:
                raise ValueError("block %s is empty" % name)
            try:
                # Python 3.13+: the mapping keeps no descriptor (older ones keep a dup).
                return mmap.mmap(fd, size, trackfd=False)  # type: ignore[call-arg,unused-ignore]
            except TypeError:
                return mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def _map(self, name: str) -> mmap.mmap:
        mm = self._open(name)
        with self._lock:
            self._maps[name] = mm
            while len(self._maps) > self._max:
                oldest = next(iter(self._maps))
                self._close(self._maps.pop(oldest))
        return mm

    def forget(self, names: Sequence[str]) -> None:
        with self._lock:
            maps = [self._maps.pop(n) for n in names if n in self._maps]
        for mm in maps:
            self._close(mm)

    @staticmethod
    def _close(mm: mmap.mmap) -> None:
        try:
            mm.close()
        except BufferError:
            pass  # arrays still view it; the mapping closes when they are gone

    def close_all(self) -> None:
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
        for mm in maps:
            self._close(mm)


# ---- the frame payload -----------------------------------------------------------------------


def place(
    buffers: List[memoryview], pool: Optional[BlockPool]
) -> Tuple[Table, Optional[Block], List[memoryview]]:
    """Lay out out-of-band buffers: into one block from ``pool`` when given (one memcpy; after
    this the caller may drop the buffers), else inline (the buffers themselves are sent).
    Returns (table, block or None, inline buffers)."""
    table: Table = []
    inline: List[memoryview] = []
    offset = 0
    if pool is not None:
        block = pool.acquire(block_bytes(buffers))
        for buf in buffers:
            block.write(offset, buf)
            table.append(("shm", block.name, offset, buf.nbytes))
            offset += _align(buf.nbytes)
        return table, block, inline
    for buf in buffers:
        table.append(("inline", offset, buf.nbytes))
        inline.append(buf)
        offset += buf.nbytes
    return table, None, inline


def block_bytes(buffers: Sequence[memoryview]) -> int:
    """The bytes ``place`` lays ``buffers`` out on in one block (each aligned)."""
    return sum(_align(b.nbytes) for b in buffers)


def frame_parts(
    table: Table,
    body: bytes,
    inline: List[memoryview],
    pool: Optional[BlockPool],
    retained: Sequence[str] = (),
) -> Tuple[List[Any], int]:
    """The out-of-band payload as iovec parts for ``sendmsg``, and its length. Names of our
    blocks given up since the peer last heard (``pool``'s dropped list) ride along, so the
    peer can unmap them."""
    dropped = pool.take_dropped() if pool is not None else []
    head = _dumps((table, list(retained), dropped), protocol=5)
    parts: List[Any] = [_U32.pack(len(head)), head, body]
    parts.extend(inline)
    length = 4 + len(head) + len(body) + sum(b.nbytes for b in inline)
    return parts, length


def pack(
    body: bytes,
    buffers: List[memoryview],
    pool: Optional[BlockPool],
    retained: Sequence[str] = (),
) -> Tuple[List[Any], Optional[Block], int]:
    """``place`` then ``frame_parts``: (iovec parts, the block used or None, payload length)."""
    table, block, inline = place(buffers, pool)
    parts, length = frame_parts(table, body, inline, pool, retained)
    return parts, block, length


def echo_table(
    buffers: Sequence[memoryview], mappings: Optional[PeerMappings], names: Sequence[Optional[str]]
) -> Optional[Table]:
    """The reply table of a result whose buffers all lie inside the peer's blocks ``names``
    (the call's argument blocks: an echo, a slice or an in-place update of an argument):
    ``("echo", name, offset, length)`` entries that send the peer's own memory back to it, no
    copy made. None when any buffer lies elsewhere (then it is copied into a reply block).

    Addresses come from numpy, which is loaded whenever a result holds an array (without it no
    result can alias a block: bytes-like results are rebuilt as copies on arrival)."""
    np = sys.modules.get("numpy")
    if np is None or mappings is None or not buffers:
        return None
    spans = []
    for name in set(n for n in names if n is not None):
        mm = mappings.cached(name)
        if mm is not None and len(mm):
            base = np.frombuffer(mm, dtype=np.uint8).__array_interface__["data"][0]
            spans.append((base, len(mm), name))
    if not spans:
        return None
    table: Table = []
    for buf in buffers:
        addr = np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]
        for base, size, name in spans:
            offset = addr - base
            if 0 <= offset and offset + buf.nbytes <= size:
                table.append(("echo", name, offset, buf.nbytes))
                break
        else:
            return None
    return table


def _slice(mm: Any, name: str, offset: int, length: int) -> memoryview:
    if not (0 <= offset and 0 <= length and offset + length <= len(mm)):
        raise ValueError(
            "range %d+%d lies outside block %s of %d bytes" % (offset, length, name, len(mm))
        )
    view = memoryview(mm)
    if view.format != "B":
        view = view.cast("B")  # a loan root (ctypes) exports single chars
    return view[offset : offset + length]


_root_types: Dict[int, Any] = {}


def loan_root(mm: mmap.mmap) -> Any:
    """A new exporter of all of ``mm``'s memory: no copy, no new mapping, no system call.

    A loan must last exactly as long as the views of it, and a weak reference to the object
    whose buffer they share says when that is. A memoryview cannot be that object: its slices
    and casts hold the *mapping*, not the view they came from. A ctypes array made with
    ``from_buffer`` exports its own buffer (every view taken from it holds it) and keeps
    ``mm`` alive (and, while views live, open: ``mm.close()`` raises ``BufferError``, which
    every closer here expects). A fresh mapping of the block would do the same at the cost of
    four system calls and a page fault for every page the caller then touches. Returns None
    where ctypes is missing (the caller maps the block afresh)."""
    size = len(mm)
    array_type = _root_types.get(size)
    if array_type is None:
        try:
            import ctypes
        except ImportError:
            return None
        array_type = _root_types.setdefault(size, ctypes.c_char * size)  # size classes: few
    return array_type.from_buffer(mm)


def _is_index(value: Any) -> bool:
    """An offset or length as ``place`` writes it: a plain int (not a bool, not a float)."""
    return type(value) is int and value >= 0


def check_envelope(table: Any, retained: Any, dropped: Any) -> None:
    """Raise ``ValueError`` unless an unpickled envelope has exactly the shapes ``place``,
    ``echo_table`` and ``frame_parts`` write: a list of ``("inline", offset, length)`` and
    ``("shm" | "echo", name, offset, length)`` tuples (names str, offsets and lengths ints of
    at least 0), and lists of block names. A forged envelope then fails here with one clear
    message, never later with a ``TypeError`` or ``IndexError`` from deep in ``unpack``.
    Messages name types, never the peer's objects (whose repr could be anything)."""
    for what, names in (("retained", retained), ("dropped", dropped)):
        if type(names) is not list or any(type(n) is not str for n in names):
            raise ValueError("the %s blocks are not a list of names" % what)
    if type(table) is not list:
        raise ValueError("the table is a %s, not a list" % type(table).__name__)
    for entry in table:
        if type(entry) is not tuple or not entry or type(entry[0]) is not str:
            raise ValueError("a table entry is a %s, not a tagged tuple" % type(entry).__name__)
        kind = entry[0]
        if kind == "inline":
            if len(entry) != 3 or not (_is_index(entry[1]) and _is_index(entry[2])):
                raise ValueError("malformed inline entry (offset and length must be ints)")
        elif kind == "shm" or kind == "echo":
            if len(entry) != 4 or type(entry[1]) is not str:
                raise ValueError("malformed %s entry (a block name, offset, length)" % kind)
            if not (_is_index(entry[2]) and _is_index(entry[3])):
                raise ValueError(
                    "the range in block %s is not two ints of at least 0 (%s, %s)"
                    % (entry[1][:200], type(entry[2]).__name__, type(entry[3]).__name__)
                )
        else:
            raise ValueError("unknown out-of-band entry %r" % (kind[:40],))


def unpack(
    payload: Any,
    mappings: Optional[PeerMappings],
    copy_out: bool,
    loaned: Optional[List[Any]] = None,
    loan_min: int = 0,
    own: Optional[BlockPool] = None,
    echoed: Optional[List[Tuple[Block, Optional[Any]]]] = None,
) -> Tuple[memoryview, List[Any], List[Optional[str]], List[str]]:
    """Split an out-of-band payload. Returns (body, buffers for ``pickle.loads``, the block
    name each buffer came from (None: inline), names of our blocks the peer retained).
    ``copy_out`` copies shared-memory buffers into private memory. With ``loaned`` (a list),
    shared-memory buffers are views of a loan root (``loan_root``) of each peer block's cached
    mapping, one root per block, appended to ``loaned``: the caller lends them out and returns
    each block to the peer when the last view of its root is gone (the host's loaned reply
    blocks). Mappings of blocks the peer dropped are closed (one a loan still shows stays
    until the loan ends). A payload with fewer than ``loan_min`` shared-memory bytes is copied
    out instead. ``echo`` entries name blocks of ``own`` (our pool: the peer sent our argument
    memory back): with ``loaned`` they are views of a loan root of our block's mapping,
    appended with the block to ``echoed`` (the caller keeps the block out of its pool until
    the root dies), else copies (the block is appended with None). Without ctypes a fresh
    mapping of the block stands in for the root. Raises ``ValueError`` on a malformed or
    forged table (``check_envelope``), ``OSError`` when a block it names cannot be opened
    (no such block, not a block, or out of descriptors or memory here)."""
    view = memoryview(payload)
    if len(view) < 4:
        raise ValueError("out-of-band payload shorter than its header")
    (head_len,) = _U32.unpack_from(view, 0)
    if head_len > len(view) - 4:
        raise ValueError("out-of-band table overruns the frame")
    try:
        table, retained, dropped = _loads(view[4 : 4 + head_len])
    except Exception as exc:  # noqa: BLE001 - a forged table is a protocol error
        raise ValueError("unreadable out-of-band table: %s" % exc) from None
    check_envelope(table, retained, dropped)
    if mappings is not None and dropped:
        mappings.forget(dropped)
    inline_total = sum(e[2] for e in table if e[0] == "inline")
    body_end = len(view) - inline_total
    if body_end < 4 + head_len:
        raise ValueError("inline buffers overrun the frame")
    body = view[4 + head_len : body_end]
    inline_area = view[body_end:]
    if inline_total and inline_area.readonly:
        # A frame read whole together with others (the host's asyncio reader; a reader that
        # met two frames in one read) is ``bytes``: arrays built on it would be read-only,
        # where the same value read alone (into a bytearray) is writable. Such a frame is at
        # most one read of 64 KiB, so one copy makes the rule simple: inline buffers are
        # writable whichever way the frame was read.
        inline_area = memoryview(bytearray(inline_area))
    buffers: List[Any] = []
    sources: List[Optional[str]] = []
    loaned_names: List[str] = []
    if loaned is not None and loan_min > 0:
        shared = sum(e[3] for e in table if e[0] != "inline")
        if shared < loan_min:
            loaned, copy_out = None, True
    for entry in table:
        if entry[0] == "inline":
            _, offset, length = entry
            if not (0 <= offset and 0 <= length and offset + length <= len(inline_area)):
                raise ValueError("inline buffer range out of the frame")
            buffers.append(inline_area[offset : offset + length])
            sources.append(None)
        elif entry[0] == "shm":
            if mappings is None:
                raise ValueError("a shared-memory buffer arrived but shared memory is off")
            _, name, offset, length = entry
            if loaned is not None:
                root = next((r for n, r in zip(loaned_names, loaned) if n == name), None)
                if root is None:
                    root = loan_root(mappings.mapping(name))
                    if root is None:
                        root = mappings.map_fresh(name)
                    loaned.append(root)
                    loaned_names.append(name)
                buffers.append(_slice(root, name, offset, length))
                sources.append(name)
                continue
            buf = mappings.view(name, offset, length)
            if copy_out:
                buffers.append(private_copy(buf))
                buf.release()
            else:
                buffers.append(buf)
            sources.append(name)
        elif entry[0] == "echo":
            _, name, offset, length = entry
            block = own.get(name) if own is not None else None
            if block is None or echoed is None:
                raise ValueError("echo entry names %r, not one of our blocks" % (name,))
            if loaned is None:
                buf = _slice(block.mm, name, offset, length)
                buffers.append(private_copy(buf))
                buf.release()
                if not any(b is block for b, _ in echoed):
                    echoed.append((block, None))
            else:
                root = next((r for b, r in echoed if b is block), None)
                if root is None:
                    root = loan_root(block.mm)
                    if root is None:
                        root = PeerMappings._open(name)
                    echoed.append((block, root))
                buffers.append(_slice(root, name, offset, length))
            sources.append(None)  # our own memory: nothing of the peer's to acknowledge
        else:
            raise ValueError("unknown out-of-band entry %r" % (entry[0],))
    return body, buffers, sources, list(retained)


def private_copy(buf: memoryview) -> Any:
    """A private, writable copy of ``buf`` in one memcpy. Large copies go to an anonymous
    mapping advised for huge pages: faulting in fresh 4 KiB pages costs several times the copy
    itself (``bytearray(buf)`` also takes a slower path than a plain memcpy)."""
    n = buf.nbytes
    if n < (2 << 20):
        out = bytearray(n)
        memoryview(out)[:] = buf
        return out
    # Private (not MAP_SHARED, which would be shmem without huge pages) and advised for huge
    # pages: a fresh 256 MiB copy then costs about one memcpy instead of three or four.
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mm = mmap.mmap(-1, n, flags=flags) if flags else mmap.mmap(-1, n)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:
            pass
    mm[0:n] = buf
    return mm


def owned_blocks(prefix: str) -> List[str]:
    """Names in SHM_DIR that start with ``prefix``."""
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return []


def unlink_blocks(prefix: str) -> List[str]:
    """Unlink every block of ours whose name starts with ``prefix``; returns the names
    unlinked. Anyone can create a file by any name in SHM_DIR: one that is not a regular
    file owned by our uid is left alone (root would otherwise delete another user's file)."""
    gone = []
    uid = os.getuid()
    for name in owned_blocks(prefix):
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue
            os.unlink(path)
            gone.append(name)
        except OSError:
            pass
    return gone

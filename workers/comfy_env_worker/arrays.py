"""numpy arrays that cross between numpy 1.x and 2.x: a version-neutral pickle of plain arrays.

Both sides use this module (stdlib only at import, Python 3.8+; numpy is imported only by the
functions that meet an array, and only where one already exists).

**Why.** numpy's own pickle of an array names numpy's private modules: ``numpy.core.numeric.
_frombuffer`` (1.x) or ``numpy._core.numeric._frombuffer`` (2.x). A numpy-2 host sending any
array to a numpy-1 env (``bpy`` pins numpy<2) fails in the worker with ``No module named
'numpy._core.numeric'``, and the reverse direction fails alike. The payload must not depend on
both sides having the same numpy major version.

**Data flow.**

    sender: ArrayPickler.reducer_override(arr)    (only for type(arr) is numpy.ndarray)
        -> reduce_array(arr) -> (rebuild_array, (PickleBuffer(bytes of arr), spec, shape, order))
        -> the buffer goes out of band above the threshold (shm.encode's callback), as before
    receiver: rebuild_array(buf, spec, shape, order)
        -> numpy.frombuffer(buf, numpy.dtype(spec)).reshape(shape, order=order), zero-copy

``spec`` (``dtype_spec``) is made of str, int and tuples only: ``dtype.str`` (``'<f8'``,
``'<M8[ms]'``, ``'|S3'``, ``'>i4'``) for a builtin dtype, a tuple tree for structured ones
(names, field specs, offsets, itemsize, titles, aligned) and sub-array fields. Every numpy from
1.21 reads it, so a pickle of a plain array names only this module.

**Copies.** None beyond numpy's own: a C- or Fortran-contiguous array is sent as a flat byte
view of its memory (order ``'F'`` rebuilds the Fortran layout); any other array is made
contiguous first (one copy; numpy's own reduce copies it into the pickle with ``tobytes``).

numpy scalars (``np.float64(0.5)``, what ``arr.mean()`` returns) of those dtypes travel the
same way, as their bytes (``rebuild_scalar``).

**What keeps numpy's own pickle** (and so still needs the same numpy major on both sides):
ndarray subclasses (``np.matrix``, masked arrays, ``np.memmap``) and arrays whose dtype holds
Python objects. An array of a dtype that is not numpy's builtin (numpy 2's ``StringDType``, a
user dtype such as ``bfloat16``) travels as numpy's own pickle nested in ``rebuild_foreign``:
where the receiver cannot load it, the error names the dtype and both numpy versions, never a
private module.
"""

from __future__ import annotations

import pickle
import sys

TYPE_CHECKING = False  # typing costs ~3-5 ms at worker start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Optional, Tuple

_dumps = pickle.dumps  # bound at import: env code may replace pickle.dumps in a worker
_loads = pickle.loads
_PickleBuffer = pickle.PickleBuffer

# dtype kinds numpy 1.x and 2.x share, with the same memory layout: bool, signed, unsigned,
# float, complex, datetime64, timedelta64, bytes ('S'), unicode ('U'), void ('V').
PLAIN_KINDS = frozenset("biufcmMSUV")

# dtype -> spec on the sending side (None: not plain); spec -> dtype on the receiving side.
# Both bounded: the set of dtypes a program uses is small, but a host must not grow forever.
_SPECS: Dict[Any, Any] = {}
_DTYPES: Dict[Any, Any] = {}
_CACHE_MAX = 1024


class DtypeNotRepresentable(TypeError):
    """An array's dtype cannot be made by the receiving side's numpy (a numpy-2-only dtype
    going to numpy 1, a user dtype the env lacks). A ``TypeError``, never an ``ImportError``:
    the env is not missing a module, its numpy cannot hold this dtype."""


def _numpy() -> Any:
    np = sys.modules.get("numpy")
    if np is None:
        import numpy as np
    return np


def _builtin_scalar_type(np: Any, dtype: Any) -> bool:
    """Whether ``dtype``'s scalar type is one of numpy's own (not a user dtype whose kind
    happens to be a plain one, such as ml_dtypes' ``bfloat16``, kind ``'V'``)."""
    return getattr(dtype.type, "__module__", None) == "numpy" and dtype.isbuiltin != 2


def _make_spec(np: Any, dtype: Any) -> Any:
    if dtype.hasobject or dtype.kind not in PLAIN_KINDS or not _builtin_scalar_type(np, dtype):
        return None
    sub = dtype.subdtype
    if sub is not None:  # a sub-array field: ('f8', (2, 3))
        base = _make_spec(np, sub[0])
        return None if base is None else ("sub", base, tuple(int(n) for n in sub[1]))
    names = dtype.names
    if names is None:
        return dtype.str
    specs, offsets, titles = [], [], []
    for name in names:
        field = dtype.fields[name]
        spec = _make_spec(np, field[0])
        if spec is None:
            return None
        specs.append(spec)
        offsets.append(int(field[1]))
        titles.append(field[2] if len(field) > 2 else None)
    has_titles = any(title is not None for title in titles)
    return (
        "struct",
        tuple(str(name) for name in names),
        tuple(specs),
        tuple(offsets),
        int(dtype.itemsize),
        tuple(titles) if has_titles else None,
        bool(dtype.isalignedstruct),
    )


def dtype_spec(dtype: Any) -> Any:
    """A version-neutral description of ``dtype`` (plain Python values), or None when the
    dtype is not one numpy 1.x and 2.x share (objects inside, a non-builtin dtype)."""
    try:
        return _SPECS[dtype]
    except KeyError:
        pass
    except TypeError:  # an unhashable dtype (a user dtype with odd metadata)
        return _make_spec(_numpy(), dtype)
    spec = _make_spec(_numpy(), dtype)
    if len(_SPECS) >= _CACHE_MAX:
        _SPECS.clear()
    _SPECS[dtype] = spec
    return spec


def _build_dtype(np: Any, spec: Any) -> Any:
    if type(spec) is str:
        return np.dtype(spec)
    if spec[0] == "sub":
        return np.dtype((_build_dtype(np, spec[1]), spec[2]))
    _, names, specs, offsets, itemsize, titles, aligned = spec
    fields: Dict[str, Any] = {
        "names": list(names),
        "formats": [_build_dtype(np, s) for s in specs],
        "offsets": list(offsets),
        "itemsize": itemsize,
    }
    if titles is not None:
        fields["titles"] = list(titles)
    return np.dtype(fields, align=aligned)


def spec_dtype(spec: Any) -> Any:
    """The receiving numpy's dtype for ``spec``; ``DtypeNotRepresentable`` if it has none."""
    try:
        return _DTYPES[spec]
    except KeyError:
        pass
    np = _numpy()
    try:
        dtype = _build_dtype(np, spec)
    except Exception as exc:  # noqa: BLE001 - told as what it is, with the dtype named
        raise DtypeNotRepresentable(
            "numpy dtype %s cannot be represented by numpy %s here: %s: %s"
            % (_spec_text(spec), np.__version__, type(exc).__name__, exc)
        ) from None
    if len(_DTYPES) >= _CACHE_MAX:
        _DTYPES.clear()
    _DTYPES[spec] = dtype
    return dtype


def _spec_text(spec: Any) -> str:
    if type(spec) is str:
        return repr(spec)
    if spec[0] == "sub":
        return "(%s, %r)" % (_spec_text(spec[1]), spec[2])
    return "[%s]" % ", ".join("(%r, %s)" % (n, _spec_text(s)) for n, s in zip(spec[1], spec[2]))


def rebuild_array(buf: Any, spec: Any, shape: Tuple[int, ...], order: str) -> Any:
    """Unpickle a plain array: a zero-copy view of ``buf`` (an out-of-band buffer, or the
    bytes/bytearray pickled in band), as numpy's own ``_frombuffer`` makes it."""
    np = _numpy()
    dtype = spec_dtype(spec)
    if buf is None:  # zero-size items: nothing was sent
        return np.empty(shape, dtype=dtype, order=order)
    return np.frombuffer(buf, dtype=dtype).reshape(shape, order=order)


def rebuild_foreign(dtype_text: str, sender: str, pickled: bytes) -> Any:
    """Unpickle an array of a dtype outside the shared set (``StringDType``, a user dtype)
    from numpy's own pickle; where this numpy cannot, say which dtype it was."""
    try:
        return _loads(pickled)
    except Exception as exc:  # noqa: BLE001 - told as what it is, with the dtype named
        np = sys.modules.get("numpy")
        here = "numpy %s" % np.__version__ if np is not None else "this env (no numpy)"
        raise DtypeNotRepresentable(
            "numpy dtype %s (sent by numpy %s) cannot be represented by %s: %s: %s"
            % (dtype_text, sender, here, type(exc).__name__, exc)
        ) from None


def _holds_objects(dtype: Any) -> bool:
    """Whether ``dtype`` holds Python objects (kind ``'O'``, or a field or sub-array of it).
    ``hasobject`` alone says too much: numpy 2's ``StringDType`` sets it too."""
    if dtype.kind == "O":
        return True
    if dtype.subdtype is not None:
        return _holds_objects(dtype.subdtype[0])
    if dtype.names is not None:
        return any(_holds_objects(dtype.fields[name][0]) for name in dtype.names)
    return False


def reduce_array(arr: Any) -> Any:
    """The reduce value of a plain ``numpy.ndarray`` (its exact type), or ``NotImplemented``
    for one that keeps numpy's own pickle (objects inside)."""
    dtype = arr.dtype
    spec = dtype_spec(dtype)
    if spec is None:
        if _holds_objects(dtype):
            return NotImplemented  # numpy's own pickle: its objects go through this pickler
        np = _numpy()
        return rebuild_foreign, (str(dtype), np.__version__, _dumps(arr, protocol=5))
    shape = arr.shape
    if dtype.itemsize == 0:  # ('S0', 'V0'): no bytes to send; numpy's own reduce neither
        return rebuild_array, (None, spec, shape, "C")
    np = _numpy()
    flags = arr.flags
    # A flat uint8 view of the array's memory: exports a buffer for every plain dtype
    # (numpy refuses a buffer of datetime64, for one) and costs no copy.
    if flags.c_contiguous:
        order = "C"
        flat = arr.reshape(-1)
    elif flags.f_contiguous:
        order = "F"
        flat = arr.T.reshape(-1)
    else:  # numpy's own reduce copies it too (into the pickle, with tobytes)
        order = "C"
        flat = np.ascontiguousarray(arr).reshape(-1)
    return rebuild_array, (_PickleBuffer(flat.view(np.uint8)), spec, shape, order)


def rebuild_scalar(data: bytes, spec: Any) -> Any:
    """Unpickle a numpy scalar (``np.float64(0.5)``, ``np.datetime64('2024-01-02')``)."""
    return _numpy().frombuffer(data, dtype=spec_dtype(spec))[0]


def reduce_scalar(value: Any) -> Any:
    """The reduce value of a numpy scalar of a plain dtype, or ``NotImplemented`` (numpy's
    own pickle) for the rest. numpy pickles scalars through ``numpy.core.multiarray.scalar``
    (``numpy._core`` in 2.x), so a reduction such as ``arr.mean()`` would not cross either."""
    dtype = value.dtype
    spec = dtype_spec(dtype)
    if spec is None or dtype.itemsize == 0:
        return NotImplemented
    return rebuild_scalar, (value.tobytes(), spec)


_SCALARS: Dict[int, Any] = {}


def scalar_types(np: Any) -> Any:
    """numpy's own scalar types (``np.float64``, ``np.str_``, ...) of ``np``, but not
    ``np.object_`` (its instances are Python objects)."""
    found = _SCALARS.get(id(np))
    if found is None:
        found = frozenset(
            t
            for t in np.sctypeDict.values()
            if isinstance(t, type) and issubclass(t, np.generic) and t is not np.object_
        )
        _SCALARS.clear()
        _SCALARS[id(np)] = found
    return found


_PICKLERS: Dict[type, type] = {}


def array_pickler(base: type) -> type:
    """A subclass of the pickler class ``base`` (``pickle.Pickler`` or cloudpickle's) that
    pickles plain numpy arrays with ``reduce_array`` and numpy scalars with ``reduce_scalar``;
    ``use(instance, numpy)`` before ``dump``. Everything else goes to ``base``'s own rules."""
    cls = _PICKLERS.get(base)
    if cls is not None:
        return cls
    parent: Optional[Callable[[Any, Any], Any]] = getattr(base, "reducer_override", None)

    if parent is None:

        def reducer_override(self: Any, obj: Any) -> Any:
            kind = type(obj)
            if kind is self.ndarray:
                return reduce_array(obj)
            if kind in self.scalars:
                return reduce_scalar(obj)
            return NotImplemented

    else:

        def reducer_override(self: Any, obj: Any) -> Any:
            kind = type(obj)
            if kind is self.ndarray:
                value = reduce_array(obj)
                if value is not NotImplemented:
                    return value
            elif kind in self.scalars:
                value = reduce_scalar(obj)
                if value is not NotImplemented:
                    return value
            return parent(self, obj)

    namespace: Dict[str, Any] = {
        "reducer_override": reducer_override,
        "ndarray": None,
        "scalars": frozenset(),
    }
    cls = type("ArrayPickler", (base,), namespace)
    _PICKLERS[base] = cls
    return cls


def use(pickler: Any, np: Any) -> Any:
    """Arm an ``array_pickler`` instance with ``np``'s array and scalar types."""
    pickler.ndarray = np.ndarray
    pickler.scalars = scalar_types(np)
    return pickler


def numpy_facts() -> Dict[str, Any]:
    """This interpreter's numpy, for ``comfy-env doctor``: its version, or why it is missing."""
    try:
        import numpy
    except Exception as exc:  # noqa: BLE001 - an ImportError, or a numpy that breaks on import
        return {"version": None, "error": "%s: %s" % (type(exc).__name__, exc)}
    return {"version": str(numpy.__version__), "error": None}

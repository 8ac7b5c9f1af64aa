"""Arrays for the numpy 1.x <-> 2.x tests (tests/test_numpy_skew.py), importable on both sides.

Runs in the host and in workers of envs with numpy 1.26 or 2.x, and in a numpy-1.26 host
subprocess: ``cases()`` builds the same arrays, byte for byte, under any numpy from 1.21, so
each side can compare what it received with what it would have built itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

# Above the 64 KiB out-of-band threshold: these travel through shared memory (or inline when
# shared memory is off).
LARGE = 4 << 20


@dataclasses.dataclass
class Holder:
    """An object with arrays inside (pickled through its __dict__)."""

    image: Any
    extras: Any


def numpy_version() -> str:
    return str(np.__version__)


def cases() -> dict[str, Any]:
    """Every kind of plain array numpy 1.x and 2.x share: dtypes, shapes, memory orders."""
    out: dict[str, Any] = {}
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    ):  # fmt: skip
        out[name] = (np.arange(24) % 7).astype(name).reshape(2, 3, 4)
    out["longdouble"] = (np.arange(5) / 4).astype(np.longdouble)
    for unit in ("D", "ms", "ns"):
        out[f"datetime64[{unit}]"] = np.arange(6).astype(f"datetime64[{unit}]")
        out[f"timedelta64[{unit}]"] = np.arange(6).astype(f"timedelta64[{unit}]")
    out["nat"] = np.array(["NaT", "2024-01-02"], dtype="datetime64[s]")
    out["bytes S5"] = np.array([b"ab", b"cdefg", b""], dtype="S5")
    out["str U3"] = np.array(["x", "\u00e9t\u00e9", "\U0001f600"], dtype="U3")
    out["void V4"] = np.frombuffer(b"abcdefgh", dtype="V4").copy()
    point = np.dtype([("x", "<f4"), ("y", ">i2"), ("tag", "S3"), ("m", "<f8", (2, 2))])
    out["structured"] = np.zeros(4, dtype=point)
    out["structured"]["x"] = [1.5, 2.5, 3.5, 4.5]
    out["structured"]["tag"] = [b"a", b"bb", b"ccc", b""]
    out["structured"]["m"] = np.arange(16.0).reshape(4, 2, 2)
    aligned = np.dtype([("a", "u1"), ("b", "<f8"), ("c", [("d", "<i4"), ("e", "U2")])], align=True)
    out["aligned nested"] = np.zeros(3, dtype=aligned)
    out["aligned nested"]["b"] = [0.5, -1.0, 7.0]
    out["titled"] = np.zeros(
        2, dtype=np.dtype({"names": ["a"], "formats": ["<i8"], "titles": ["A"]})
    )
    out["0-d"] = np.array(3.25)
    out["0-d int"] = np.array(-7, dtype="int16")
    out["empty"] = np.zeros((0, 3), dtype="float32")
    out["empty 1-d"] = np.array([], dtype="int64")
    out["empty U"] = np.zeros((2, 0), dtype="U4")
    out["fortran"] = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    out["view"] = np.arange(60, dtype="int32").reshape(6, 10)[1::2, ::3]
    out["negative strides"] = np.arange(10, dtype="float64")[::-1]
    out["big-endian i4"] = np.arange(5, dtype=">i4")
    out["big-endian f8"] = np.linspace(0, 1, 5).astype(">f8")
    out["readonly"] = np.arange(5, dtype="uint16")
    out["readonly"].flags.writeable = False
    out["large"] = np.arange(LARGE // 4, dtype="float32")
    out["large fortran"] = np.asfortranarray(
        np.arange(LARGE // 8, dtype="float64").reshape(512, -1)
    )
    out["large view"] = np.arange(LARGE // 2, dtype="uint8").reshape(-1, 64)[::2, 1:]
    out["large big-endian"] = np.arange(LARGE // 8, dtype=">i8")
    return out


def scalars() -> dict[str, Any]:
    """numpy scalars, what reductions such as ``arr.mean()`` return."""
    return {
        "float64": np.float64(0.25),
        "float32": np.float32(1.5),
        "float16": np.float16(-2.0),
        "int64": np.int64(-5),
        "uint8": np.uint8(200),
        "bool": np.bool_(True),
        "complex128": np.complex128(1 - 2j),
        "datetime64": np.datetime64("2024-01-02T03:04", "m"),
        "timedelta64": np.timedelta64(7, "ms"),
        "bytes": np.bytes_(b"ab"),
        "str": np.str_("\u00e9t\u00e9"),
        "mean": np.arange(10.0).mean(),
        "record": np.zeros(1, dtype=[("a", "<i4"), ("b", "S2")])[0],
    }


def containers() -> dict[str, Any]:
    """Arrays inside dicts, lists, tuples and an object, one of them met twice."""
    shared = np.arange(LARGE // 8, dtype="int64")
    return {
        "dict": {"a": np.arange(3), "nested": {"b": np.ones((2, 2), dtype="float32")}},
        "list": [np.arange(4, dtype="uint8"), [np.array(1.5)], shared],
        "tuple": (shared, np.zeros(0)),
        "object": Holder(np.ones((8, 8, 3), dtype="uint8"), [np.arange(2), shared]),
    }


def same(a: Any, b: Any) -> str | None:
    """Why ``b`` is not ``a`` (an array or a container of arrays), or None if it is."""
    if isinstance(a, np.ndarray):
        if type(b) is not np.ndarray:
            return f"got a {type(b).__name__}, not an ndarray"
        if b.dtype != a.dtype or b.shape != a.shape:
            return f"got {b.dtype} {b.shape}, not {a.dtype} {a.shape}"
        if a.dtype.type is np.longdouble:  # 80 bits in 16 bytes: the padding is garbage
            if not np.array_equal(a, b):
                return "different values"
        elif b.tobytes() != a.tobytes():
            return "different contents"
        if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous:
            if not b.flags.f_contiguous:
                return "Fortran order lost"
        return None
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return f"got {type(b).__name__!r}, not a dict with keys {sorted(a)!r}"
        for key in a:
            problem = same(a[key], b[key])
            if problem:
                return f"[{key!r}]: {problem}"
        return None
    if isinstance(a, (list, tuple)):
        if type(b) is not type(a) or len(b) != len(a):
            return f"got {type(b).__name__}, not a {type(a).__name__} of {len(a)}"
        for i in range(len(a)):  # (no zip(strict=...): this module runs on Python 3.8 too)
            problem = same(a[i], b[i])
            if problem:
                return f"[{i}]: {problem}"
        return None
    if isinstance(a, np.generic):
        if type(b) is not type(a) or b.dtype != a.dtype or b.tobytes() != a.tobytes():
            return f"got {type(b).__name__} {b!r}, not {type(a).__name__} {a!r}"
        return None
    if isinstance(a, Holder):
        if not isinstance(b, Holder):
            return f"got a {type(b).__name__}, not a Holder"
        return same(a.image, b.image) or same(a.extras, b.extras)
    return None if a == b else f"got {b!r}, not {a!r}"


def mismatches(received: dict[str, Any], which: str = "cases") -> list[str]:
    """What differs between ``received`` and the same arrays built by this side's numpy."""
    expected = built(which)
    out = []
    for name in expected:
        problem = same(expected[name], received.get(name))
        if problem:
            out.append(f"{name}: {problem}")
    if which == "containers":
        obj = received["object"]
        if obj.extras[1] is not received["list"][2] or received["tuple"][0] is not obj.extras[1]:
            out.append("an array met twice arrived as two objects")
    return out


def echo(value: Any) -> Any:
    return value


def built(which: str = "cases") -> dict[str, Any]:
    """This side's arrays (``which``: cases, containers or scalars), as a return value."""
    return {"cases": cases, "containers": containers, "scalars": scalars}[which]()


def strings() -> Any:
    """An array of numpy 2's StringDType (numpy 2 only)."""
    return np.array(["a", "bb"], dtype=np.dtypes.StringDType())


def with_code() -> Any:
    """A result the C pickler refuses (a lambda): it goes back through cloudpickle."""
    arrays = cases()
    return (lambda: 42), arrays["fortran"], arrays["large"]

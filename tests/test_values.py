"""``_values.value``: the frozen, slotted value classes of the lifecycle (pure logic).

They replace ``@dataclass(frozen=True, slots=True)`` (for import time, issue 16), so these tests
hold the behaviour the lifecycle relied on: construction by position and name with defaults,
equality and hashing by fields, a readable repr, immutability, and copy/pickle round trips.
"""

from __future__ import annotations

import copy
import pickle

import pytest

from comfy_env import _lifecycle as lc
from comfy_env._values import FrozenValueError, value


@value
class Point:
    """A point."""

    x: int
    y: int = 0
    label: str | None = None


@value
class Tagged(Point):
    """A point with a tag: a value class derived from a value class."""

    tag: str = ""


@value
class Other:
    x: int
    y: int = 0
    label: str | None = None


def test_construction_by_position_name_and_default() -> None:
    assert (Point(1).x, Point(1).y, Point(1).label) == (1, 0, None)
    p = Point(1, label="a", y=2)
    assert (p.x, p.y, p.label) == (1, 2, "a")
    with pytest.raises(TypeError):
        Point()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Point(1, 2, "a", 4)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Point(1, z=3)  # type: ignore[call-arg]


def test_equality_and_hash_follow_the_fields_and_the_class() -> None:
    assert Point(1, 2) == Point(1, 2)
    assert Point(1, 2) != Point(1, 3)
    assert Point(1, 2) != Other(1, 2)  # same fields, another class
    assert Point(1, 2) != (1, 2, None)
    assert hash(Point(1, 2)) == hash(Point(1, 2))
    assert len({Point(1, 2), Point(1, 2), Point(2, 2)}) == 2


def test_repr_names_every_field() -> None:
    assert repr(Point(1, label="a")) == "Point(x=1, y=0, label='a')"
    assert repr(lc.Idle(3, 42, 1.5)) == "Idle(generation=3, pid=42, idle_since=1.5)"


def test_frozen_slotted_and_documented() -> None:
    p = Point(1)
    with pytest.raises(FrozenValueError, match="cannot assign to field 'x' of Point"):
        p.x = 2  # type: ignore[misc]
    with pytest.raises(FrozenValueError):
        p.other = 2  # type: ignore[attr-defined]
    with pytest.raises(FrozenValueError):
        del p.y  # type: ignore[misc]
    assert isinstance(FrozenValueError("x"), AttributeError)
    assert not hasattr(p, "__dict__")
    assert Point.__slots__ == ("x", "y", "label")  # type: ignore[attr-defined]
    assert Point.__match_args__ == ("x", "y", "label")
    assert Point.__doc__ == "A point."
    assert Point.__qualname__ == "Point" and Point.__module__ == __name__


def test_copy_and_pickle_rebuild_equal_values() -> None:
    death = lc.Death(1.0, 2.0, 3, lc.RetireReason.CRASHED, None, "SIGSEGV", "tail")
    abandoned = lc.EnvAbandoned((death,), 4.0)
    for original in (Point(1, 2, "a"), death, abandoned, lc.Transition(lc.Starting(1))):
        for clone in (
            copy.copy(original),
            copy.deepcopy(original),
            pickle.loads(pickle.dumps(original)),
        ):
            assert clone == original and type(clone) is type(original)


def test_bad_declarations_are_refused() -> None:
    with pytest.raises(TypeError, match="without a default follows one"):

        @value
        class Bad:
            a: int = 0
            b: int

    class Base:
        pass

    with pytest.raises(TypeError, match="cannot have base classes"):

        @value
        class Derived(Base):
            a: int


def test_a_value_class_derives_from_one_value_class_whose_fields_come_first() -> None:
    from comfy_env._values import as_dict, fields, replace

    t = Tagged(1, 2, "a", "t")
    assert (t.x, t.y, t.label, t.tag) == (1, 2, "a", "t") and isinstance(t, Point)
    assert fields(Tagged) == Tagged.__match_args__ == ("x", "y", "label", "tag")
    assert Tagged(1, tag="t") == Tagged(1, 0, None, "t") and Tagged(1) != Point(1)
    assert repr(t) == "Tagged(x=1, y=2, label='a', tag='t')" and not hasattr(t, "__dict__")
    assert pickle.loads(pickle.dumps(t)) == t == copy.deepcopy(t)
    assert hash(t) == hash(copy.copy(t))
    assert replace(t, x=5, tag="u") == Tagged(5, 2, "a", "u")
    assert as_dict(t) == {"x": 1, "y": 2, "label": "a", "tag": "t"}
    with pytest.raises(FrozenValueError, match="cannot assign to field 'x' of Tagged"):
        t.x = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="without a default follows one"):

        @value
        class Bad(Point):
            z: int

    with pytest.raises(TypeError, match="is its base's already"):

        @value
        class Again(Point):
            x: int = 0


def test_replace_and_as_dict_do_what_the_dataclasses_helpers_did() -> None:
    from comfy_env._values import as_dict, replace

    p = Point(1, 2, "a")
    q = replace(p, y=5)
    assert q == Point(1, 5, "a") and p == Point(1, 2, "a")
    with pytest.raises(TypeError, match="has no field 'z'"):
        replace(p, z=1)
    death = lc.Death(1.0, 2.0, 3, lc.RetireReason.CRASHED, None, "SIGSEGV", "tail")
    assert as_dict(lc.EnvAbandoned((death,), 4.0)) == {
        "deaths": (
            {
                "at": 1.0,
                "when": 2.0,
                "generation": 3,
                "reason": lc.RetireReason.CRASHED,
                "exitcode": None,
                "signal": "SIGSEGV",
                "stderr_tail": "tail",
            },
        ),
        "at": 4.0,
        "until": None,
    }
    assert as_dict({"k": [Point(1)]}) == {"k": [{"x": 1, "y": 0, "label": None}]}


def test_methods_of_the_class_body_are_kept_and_classvars_refused() -> None:
    from typing import ClassVar

    @value
    class Named:
        name: str

        def __repr__(self) -> str:
            return f"<{self.name}>"

        @property
        def shout(self) -> str:
            return self.name.upper()

    assert repr(Named("a")) == "<a>" and Named("a").shout == "A"
    assert Named("a") == Named("a")
    with pytest.raises(TypeError, match="ClassVar"):

        @value
        class WithClassVar:
            limit: ClassVar[int] = 3
            x: int

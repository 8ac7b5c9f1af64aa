"""Frozen value classes, built without the ``dataclasses`` module.

Why this exists: the lifecycle's states, events and effects are 26 small immutable values, and
``@dataclass(frozen=True, slots=True)`` cost about 0.6 ms a class at import (each generated
method compiled on its own, the slotted class built twice, string annotations parsed), 18 ms in
all, plus 7 ms for importing ``dataclasses`` itself (``inspect``, ``ast``, ``dis``): on the
path of every fresh host's first call (issue 16: a fresh host's first call, import included,
within 3x a hand-written minimal host and worker).

``value`` gives a class what those values need, and nothing else:

* ``__slots__`` named after the annotated fields, in order (no ``__dict__``);
* an ``__init__`` taking the fields positionally or by name, with the class-level defaults;
  it stores through the slots' own descriptors (one compiled function per class), so it is
  also cheaper per instance than the generated dataclass one (every call builds several);
* frozen: assigning or deleting a field raises ``FrozenValueError`` (an ``AttributeError``);
* ``__eq__`` (same class, equal fields), ``__hash__`` (of the fields), ``__repr__``
  (``Name(field=value, ...)``), ``__match_args__``, and ``__reduce__`` so ``copy`` and
  ``pickle`` rebuild a value through its ``__init__`` (a frozen slotted class has no other way
  to set its fields on load); a method the class body defines itself is kept;
* ``replace`` and ``as_dict`` here do what ``dataclasses.replace``/``asdict`` did.

Every annotation is a field (a ``ClassVar`` is refused). A value class may derive from one
other value class, as a dataclass from a dataclass: the base's fields come first, then its
own (``_stats.CallCounts``: the call counters of ``EnvStats`` and ``EnvStatus``, declared once);
no other base classes.

Type checkers see a frozen dataclass (``dataclass_transform``); at run time the decorator is a
plain function, so a compiled build (mypyc) leaves these classes interpreted, as it must: a
native frozen class could not be pickled.
"""

from __future__ import annotations

import operator

# Not ``typing.TYPE_CHECKING``: ``comfy-env status`` loads this module, and typing is a large
# import that nothing here needs at run time (the names below are for the checker).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    from typing_extensions import dataclass_transform

    _T = TypeVar("_T")
else:

    def dataclass_transform(**_: Any) -> Callable[[Any], Any]:
        return lambda decorator: decorator


# The class attribute naming a value class's fields, in order (``replace``, ``as_dict``).
VALUE_FIELDS = "__value_fields__"
# The class attribute holding the defaults of a value class's fields (for a derived class).
VALUE_DEFAULTS = "__value_defaults__"


class FrozenValueError(AttributeError):
    """A field of a frozen value was assigned or deleted."""


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise FrozenValueError(f"cannot assign to field {name!r} of {type(self).__name__}")


def _frozen_delattr(self: Any, name: str) -> None:
    raise FrozenValueError(f"cannot delete field {name!r} of {type(self).__name__}")


def _fields_of(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    if not names:
        return lambda _self: ()
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda self: (one(self),)
    return operator.attrgetter(*names)


@dataclass_transform(frozen_default=True)
def value(cls: type[_T]) -> type[_T]:
    """Make ``cls`` (a class of annotated fields, deriving from nothing or from one value
    class) a frozen, slotted value class."""
    bases: tuple[type, ...] = cls.__bases__
    inherited: tuple[str, ...] = ()
    defaults: dict[str, Any] = {}
    if bases == (object,):
        bases = ()
    elif len(bases) == 1 and VALUE_FIELDS in bases[0].__dict__:  # (``value`` made the base)
        inherited = bases[0].__dict__[VALUE_FIELDS]
        defaults = dict(bases[0].__dict__[VALUE_DEFAULTS])
    else:
        raise TypeError(
            f"{cls.__qualname__}: a value class cannot have base classes other than one value class"
        )
    namespace = dict(cls.__dict__)
    annotations = namespace.get("__annotations__", {})
    own = tuple(annotations)
    for name, annotation in annotations.items():
        if "ClassVar" in str(annotation):  # every annotation is a field here
            raise TypeError(f"{cls.__qualname__}: {name!r} is a ClassVar; value classes have none")
        if name in inherited:
            raise TypeError(f"{cls.__qualname__}: field {name!r} is its base's already")
    names = inherited + own
    defaults.update({name: namespace.pop(name) for name in own if name in namespace})
    namespace.pop("__dict__", None)
    namespace.pop("__weakref__", None)
    namespace["__slots__"] = own  # (the base's fields are the base's slots)
    namespace["__match_args__"] = names
    namespace[VALUE_FIELDS] = names
    namespace[VALUE_DEFAULTS] = defaults
    built: Any = type(cls.__name__, bases, namespace)

    # __init__: one compiled function per class, storing through the slot descriptors.
    scope: dict[str, Any] = {}
    params = []
    for name in names:
        scope[f"_set_{name}"] = getattr(built, name).__set__
        if name in defaults:
            scope[f"_default_{name}"] = defaults[name]
            params.append(f"{name}=_default_{name}")
        elif params and "=" in params[-1]:
            raise TypeError(f"{cls.__qualname__}: field {name!r} without a default follows one")
        else:
            params.append(name)
    body = "".join(f"    _set_{name}(self, {name})\n" for name in names) or "    pass\n"
    exec(f"def __init__(self, {', '.join(params)}):\n{body}", scope)
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    built.__init__ = init

    fields_of = _fields_of(names)

    def __eq__(self: Any, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return bool(fields_of(self) == fields_of(other))

    def __hash__(self: Any) -> int:
        return hash(fields_of(self))

    def __repr__(self: Any) -> str:
        shown = ", ".join(f"{n}={v!r}" for n, v in zip(names, fields_of(self), strict=True))
        return f"{cls.__qualname__}({shown})"

    def __reduce__(self: Any) -> tuple[Any, tuple[Any, ...]]:
        return built, fields_of(self)

    # What the class body defines itself is kept (as dataclasses keep an own __repr__/__eq__).
    for method in (__eq__, __hash__, __repr__, __reduce__):
        if method.__name__ not in namespace:
            setattr(built, method.__name__, method)
    built.__setattr__ = _frozen_setattr
    built.__delattr__ = _frozen_delattr
    built.__qualname__ = cls.__qualname__
    built.__module__ = cls.__module__
    return built  # type: ignore[no-any-return]


def fields(cls: type[Any]) -> tuple[str, ...]:
    """The names of the value class ``cls``'s fields, in order (``dataclasses.fields``)."""
    names: tuple[str, ...] = getattr(cls, VALUE_FIELDS)
    return names


def replace(obj: _T, **changes: Any) -> _T:
    """A copy of the value ``obj`` with ``changes`` applied (``dataclasses.replace``)."""
    names: tuple[str, ...] = getattr(type(obj), VALUE_FIELDS)
    unknown = set(changes) - set(names)
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {sorted(unknown)[0]!r}")
    return type(obj)(**{name: changes.get(name, getattr(obj, name)) for name in names})


def as_dict(obj: Any) -> Any:
    """``obj`` as plain data (``dataclasses.asdict``): value classes become dicts of their
    fields, recursively, through tuples, lists and dicts."""
    names = getattr(type(obj), VALUE_FIELDS, None)
    if names is not None:
        return {name: as_dict(getattr(obj, name)) for name in names}
    if type(obj) in (tuple, list):
        return type(obj)(as_dict(item) for item in obj)
    if type(obj) is dict:
        return {as_dict(key): as_dict(item) for key, item in obj.items()}
    return obj

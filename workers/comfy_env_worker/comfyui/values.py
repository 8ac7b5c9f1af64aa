"""How node inputs and outputs cross between ComfyUI and a pack's env.

The library moves large numpy arrays out of band at any depth, but torch tensors only when they
are an argument or sit directly in one. Node values nest (a LATENT is ``{"samples": t, ...}``, a
list input is a list of IMAGEs), so both sides *flatten*: ``split`` replaces every tensor or array
in a value with a ``TensorSlot(i)`` and returns the tensors as one flat list (each one an item of
a list argument, hence always out of band); ``join`` puts them back. Array-likes are converted on
the receiving side only:

- in the env: to torch tensors when the env has torch (``torch.from_numpy``, no copy), else kept
  as numpy arrays;
- in the host (ComfyUI): to torch tensors, always (``torch.from_numpy`` over the host's private
  copy of the reply, no second copy).

So IMAGE ``[B,H,W,C]`` float32, MASK ``[B,H,W]`` and LATENT ``{"samples": [B,C,H,W]}`` keep their
dtype, shape and values exactly. Stdlib only; numpy and torch are imported lazily, and only when a
value holds one.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple


class TensorSlot:
    """Marks where the ``index``-th flattened tensor goes back."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> Any:
        return (TensorSlot, (self.index,))

    def __repr__(self) -> str:
        return "TensorSlot(%d)" % self.index


def is_tensor(value: Any) -> bool:
    kind = type(value)
    module = kind.__module__
    if module.startswith("torch") and kind.__name__ in ("Tensor", "Parameter"):
        return True
    return module == "numpy" and kind.__name__ == "ndarray"


def split(value: Any, prepare: Callable[[Any], Any]) -> Tuple[Any, List[Any]]:
    """``value`` with every tensor replaced by a ``TensorSlot``, and the tensors (passed through
    ``prepare``) in slot order."""
    found: List[Any] = []
    return _split(value, prepare, found), found


# Module-level recursion, not a nested function: a nested recursive function is a reference
# cycle (function -> closure cell -> function) that would keep the tensors alive until the next
# garbage collection, and the worker would then report a received argument as retained (so the
# host could never reuse that shared-memory block).
def _split(v: Any, prepare: Callable[[Any], Any], found: List[Any]) -> Any:
    if is_tensor(v):
        found.append(prepare(v))
        return TensorSlot(len(found) - 1)
    kind = type(v)
    if kind is list:
        return [_split(x, prepare, found) for x in v]
    if kind is tuple:
        return tuple(_split(x, prepare, found) for x in v)
    if kind is dict:
        return {k: _split(x, prepare, found) for k, x in v.items()}
    return v


def join(value: Any, tensors: List[Any], convert: Callable[[Any], Any]) -> Any:
    """Inverse of ``split``: slots replaced by ``convert(tensor)``."""
    if isinstance(value, TensorSlot):
        return convert(tensors[value.index])
    kind = type(value)
    if kind is list:
        return [join(x, tensors, convert) for x in value]
    if kind is tuple:
        return tuple(join(x, tensors, convert) for x in value)
    if kind is dict:
        return {k: join(x, tensors, convert) for k, x in value.items()}
    return value


def replace(value: Any, swap: Callable[[Any], Any]) -> Any:
    """``value`` with every item for which ``swap`` returns something else replaced by it, in
    lists, tuples and dicts at any depth (``swap`` returns its argument to keep it)."""
    swapped = swap(value)
    if swapped is not value:
        return swapped
    kind = type(value)
    if kind is list:
        return [replace(x, swap) for x in value]
    if kind is tuple:
        return tuple(replace(x, swap) for x in value)
    if kind is dict:
        return {k: replace(x, swap) for k, x in value.items()}
    return value


_HAS_TORCH: List[bool] = []


def env_has_torch() -> bool:
    """Whether this interpreter can import torch (looked up once: a lookup scans sys.path)."""
    if not _HAS_TORCH:
        import importlib.util

        _HAS_TORCH.append(importlib.util.find_spec("torch") is not None)
    return _HAS_TORCH[0]


def to_env_tensor(value: Any) -> Any:
    """In the env: numpy arrays become torch tensors where torch is installed (no copy)."""
    if type(value).__module__ == "numpy" and env_has_torch():
        import torch

        return torch.from_numpy(value)
    return value


def to_wire(value: Any) -> Any:
    """A tensor ready to send: CPU, contiguous, detached, outside inference mode's restrictions.

    A tensor made under ``torch.inference_mode()`` is read here through a plain view; numpy
    arrays pass unchanged (made contiguous)."""
    if type(value).__module__ == "numpy":
        if value.flags.c_contiguous:
            # The same object, not a new view: a new view of a received argument would count
            # as the argument's memory being retained, and the host would stop reusing it.
            return value
        import numpy

        return numpy.ascontiguousarray(value)
    if value.device.type == "cpu" and not value.requires_grad and value.is_contiguous():
        return value  # the same object (see above)
    tensor = value.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor

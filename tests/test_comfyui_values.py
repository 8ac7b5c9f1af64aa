"""How node values are flattened for the wire (pure logic, no processes)."""

from __future__ import annotations

import numpy as np

from comfy_env.comfyui._proxy import NodeInfo
from comfy_env_worker.comfyui import values


def test_split_and_join_round_trip_nested_node_values_keeping_every_array() -> None:
    image = np.ones((1, 4, 4, 3), np.float32)
    samples = np.zeros((1, 4, 2, 2), np.float32)
    value = {
        "image": image,
        "latent": {"samples": samples, "batch_index": [0]},
        "list": [image, ("x", 1.5)],
        "text": "keep",
    }
    skeleton, tensors = values.split(value, lambda a: a)
    assert [t is image for t in tensors] == [True, False, True]
    assert tensors[1] is samples
    assert isinstance(skeleton["image"], values.TensorSlot)
    assert skeleton["latent"]["batch_index"] == [0] and skeleton["text"] == "keep"
    back = values.join(skeleton, tensors, lambda a: a)
    assert back["image"] is image and back["latent"]["samples"] is samples
    assert back["list"][0] is image and back["list"][1] == ("x", 1.5)


def test_to_wire_keeps_contiguous_arrays_as_the_same_object_and_copies_strided_ones() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert values.to_wire(a) is a  # a new view would make a received argument look retained
    strided = a[:, ::2]
    wired = values.to_wire(strided)
    assert wired.flags.c_contiguous and np.array_equal(wired, strided)


def test_replace_swaps_only_what_the_function_changes() -> None:
    marker = object()
    out = values.replace({"a": [1, marker], "b": (marker,)}, lambda v: 7 if v is marker else v)
    assert out == {"a": [1, 7], "b": (7,)}


class _Ref:
    def __init__(self, alive: bool) -> None:
        self.alive = alive


def test_the_liveness_token_is_stable_while_the_run_lives_and_fresh_once_it_is_gone() -> None:
    class _Spec:
        pack_dir, module = "/p", "m"

    class _Pack:
        spec = _Spec()

    node = NodeInfo(_Pack(), {"name": "N"}, "v1")  # type: ignore[arg-type]
    first = node.liveness_token("5")
    ref = _Ref(alive=True)
    node.record_run("5", ref)  # type: ignore[arg-type]
    assert node.liveness_token("5") == first  # ComfyUI's cached outputs stay usable
    ref.alive = False
    stale = node.liveness_token("5")
    assert stale != first  # the cache entry misses: the producer runs again
    node.record_run("5", _Ref(alive=True))  # type: ignore[arg-type]
    assert node.liveness_token("5") == stale  # and its new outputs are cached under it
    assert node.liveness_token("6") not in (first, stale)  # another node id

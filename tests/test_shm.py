"""Shared-memory transport: out-of-band buffers, consumed-ack pinning, TTL, sweep, forgery."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import TESTS_DIR, alive, private_shm_mount_usable, stop_consumed_acks
from conftest import run_host as _run_host
from conftest import wait_until as _wait
from tasks import remote as remote_tasks

import comfy_env
from comfy_env import HostResourceError, ProtocolError, WorkerCrashed

MiB = 1024 * 1024


def _worker_shm(w: comfy_env.Worker) -> dict[str, int]:
    return w.call("comfy_env_worker.tasks:shm_stats")  # type: ignore[no-any-return]


def _is_loan(base: object) -> bool:
    """A view of a loan root: shared memory lent to the result, not a private copy."""
    import ctypes

    return isinstance(base, memoryview) and isinstance(base.obj, ctypes.Array)


def _owner_block(arr: np.ndarray) -> object:
    """The end of ``arr``'s ``base`` chain: what owns its memory (numpy views of views)."""
    base = arr
    while getattr(base, "base", None) is not None:
        base = base.base
    return base


def _host_process(w: comfy_env.Worker):  # type: ignore[no-untyped-def]
    process = w._entry.slots[0].process
    assert process is not None
    return process


ARRAYS = {
    "float32": np.arange(600_000, dtype=np.float32),
    "int64-2d": np.arange(400_000, dtype=np.int64).reshape(800, 500),
    "uint8-3d": (np.arange(2 * MiB, dtype=np.uint64) % 251).astype(np.uint8).reshape(64, 64, -1),
    "fortran": np.asfortranarray(np.arange(600_000, dtype=np.float64).reshape(600, 1000)),
    "complex": (np.arange(200_000) * (1 + 2j)).astype(np.complex128),
    "bool": np.arange(3 * MiB) % 3 == 0,
    "non-contiguous": np.arange(1_000_000, dtype=np.float64)[::3],
    "0-d": np.array(3.5),
    "small": np.arange(10, dtype=np.int16),
    "structured": np.zeros(100_000, dtype=[("x", "<f8"), ("y", "<i4")]),
}


@pytest.mark.parametrize("name", list(ARRAYS))
def test_arrays_round_trip_both_directions(pool: comfy_env.Pool, name: str) -> None:
    arr = ARRAYS[name]
    out = pool.get_worker().call("comfy_env_worker.tasks:echo", arr)
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert np.array_equal(out, arr)
    assert out.flags.writeable


def _every_kind_of_array(n: int) -> dict[str, np.ndarray]:
    """One array of each kind with ``n`` elements (or rows): what a pickle round trip keeps."""
    base = np.arange(4 * n, dtype=np.float64)
    read_only = np.arange(n, dtype=np.float32)
    read_only.flags.writeable = False
    arrays = {
        f"dtype {code}": (np.arange(n) % 100).astype(code) for code in ("i1", "u8", "f2", "c16")
    }
    arrays.update(
        {
            "bool": np.arange(n) % 3 == 0,
            "datetime64": np.arange(n).astype("M8[ns]"),
            "timedelta64": np.arange(n).astype("m8[s]"),
            "big-endian": np.arange(n, dtype=">i4"),
            "bytes S": np.array([b"ab%d" % (i % 100) for i in range(n)], dtype="S7"),
            "str U": np.array([f"x{i % 100}" for i in range(n)], dtype="U5"),
            "structured": np.zeros(n, dtype=[("x", "<f8"), ("y", ">i4"), ("s", "S3")]),
            "record": np.rec.array(np.zeros(n, dtype=[("x", "<f8"), ("y", "<i4")])),
            "object": np.array([i if i % 2 else str(i) for i in range(min(n, 2000))], object),
            "0-d": np.array(3.5),
            "empty (0, 5)": np.zeros((0, 5)),
            "zero-size dtype, 2**40 elements": np.empty(2**40, dtype=np.dtype([])),
            "strided": base[::3],
            "transpose": base.reshape(-1, 4).T,
            "negative strides": base[::-1],
            "fortran": np.asfortranarray(base.reshape(-1, 4)),
            "broadcast": np.broadcast_to(np.arange(4.0), (n, 4)),
            "view of a bigger array": base[n : 2 * n],
            "read-only": read_only,
            "over bytes": np.frombuffer(bytes(4 * n), dtype=np.float32),
            "masked": np.ma.masked_array(np.arange(n, dtype=np.float64), mask=np.arange(n) % 2),
            "matrix": np.asmatrix(base.reshape(-1, 4)),
        }
    )
    return arrays


def _same_as_pickled(out: np.ndarray, ref: np.ndarray) -> bool:
    flags = ("c_contiguous", "f_contiguous", "writeable")
    return (
        type(out) is type(ref)
        and (out.dtype, out.shape, out.strides) == (ref.dtype, ref.shape, ref.strides)
        and all(getattr(out.flags, f) == getattr(ref.flags, f) for f in flags)
        and (
            out.tolist() == ref.tolist() if ref.dtype.hasobject else out.tobytes() == ref.tobytes()
        )
        and (
            not isinstance(ref, np.ma.MaskedArray)
            or np.array_equal(np.ma.getmaskarray(out), np.ma.getmaskarray(ref))
        )
    )


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize(
    "update",
    [{}, {"shared_memory": False}, {"shared_memory": False, "shm_threshold_bytes": 4096}],
    ids=["shared-memory", "inline", "inline-4k-threshold"],
)
def test_every_kind_of_array_arrives_as_a_pickle_round_trip_gives_it(
    config: comfy_env.PoolConfig, update: dict[str, object]
) -> None:
    import asyncio
    import pickle

    with comfy_env.Pool(config.model_copy(update=update)) as pool:
        w = pool.get_worker()
        for n in (50, 1000, 300_000):  # in band; out of band at 4 KiB; in shared memory
            for name, arr in _every_kind_of_array(n).items():
                ref = pickle.loads(pickle.dumps(arr, protocol=5))
                out = w.call("comfy_env_worker.tasks:echo", arr)
                assert _same_as_pickled(out, ref), (n, name, "call")
                out = asyncio.run(w.acall("comfy_env_worker.tasks:echo", arr))
                assert _same_as_pickled(out, ref), (n, name, "acall")


@pytest.mark.parametrize(
    "value",
    [b"\x01" * (3 * MiB), bytearray(b"\x02" * (3 * MiB)), [b"\x03" * (2 * MiB), 7]],
    ids=["bytes", "bytearray", "bytes-in-list"],
)
def test_bytes_like_round_trip(pool: comfy_env.Pool, value: object) -> None:
    out = pool.get_worker().call("comfy_env_worker.tasks:echo", value)
    assert out == value and type(out) is type(value)


def test_memoryview_arrives_as_an_equal_memoryview(pool: comfy_env.Pool) -> None:
    data = bytes(range(256)) * (8 * 4096)
    out = pool.get_worker().call("comfy_env_worker.tasks:echo", memoryview(data))
    assert isinstance(out, memoryview) and out.tobytes() == data


@pytest.mark.parametrize("size", [4096, 2 * MiB], ids=["small", "large"])
def test_a_memoryview_keeps_its_format_shape_order_and_writability(
    pool: comfy_env.Pool, size: int
) -> None:
    # Pickle refuses memoryviews: a small one went through cloudpickle and came back as
    # bytes (and only to a worker on the host's Python), a large one as flat bytes in the
    # *memory* order, so a Fortran-ordered view came back scrambled.
    w = pool.get_worker()
    grid = np.arange(size // 8, dtype=np.float64).reshape(-1, 4)
    views = {
        "2-d": memoryview(grid),
        "fortran": memoryview(np.asfortranarray(grid)),
        "strided": memoryview(grid)[::2],
        "read-only": memoryview(grid.tobytes()),
        "ints": memoryview(bytearray(size)).cast("i"),
    }
    for name, view in views.items():
        for out in (
            w.call("comfy_env_worker.tasks:echo", view),
            w.call(lambda v: v, view),  # by value: cloudpickle's own path
        ):
            assert isinstance(out, memoryview), name
            assert (out.format, out.shape, out.readonly) == (
                view.format,
                view.shape,
                view.readonly,
            ), name
            assert out.tolist() == view.tolist(), name


def test_an_object_met_twice_in_one_call_arrives_as_one_object(pool: comfy_env.Pool) -> None:
    # As pickle's memo keeps it: a large bytes object passed twice travels once and arrives
    # as one object, a list passed twice stays one list, a dict that holds itself still does.
    w = pool.get_worker()
    big = bytes(range(256)) * (8 * 1024)
    shared = [big]
    looped: dict[str, object] = {"data": big}
    looped["self"] = looped
    from comfy_env._codec import encode_call

    _, buffers, _ = encode_call(remote_tasks.identities, (big, big, shared, shared, looped), {})
    assert [b.nbytes for b in buffers] == [len(big)]  # out of band, once
    seen, (a, b, c, d, e) = w.call(remote_tasks.identities, big, big, shared, shared, looped)
    assert seen == (True, True, True, True)  # in the worker
    assert a is b and c is d and c[0] is a and e["self"] is e and e["data"] is a  # back here
    assert a == big


def test_large_buffers_travel_through_shared_memory(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    arr = np.ones(4 * MiB, dtype=np.uint8)
    assert w.call(remote_tasks.buffer_owner, arr) == "mmap"  # a zero-copy view of our block
    small = np.ones(1000, dtype=np.uint8)
    assert w.call(remote_tasks.buffer_owner, small) != "mmap"  # below the threshold: in band
    stats = _worker_shm(w)
    assert stats["blocks"] >= 1  # its reply blocks (the canary's among them)


def test_what_the_caller_keeps_never_aliases_reused_memory(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    first = w.call(remote_tasks.filled, 1.0, 2 * MiB)
    second = w.call(remote_tasks.filled, 2.0, 2 * MiB)  # the worker reuses its reply block
    # Had `first` been a view of the worker's reply block, the second reply (same size class,
    # so the same reused block) would have overwritten it.
    assert float(first.sum()) == 2 * MiB * 1.0
    assert float(second.sum()) == 2 * MiB * 2.0
    first[:] = 5.0  # private and writable
    assert float(w.call(remote_tasks.filled, 3.0, 2 * MiB).sum()) == 2 * MiB * 3.0


def test_a_block_the_worker_keeps_is_never_reused_by_the_host(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    ones = np.ones(2 * MiB, dtype=np.float32)
    index = w.call(remote_tasks.keep, ones) - 1  # the worker stores a view of our block
    twos = np.full(2 * MiB, 2.0, dtype=np.float32)
    w.call("comfy_env_worker.tasks:echo", twos)  # same size class: would reuse that block
    assert w.call(remote_tasks.kept_sum, index) == float(2 * MiB)


@pytest.mark.parametrize("how", ["raise", "too-big"])
@pytest.mark.parametrize("path", ["call", "acall"])
def test_a_block_the_worker_keeps_is_never_reused_when_the_call_then_fails(
    config: comfy_env.PoolConfig, how: str, path: str
) -> None:
    # The function caches its argument (a view of our block), then raises or returns what
    # cannot be sent: the error reply must still say the block was kept, or our next
    # request is written into memory the worker's cache shows.
    import asyncio

    with comfy_env.Pool(config.model_copy(update={"max_frame_bytes": MiB})) as pool:
        w = pool.get_worker()
        ones = np.ones(2 * MiB // 8, dtype=np.float64)
        expected = ValueError if how == "raise" else OverflowError
        with pytest.raises(expected):
            if path == "call":
                w.call(remote_tasks.keep_then_fail, ones, how)
            else:
                asyncio.run(w.acall(remote_tasks.keep_then_fail, ones, how))
        index = w.call(remote_tasks.kept_count) - 1
        w.call("comfy_env_worker.tasks:echo", np.full(2 * MiB // 8, 2.0))  # same size class
        assert w.call(remote_tasks.kept_sum, index) == float(2 * MiB // 8)


@pytest.fixture
def copies_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copy every shared-memory reply out (no loans): the plain consumed-ack protocol."""
    import comfy_env._channel

    monkeypatch.setattr(comfy_env._channel, "LOAN_MIN", 1 << 40)


@pytest.mark.usefixtures("copies_for_all")
def test_the_consumed_ack_frees_pinned_reply_blocks_at_once(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    out = w.call(remote_tasks.filled, 1.0, MiB)  # copied out (copies_for_all)
    assert out.nbytes == 4 * MiB
    assert _worker_shm(w)["pinned"] == 0
    stop_consumed_acks(_host_process(w).channel)
    w.call(remote_tasks.filled, 1.0, MiB)
    assert _worker_shm(w)["pinned"] == 1  # no ack: the reply block stays pinned


@pytest.fixture
def loans_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lend every shared-memory reply, however small (the tests' buffers are a few MiB)."""
    import comfy_env._channel

    monkeypatch.setattr(comfy_env._channel, "LOAN_MIN", 0)


@pytest.mark.usefixtures("loans_for_all")
def test_the_consumed_ack_frees_a_loaned_block_once_its_result_is_gone(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    out = w.call(remote_tasks.filled, 1.0, MiB)
    assert _worker_shm(w)["pinned"] == 1  # the result is a view of the loaned reply block
    del out  # its last view: the next request carries the block back
    assert _worker_shm(w)["pinned"] == 0


@pytest.mark.usefixtures("loans_for_all")
def test_a_result_is_a_loaned_view_of_the_reply_block_with_no_copy(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    out = w.call(remote_tasks.filled, 2.0, 2 * MiB)
    assert _is_loan(_owner_block(out))
    assert out.flags.writeable
    out[:] = 7.0  # the block is the caller's until the result dies
    assert float(w.call(remote_tasks.filled, 3.0, 2 * MiB).sum()) == 2 * MiB * 3.0
    assert float(out.sum()) == 2 * MiB * 7.0


@pytest.mark.usefixtures("loans_for_all")
def test_a_loan_lasts_as_long_as_any_view_taken_from_the_result(pool: comfy_env.Pool) -> None:
    # Slices and casts of a memoryview hold the memory's exporter, not the view they came
    # from: a loan tied to anything but that exporter would end while these views still show
    # the block, and the worker would write its next reply into them.
    w = pool.get_worker()
    out = w.call(remote_tasks.filled, 1.0, MiB)
    raw = memoryview(out).cast("B")[8:40]
    sub = out[100:200]
    del out
    assert _worker_shm(w)["pinned"] == 1
    del sub
    assert _worker_shm(w)["pinned"] == 1  # ``raw`` still shows the block
    again = w.call(remote_tasks.filled, 2.0, MiB)  # the worker's next reply: another block
    assert np.frombuffer(raw, dtype=np.float32).tolist() == [1.0] * 8
    del raw, again
    assert _worker_shm(w)["pinned"] == 0


def test_an_echo_loan_lasts_as_long_as_any_view_taken_from_the_result(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    out = w.call("comfy_env_worker.tasks:echo", np.full(MiB, 1.0, dtype=np.float32))
    process = _host_process(w)
    raw = memoryview(out).cast("B")[:16]
    del out
    assert len(process.channel.loans._own_lent) == 1  # the argument block stays out of our pool
    later = w.call("comfy_env_worker.tasks:echo", np.full(MiB, 2.0, dtype=np.float32))
    assert np.frombuffer(raw, dtype=np.float32).tolist() == [1.0] * 4  # not overwritten
    del later
    del raw
    assert process.channel.loans._own_lent == {}


def test_a_lent_result_outlives_its_pool(config: comfy_env.PoolConfig) -> None:
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker()
        echoed = w.call("comfy_env_worker.tasks:echo", np.full(MiB, 3.0, dtype=np.float32))
        made = w.call(remote_tasks.filled, 4.0, 2 * MiB)
        assert _is_loan(_owner_block(echoed)) and _is_loan(_owner_block(made))
    # The pool unlinked every block and let its worker go; the results keep their memory.
    assert float(echoed.sum()) == 3.0 * MiB and float(made.max()) == 4.0
    echoed[:] = 0.0
    assert float(echoed.max()) == 0.0


@pytest.mark.usefixtures("loans_for_all")
def test_without_ctypes_a_fresh_mapping_stands_in_for_the_loan_root(
    pool: comfy_env.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    import comfy_env_worker.shm as wshm

    monkeypatch.setitem(sys.modules, "ctypes", None)  # ``import ctypes`` raises ImportError
    monkeypatch.setattr(wshm, "_root_types", {})
    # (The madvise lookup fails too and is cached as unavailable: restored for later tests.)
    monkeypatch.setattr(wshm, "_madvise", None)
    w = pool.get_worker()
    out = w.call(remote_tasks.filled, 1.0, MiB)
    echoed = w.call("comfy_env_worker.tasks:echo", np.full(MiB, 2.0, dtype=np.float32))
    for result in (out, echoed):
        base = _owner_block(result)
        assert isinstance(base, memoryview) and type(base.obj).__name__ == "mmap"
    raw = memoryview(out).cast("B")[:8]
    del out, echoed, result, base
    assert _worker_shm(w)["pinned"] == 1 and _host_process(w).channel.loans._own_lent == {}
    del raw
    assert _worker_shm(w)["pinned"] == 0


@pytest.mark.usefixtures("loans_for_all")
def test_kept_results_never_share_a_block_and_return_when_they_die(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    kept = [w.call(remote_tasks.filled, float(i), MiB) for i in range(5)]
    assert [float(k[0]) for k in kept] == [0.0, 1.0, 2.0, 3.0, 4.0]  # none was overwritten
    assert _worker_shm(w)["pinned"] == 5
    del kept[1:3]
    assert _worker_shm(w)["pinned"] == 3
    kept.clear()
    assert _worker_shm(w)["pinned"] == 0


@pytest.mark.usefixtures("loans_for_all")
def test_async_calls_give_loaned_blocks_back_too(pool: comfy_env.Pool) -> None:
    import asyncio
    import gc

    w = pool.get_worker()

    async def keep_then_count() -> int:
        out = await w.acall(remote_tasks.filled, 1.0, MiB)
        assert out.nbytes == 4 * MiB
        return (await w.acall("comfy_env_worker.tasks:shm_stats"))["pinned"]  # type: ignore[no-any-return]

    assert asyncio.run(keep_then_count()) == 1
    gc.collect()  # the finished loop's futures held the result until now
    stats = asyncio.run(w.acall("comfy_env_worker.tasks:shm_stats"))  # carries the return
    assert stats["pinned"] == 0


@pytest.mark.usefixtures("loans_for_all")
def test_beyond_the_loan_bound_results_are_private_copies(pool: comfy_env.Pool) -> None:
    from comfy_env._channel import MAX_LOANS

    w = pool.get_worker()
    kept = [w.call(remote_tasks.filled, 1.0, MiB // 4) for _ in range(MAX_LOANS + 3)]
    assert _worker_shm(w)["pinned"] == MAX_LOANS  # the copies' blocks went back at once
    assert not _is_loan(_owner_block(kept[-1]))
    kept.clear()
    assert _worker_shm(w)["pinned"] == 0


def test_an_echoed_array_comes_back_in_the_hosts_own_block_with_no_reply_block(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    before = _worker_shm(w)["blocks"]
    process = _host_process(w)
    arr = np.arange(2 * MiB, dtype=np.float32)
    out = w.call("comfy_env_worker.tasks:echo", arr)
    assert np.array_equal(out, arr) and out.flags.writeable
    assert _is_loan(_owner_block(out))  # a view of our block, not a copy
    stats = _worker_shm(w)
    assert (stats["blocks"], stats["pinned"]) == (before, 0)  # the worker made no reply block
    assert len(process.channel.loans._own_lent) == 1  # our argument block, lent to the result
    idle = process.blocks.idle_blocks
    del out  # its last view: the block goes back to our pool at once
    assert process.channel.loans._own_lent == {} and process.blocks.idle_blocks == idle + 1


def test_a_kept_echo_result_is_never_overwritten_by_a_later_request(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    kept = [w.call("comfy_env_worker.tasks:echo", np.full(MiB, float(i))) for i in range(4)]
    # Same size class every time: had a request reused a block a result still views, an
    # earlier result would show a later value.
    assert [float(k.min()) for k in kept] == [0.0, 1.0, 2.0, 3.0]
    assert [float(k.max()) for k in kept] == [0.0, 1.0, 2.0, 3.0]
    sliced = w.call("operator:getitem", np.arange(MiB, dtype=np.float64), slice(1000, None))
    assert np.array_equal(sliced, np.arange(1000, MiB, dtype=np.float64))  # at an offset
    kept.clear()
    del sliced
    assert _host_process(w).channel.loans._own_lent == {}


def test_a_result_the_function_also_keeps_is_a_copy_not_shared_with_its_cache(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    ones = np.ones(2 * MiB, dtype=np.float32)
    out = w.call(remote_tasks.keep_and_return, ones)  # returned and cached in the worker
    assert float(out.sum()) == float(2 * MiB)
    assert _host_process(w).channel.loans._own_lent == {}  # not a view of our block: a reply block
    out[:] = 5.0  # the caller's to change: the worker's cache must not see it
    assert w.call(remote_tasks.kept_sum, -1) == float(2 * MiB)
    w.call("comfy_env_worker.tasks:echo", np.full(2 * MiB, 2.0, dtype=np.float32))
    assert w.call(remote_tasks.kept_sum, -1) == float(2 * MiB)  # the block was given up
    assert float(out.max()) == 5.0


def test_kept_echo_results_get_a_spare_block_made_off_the_call_path(
    pool: comfy_env.Pool,
) -> None:
    import comfy_env_worker.shm as wshm

    w = pool.get_worker()
    n = wshm.SPARE_MIN_BYTES // 4
    first = w.call("comfy_env_worker.tasks:echo", np.ones(n, dtype=np.float32))
    process = _host_process(w)
    assert _wait(lambda: process.blocks.has_idle(wshm.SPARE_MIN_BYTES), 10.0)
    ready = set(process.blocks.live)
    second = w.call("comfy_env_worker.tasks:echo", np.full(n, 2.0, dtype=np.float32))
    assert (
        set(process.channel.loans._own_lent) <= ready
    )  # the request took the spare: no block made
    assert float(first.max()) == 1.0 and float(second.min()) == 2.0
    del first, second


@pytest.mark.usefixtures("loans_for_all")
def test_kept_small_results_get_spare_reply_blocks_from_the_second_call_on(
    pool: comfy_env.Pool,
) -> None:
    # 2 MiB results (a size class under SPARE_MIN_BYTES): a caller that keeps them needs a
    # fresh reply block every call; from the second one on, the worker faults in a spare
    # after replying, so the next call of that size takes it instead of making one.
    w = pool.get_worker()
    n = MiB // 2  # float32: 2 MiB
    base = _worker_shm(w)
    kept = [w.call(remote_tasks.filled, 1.0, n)]
    first = _worker_shm(w)
    assert (first["blocks"], first["idle_blocks"]) == (base["blocks"] + 1, base["idle_blocks"])
    kept.append(w.call(remote_tasks.filled, 2.0, n))  # a fresh block with the first pinned
    assert _wait(lambda: _worker_shm(w)["idle_blocks"] == base["idle_blocks"] + 1, 10.0)
    made = _worker_shm(w)["blocks"]
    kept.append(w.call(remote_tasks.filled, 3.0, n))  # takes the spare (and asks for another)
    assert _wait(lambda: _worker_shm(w)["idle_blocks"] == base["idle_blocks"] + 1, 10.0)
    assert _worker_shm(w)["blocks"] == made + 1  # the one spare made after the third reply
    assert [float(k[0]) for k in kept] == [1.0, 2.0, 3.0]
    kept.clear()


@pytest.mark.usefixtures("loans_for_all")
def test_dropped_results_and_the_canary_make_no_spare_blocks(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    after_canary = _worker_shm(w)
    for value in (1.0, 2.0, 3.0, 4.0):
        out = w.call(remote_tasks.filled, value, MiB // 2)
        assert float(out[0]) == value
        del out  # dropped: the next request returns its block
    time.sleep(0.2)  # a spare, had one been asked for, is made by now
    stats = _worker_shm(w)
    assert stats["blocks"] == after_canary["blocks"] + 1  # one 2 MiB block, reused throughout
    # The canary left its own block and no spare of its size.
    assert after_canary["blocks"] - after_canary["idle_blocks"] == 0
    assert after_canary["blocks"] <= 1


def test_kept_small_echo_results_get_spare_argument_blocks_from_the_second_call_on(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    n = MiB // 2  # float32: 2 MiB, a size class under SPARE_MIN_BYTES
    kept = [w.call("comfy_env_worker.tasks:echo", np.full(n, 1.0, dtype=np.float32))]
    process = _host_process(w)
    size = next(
        b.size for b in process.blocks.live.values() if b.name in process.channel.loans._own_lent
    )
    assert not process.blocks.has_idle(size)  # the first lent block: no spare asked for
    kept.append(w.call("comfy_env_worker.tasks:echo", np.full(n, 2.0, dtype=np.float32)))
    assert _wait(lambda: process.blocks.has_idle(size), 10.0)  # the second: a spare
    ready = set(process.blocks.live)
    kept.append(w.call("comfy_env_worker.tasks:echo", np.full(n, 3.0, dtype=np.float32)))
    assert set(process.channel.loans._own_lent) <= ready  # the third request took the spare
    assert [float(k.max()) for k in kept] == [1.0, 2.0, 3.0]
    kept.clear()


def test_a_spare_that_comes_too_late_stops_spares_of_its_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Calls that come back to back need a block before the spare is ready: the spare only
    # contends with the block the call makes itself. Once that happened for a small size, the
    # pool makes no more spares of it until a block of that size is given back (big sizes keep
    # theirs: a fresh one costs far more).
    import threading

    import comfy_env_worker.shm as wshm

    gate = threading.Event()
    monkeypatch.setattr(wshm, "prefault", lambda mm: gate.wait(10.0))
    pool = wshm.BlockPool(f"{wshm.NAME_PREFIX}late-{os.getpid()}-", 1 << 30)
    try:
        size = wshm.size_class(2 * MiB)
        held = [pool.acquire(size)]
        assert not pool.wants_spare(size)  # the first block of its size: no spare
        held.append(pool.acquire(size))
        assert pool.wants_spare(size)  # a second one in use, none idle: results kept
        maker = threading.Thread(target=pool.add_spare, args=(size,))
        maker.start()
        assert _wait(lambda: pool._making.get(size) == 1, 5.0)
        held.append(pool.acquire(size))  # needed now, while the spare is still being made
        assert not pool.wants_spare(size)
        gate.set()
        maker.join(10.0)
        assert pool.has_idle(size)  # the late spare is kept for whoever comes next
        held.append(pool.acquire(size))
        assert not pool.wants_spare(size)  # still too late: the caller keeps everything
        pool.release(held.pop(0))  # a result let go: another phase may want spares again
        held.append(pool.acquire(size))
        assert pool.wants_spare(size)
        big = wshm.SPARE_MIN_BYTES
        held.append(pool.acquire(big))
        assert pool.wants_spare(big)
    finally:
        gate.set()
        pool.destroy_all()


def test_a_large_write_faults_and_copies_a_block_in_steps_that_let_go_of_the_gil(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A big argument copied into a fresh block in one slice assignment held the GIL (and the
    # event loop of an acall) for the page faults and the copy: 45-270 ms at 64 MiB. Fresh
    # pages are now faulted in by madvise through ctypes (no GIL) in bounded steps (one
    # madvise over a whole block also held the process's memory-map lock, and so any thread
    # start, for all of it), and the copy goes through one ctypes.memmove (no GIL; in steps it
    # lost glibc's large-copy path: 1.6 memcpys at 256 MiB instead of 1.0).
    import ctypes

    import comfy_env_worker.shm as wshm

    pool = wshm.BlockPool(f"{wshm.NAME_PREFIX}steps-{os.getpid()}-", 1 << 30)
    try:
        probe = pool.acquire(MiB)
        wshm.prefault(probe.mm)  # looks libc's madvise up
        real_madvise = wshm._madvise
        if not callable(real_madvise):
            pytest.skip("no madvise through ctypes here")
        root = wshm.loan_root(probe.mm)
        populate = real_madvise(ctypes.addressof(root), MiB, wshm._MADV_POPULATE_WRITE)
        del root
        if populate != 0:
            pytest.skip("MADV_POPULATE_WRITE is not supported by this kernel")
        madvised: list[int] = []
        copied: list[int] = []
        real_memmove = ctypes.memmove

        def madvise(addr: int, n: int, advice: int) -> int:
            madvised.append(n)
            return int(real_madvise(addr, n, advice))

        def memmove(dst: int, src: int, n: int) -> int:
            copied.append(n)
            return int(real_memmove(dst, src, n))

        monkeypatch.setattr(wshm, "_madvise", madvise)
        monkeypatch.setattr(ctypes, "memmove", memmove)
        n = 40 * MiB
        data = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)
        block = pool.acquire(n)
        block.write(0, memoryview(data).cast("B"))
        assert sum(madvised) >= n and max(madvised) <= wshm._PREFAULT_STEP
        assert copied == [n]
        assert block.mm[:n] == data.tobytes() and block.faulted == n
        madvised.clear()
        block.write(0, memoryview(data).cast("B"))  # faulted in already: copied only
        assert madvised == []
        # A read-only source (bytes) cannot be addressed by ctypes: copied in steps as is.
        copied.clear()
        ro = bytes(range(256)) * (12 * MiB // 256)
        block.write(4 * MiB, memoryview(ro))
        assert copied == [] and block.mm[4 * MiB : 16 * MiB] == ro
        # A spare is faulted in in steps too.
        madvised.clear()
        spare = pool.acquire(64 * MiB)
        spare.prefault()
        assert sum(madvised) == 64 * MiB and max(madvised) <= wshm._PREFAULT_STEP
        assert spare.faulted == spare.size
    finally:
        pool.destroy_all()


def test_the_ttl_frees_blocks_the_host_never_acks(config: comfy_env.PoolConfig) -> None:
    with comfy_env.Pool(config.model_copy(update={"shm_pinned_ttl": 0.3})) as pool:
        w = pool.get_worker()
        w.call("comfy_env_worker.tasks:echo", 0)
        stop_consumed_acks(_host_process(w).channel)
        w.call(remote_tasks.filled, 1.0, MiB)
        w.call(remote_tasks.filled, 1.0, 2 * MiB)
        assert _worker_shm(w)["pinned"] == 2
        # No further call is needed: the worker's timer gives the blocks up on its own.
        time.sleep(1.5)
        stats = _worker_shm(w)
        assert stats["pinned"] == 0


_PAUSED_HOST = """
    import json, os, sys
    import comfy_env

    marker, tests = sys.argv[1], sys.argv[2]
    config = comfy_env.PoolConfig(shm_pinned_ttl=0.3, sys_path=(tests,))
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker()
        w.call("tasks.remote:add", 1)
        before = [w.pid, w.generation]
        out, error = None, None
        try:
            out = w.call("tasks.remote:filled_once_stopped", marker, os.getpid(), 2.0, 1 << 20)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        right = out is not None and out.shape == (1 << 20,) and bool((out == 2.0).all())
        del out
        again = w.call("tasks.remote:add", 2)
        report = {
            "before": before,
            "after": [w.pid, w.generation],
            "right": right,
            "error": error,
            "again": again,
            "spawns": pool.stats()[w.env].spawns,
            "restarts": pool.stats()[w.env].restarts_in_window,
        }
    print(json.dumps(report), flush=True)
"""


@pytest.mark.timeout(90)
def test_a_host_stopped_past_the_ttl_still_gets_its_reply(tmp_path: Path) -> None:
    # The host is stopped (SIGSTOP: Ctrl-Z, a debugger, a paused VM) before the worker sends
    # a shared-memory reply, and stays stopped for many times shm_pinned_ttl. The worker's TTL
    # counts only time the host runs: the block is still there when the host goes on.
    marker = tmp_path / "replying"
    host = _run_host(_PAUSED_HOST, str(marker), str(TESTS_DIR))
    try:
        assert _wait(marker.exists, 30.0), host.communicate(timeout=30)
        os.kill(host.pid, signal.SIGSTOP)
        worker_pid = int(marker.read_text())
        time.sleep(2.5)  # the TTL (0.3 s) many times over, and the watchdog's wake-ups (1 s)
        assert alive(worker_pid)
        os.kill(host.pid, signal.SIGCONT)
        out, err = host.communicate(timeout=60)
    finally:
        if host.poll() is None:
            os.kill(host.pid, signal.SIGCONT)
            host.kill()
            host.communicate(timeout=30)
    assert host.returncode == 0, err
    report = json.loads(out.splitlines()[-1])
    assert report["error"] is None and report["right"], report
    # The same worker, never retired, never counted as a death.
    assert report["after"] == report["before"], report
    assert report["spawns"] == 1 and report["restarts"] == 0, report
    assert report["again"] == 2
    assert not alive(worker_pid)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{host.pid}-")]


def test_a_reply_block_gone_before_the_host_opens_it_fails_that_call_only(
    pool: comfy_env.Pool,
) -> None:
    # Nothing the worker sent is invalid: its block was removed from /dev/shm under it. The
    # call fails with a HostResourceError that says so, and the worker is kept.
    w = pool.get_worker()
    w.call("tasks.remote:add", 1)
    pid, generation = w.pid, w.generation
    with pytest.raises(HostResourceError, match="gone before the host opened it") as info:
        w.call(remote_tasks.filled_in_a_block_that_vanishes, 1.0, MiB)
    assert info.value.errno == errno.ENOENT
    assert (w.pid, w.generation) == (pid, generation)
    out = w.call(remote_tasks.filled, 3.0, MiB)
    assert out.shape == (MiB,) and bool((out == 3.0).all())
    del out  # (the error's traceback cycle holds this frame until a gc: not the result too)
    assert pool.stats()[w.env].spawns == 1


def test_a_crash_with_pinned_blocks_leaks_nothing(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    stop_consumed_acks(_host_process(w).channel)
    w.call(remote_tasks.filled, 1.0, 2 * MiB)
    pid = w.pid
    prefix = f"ce-{os.getpid()}-"
    assert any(f"-w{pid}-" in n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    with pytest.raises(WorkerCrashed):
        w.call("comfy_env_worker.tasks:crash")
    assert _wait(lambda: not any(f"-w{pid}-" in n for n in os.listdir("/dev/shm")))
    # (the leak guard checks that nothing else of ours is left in /dev/shm either)


def test_shared_memory_off_streams_buffers_inline(config: comfy_env.PoolConfig) -> None:
    with comfy_env.Pool(config.model_copy(update={"shared_memory": False})) as pool:
        w = pool.get_worker()
        arr = np.arange(3 * MiB, dtype=np.int32)
        out = w.call("comfy_env_worker.tasks:echo", arr)
        assert np.array_equal(out, arr)
        assert w.call(remote_tasks.buffer_owner, arr) == "bytearray"  # the received frame
        assert _worker_shm(w)["blocks"] == 0


def test_inline_buffers_arrive_writable_however_the_frame_was_read(
    config: comfy_env.PoolConfig,
) -> None:
    # A small threshold sends 8 KiB arrays out of band; without shared memory they travel
    # inline in a frame small enough to be read whole with others: the asyncio reader's
    # ``bytes``, on which the result was a read-only array (writable through ``call``).
    import asyncio

    update = {"shared_memory": False, "shm_threshold_bytes": 4096}
    with comfy_env.Pool(config.model_copy(update=update)) as pool:
        w = pool.get_worker()
        arr = np.arange(1024, dtype=np.float64)
        for out in (
            w.call(remote_tasks.add_in_place, arr, 1.0),  # the argument arrived writable too
            asyncio.run(w.acall(remote_tasks.add_in_place, arr, 1.0)),
        ):
            assert np.array_equal(out, arr + 1.0)
            assert out.flags.writeable
            out += 1.0


def test_buffers_under_the_threshold_inline_are_no_shared_memory_failure(
    config: comfy_env.PoolConfig,
) -> None:
    # Shared memory on, its threshold above the message: the buffers travel out of band but
    # inline, both ways, by rule. Not a sign that the worker cannot create a block: the state
    # stays "on" (it read "unavailable", with a warning, which also kept acall's large
    # requests off the event loop).
    threshold = 4 * MiB
    with comfy_env.Pool(config.model_copy(update={"shm_threshold_bytes": threshold})) as pool:
        w = pool.get_worker()
        n = MiB // 4  # 1 MiB of float32 each way: out of band, under the threshold
        arr = np.arange(n, dtype=np.float32)
        echoed = w.call("comfy_env_worker.tasks:echo", arr)
        made = w.call(remote_tasks.filled, 2.0, n)
        assert np.array_equal(echoed, arr) and np.array_equal(made, np.full(n, 2.0, np.float32))
        # Inline, by rule: private memory, no loan.
        assert not _is_loan(_owner_block(echoed)) and not _is_loan(_owner_block(made))
        assert w.stats().shared_memory == "on"
        big = 2 * threshold // 4  # over it: shared memory
        out = w.call(remote_tasks.filled, 3.0, big)
        assert np.array_equal(out, np.full(big, 3.0, np.float32)) and _is_loan(_owner_block(out))
        assert w.stats().shared_memory == "on"


def _squat_next_names(names: list[str], count: int) -> list[str]:
    """Create (empty, ``O_EXCL``) the ``count`` names after each series in ``names``: the next
    names a pool would use if its names were ``<series>-<serial>``, as another user who can
    read the host's token in /proc and list /dev/shm would. Returns the paths made."""
    made = []
    for series in {n.rpartition("-")[0] for n in names}:
        top = max(int(n.rpartition("-")[2]) for n in names if n.rpartition("-")[0] == series)
        for serial in range(top + 1, top + 1 + count):
            path = f"/dev/shm/{series}-{serial}"
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            made.append(path)
    return made


def test_names_taken_by_someone_else_never_turn_shared_memory_off(pool: comfy_env.Pool) -> None:
    from comfy_env._process import host_id

    w = pool.get_worker()
    w.call(remote_tasks.filled, 1.0, MiB // 2)  # a reply block of the worker's too
    mine = [n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{host_id()}-")]
    hosts = [n for n in mine if f"-w{w.pid}-" not in n]
    workers = [n for n in mine if f"-w{w.pid}-" in n]
    assert hosts and workers
    squatted = _squat_next_names(hosts, 40) + _squat_next_names(workers, 40)
    try:
        for mib in (3, 6, 12):  # each a size class neither side has a block of yet
            arr = np.arange(mib * MiB // 4, dtype=np.float32)
            out = w.call("numpy:add", arr, 1.0)  # a new block each way
            assert np.array_equal(out, arr + 1) and _is_loan(_owner_block(out))
            del out
        # Before the fix every new block hit a taken name (EEXIST): inline, "unavailable".
        assert w.stats().shared_memory == "on"
        assert all(os.stat(p).st_size == 0 for p in squatted)  # never opened, never removed
    finally:
        for path in squatted:
            os.unlink(path)


def test_when_every_name_tried_is_taken_the_warning_says_so(
    config: comfy_env.PoolConfig,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from comfy_env import _channel
    from comfy_env._process import host_id
    from comfy_env_worker import shm

    # The host's random part is made predictable, and every name it would try is taken.
    monkeypatch.setattr(shm, "random_name_part", lambda: "0000beef")
    monkeypatch.setattr(_channel, "_warned", set())
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker()
        w.call("tasks.remote:add", 1)
        hosts = [n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{host_id()}-h")]
        assert hosts and all("-0000beef-" in n for n in hosts)
        taken = _squat_next_names(hosts, 2 * shm.NAME_TRIES)
        try:
            with caplog.at_level(logging.WARNING, logger="comfy_env"):
                arr = np.arange(3 * MiB, dtype=np.float32)
                assert np.array_equal(w.call("comfy_env_worker.tasks:echo", arr), arr)
        finally:
            for path in taken:
                os.unlink(path)
    said = [r.getMessage() for r in caplog.records]
    said = [m for m in said if "shared memory is unavailable" in m]
    assert len(said) == 1
    assert "taken by someone else" in said[0] and "full or too small" not in said[0]


@pytest.mark.parametrize(
    "forgery", ["foreign", "path", "out-of-range", "echo-path", "echo-not-yours"]
)
def test_a_forged_envelope_is_a_protocol_error(pool: comfy_env.Pool, forgery: str) -> None:
    w = pool.get_worker()
    with pytest.raises(ProtocolError, match="out-of-band"):
        w.call(remote_tasks.forge_oob_reply, forgery)
    assert w.call("tasks.remote:add", 1) == 1
    assert w.generation == 2


def test_a_double_crash_leaves_blocks_that_the_next_pool_start_sweeps(
    pool: comfy_env.Pool, tmp_path: Path
) -> None:
    if not private_shm_mount_usable("64M"):
        _double_crash_then_sweep(pool)  # any other pool starting meanwhile would sweep first
        return
    # In a private /dev/shm (a mount namespace of its own) and a private runtime root, so that
    # no other comfy-env pool on this machine (another test run, a benchmark) can sweep the
    # dead host's blocks or runtime dir first.
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    import subprocess
    import sys

    tests = str(Path(__file__).resolve().parent)
    script = (
        f"import sys; sys.path.insert(0, {tests!r}); import comfy_env, test_shm\n"
        "with comfy_env.Pool(comfy_env.PoolConfig()) as pool:\n"
        "    test_shm._double_crash_then_sweep(pool)\n"
        "print('scenario passed')\n"
    )
    child = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            'mount -t tmpfs -o size=256M tmpfs /dev/shm && exec "$0" -c "$1"',
            sys.executable,
            script,
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env=dict(os.environ, XDG_RUNTIME_DIR=str(runtime)),
    )
    assert child.returncode == 0 and "scenario passed" in child.stdout, child.stdout + child.stderr


def _double_crash_then_sweep(pool: comfy_env.Pool) -> None:
    host = _run_host(
        """
        import os, time, numpy as np, comfy_env
        from conftest import stop_consumed_acks
        w = comfy_env.get_worker()
        w.call("comfy_env_worker.tasks:echo", np.ones(2 << 20, dtype=np.float32))
        stop_consumed_acks(w._entry.slots[0].process.channel)
        w.call("comfy_env_worker.tasks:echo", np.ones(2 << 20, dtype=np.float32))
        pool = comfy_env.default_pool()
        while pool._spawner.watcher is None:  # started on the reactor with the first worker
            time.sleep(0.01)
        print(w.pid, pool._spawner.watcher.pid, flush=True)
        time.sleep(60)
        """
    )
    assert host.stdout is not None
    worker_pid, watcher_pid = map(int, host.stdout.readline().split())
    # The backstop case: the host's watcher, which would remove its leftovers the moment it
    # dies, is killed first. Then both die at once, before any cleanup can run (the host
    # first, so it cannot reap the worker and unlink the worker's blocks).
    os.kill(watcher_pid, signal.SIGKILL)
    assert _wait(lambda: not alive(watcher_pid))
    host.kill()
    host.communicate(timeout=30)
    try:
        os.kill(worker_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # its parent-death signal was quicker
    assert _wait(lambda: not psutil.pid_exists(worker_pid))
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{host.pid}-")]
    assert any("-h" in n for n in leftovers), f"the dead host's blocks must remain: {leftovers}"
    # The next pool start sweeps them, off the caller's path.
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", np.ones(2 * MiB, dtype=np.uint8))
    assert _wait(lambda: pool.last_sweep is not None)
    assert pool.last_sweep is not None
    assert {n for n in leftovers if "-h" in n} <= set(pool.last_sweep.blocks)
    assert any(d.startswith(f"host-{host.pid}-") for d in pool.last_sweep.runtime_dirs)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{host.pid}-")]
    # A live host's blocks (ours) are never swept.
    ours = {n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{os.getpid()}-")}
    assert ours
    report = comfy_env.sweep()
    assert not set(report.blocks) & ours
    assert ours <= set(os.listdir("/dev/shm"))


def test_the_sweep_kills_workers_whose_host_is_dead() -> None:
    host = _run_host(
        """
        import os, signal, time, comfy_env
        w = comfy_env.get_worker()
        w.call("comfy_env_worker.tasks:echo", 1)
        # Make the worker immune to its host's death, as a stuck native call might be.
        w.call(signal.pthread_sigmask, signal.SIG_BLOCK, {signal.SIGKILL})
        print(w.pid, flush=True)
        time.sleep(60)
        """
    )
    assert host.stdout is not None
    worker_pid = int(host.stdout.readline())
    proc = psutil.Process(worker_pid)
    proc.suspend()  # SIGSTOP: its watchdog cannot notice the host's death
    try:
        host.kill()
        host.communicate(timeout=30)
        report = comfy_env.sweep()
        if worker_pid not in report.processes:
            # The parent-death signal may have taken it first; then nothing is left to kill.
            assert not psutil.pid_exists(worker_pid) or proc.status() == psutil.STATUS_ZOMBIE
        assert _wait(lambda: not psutil.pid_exists(worker_pid), 5)
    finally:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def test_no_resource_tracker_warnings_at_exit() -> None:
    host = _run_host(
        """
        import numpy as np, comfy_env
        w = comfy_env.get_worker()
        for _ in range(3):
            w.call("comfy_env_worker.tasks:echo", np.ones(4 << 20, dtype=np.uint8))
        """
    )
    _out, err = host.communicate(timeout=60)
    assert host.returncode == 0, err
    assert "resource_tracker" not in err and "leaked" not in err
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{host.pid}-")]


def test_torch_cpu_tensors_travel_out_of_band(pool: comfy_env.Pool) -> None:
    torch = pytest.importorskip("torch")
    w = pool.get_worker()
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        t = torch.arange(2 * MiB, dtype=torch.float32).to(dtype).reshape(512, -1)
        out = w.call("comfy_env_worker.tasks:echo", t)
        assert isinstance(out, torch.Tensor)
        assert out.dtype == dtype and out.shape == t.shape and torch.equal(out, t)
    grad = torch.ones(MiB, requires_grad=True)
    back = w.call("comfy_env_worker.tasks:echo", grad)
    assert back.requires_grad and torch.equal(back.detach(), grad.detach())
    # Zero-copy in the worker (a view of our block), and a tensor the worker keeps pins that
    # block: a same-sized call afterwards must not overwrite it.
    index = w.call(remote_tasks.keep, torch.ones(MiB)) - 1
    w.call("comfy_env_worker.tasks:echo", torch.full((MiB,), 2.0))
    assert w.call(remote_tasks.kept_sum, index) == float(MiB)

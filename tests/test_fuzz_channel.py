"""A hostile or buggy worker, fuzzed from inside: what it writes on its channel never corrupts
the pool.

A real worker runs ``fuzz_tasks.misbehave``, which writes chosen bytes on the worker's own
channel (under its send lock, between whole frames, where a confused runtime or user code
holding the descriptor would write them): random bytes, headers with a wrong magic, type,
flags or length, replies for another call id, truncated frames followed by EOF, replies whose
payload is no pickle or an error record of the wrong shape, log and event frames with junk
payloads, out-of-band envelopes that point at blocks that do not exist, are not blocks at all
or are not the worker's, at ranges out of bounds, of the wrong types or overlapping. Each case
runs through the sync ``call`` and through ``await acall``.

What every case proves (README "Reliability guarantees", "Errors"): the caller gets a typed
comfy-env error that names what was wrong (``ProtocolError`` for a frame that is not valid,
``WorkerCrashed`` for EOF inside one, ``SerializationError`` for a result that does not
unpickle, as documented); a worker that broke the protocol is retired; the next call works,
on a fresh worker; ``submitted == ok + raised + ... + queued`` holds; nothing leaks (the
autouse leak guard); nothing hangs (``call_timeout`` bounds every wait, so a regression fails
as a ``CallTimeout`` instead of hanging the suite).

A pickle from the worker is trusted code by design (the worker runs the user's code anyway):
nothing here sandboxes unpickling; an exception raised while unpickling becomes a clear error
(or, for a log record or an event, a dropped record), never a pool thread killed, a caller
unwound by ``SystemExit`` or a slot left stuck.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import comfy_env
from comfy_env import HostResourceError, ProtocolError, SerializationError, WorkerCrashed
from comfy_env_worker import shm
from comfy_env_worker.protocol import FLAG_OOB, FrameType

OK, ERR, LOG, EVENT = FrameType.REPLY_OK, FrameType.REPLY_ERR, FrameType.LOG, FrameType.EVENT
REAL_REPLY = "the real reply"  # what ``misbehave`` returns when it returns


class ExitOnLoad:
    """Unpickles as ``sys.exit(...)``: a reducer that raises ``SystemExit`` in the host."""

    def __reduce__(self) -> Any:
        return (sys.exit, ("exit-on-load",))


def frame(ftype: int, payload: Any, call: Any = "CALL", **options: Any) -> tuple[Any, ...]:
    """A ``fuzz_tasks.build`` spec of one frame."""
    return ("frame", ftype, call, payload, options) if options else ("frame", ftype, call, payload)


def oob(table: Any, retained: Any = None, dropped: Any = None) -> tuple[Any, ...]:
    """A REPLY_OK spec whose out-of-band envelope carries ``table`` (and the lists of blocks
    retained and dropped, empty unless given) and a body pickled from None."""
    retained = [] if retained is None else retained
    dropped = [] if dropped is None else dropped
    envelope = ("oob", table, retained, dropped, None, b"")
    return frame(OK, envelope, flags=FLAG_OOB)


def pickled(obj: Any) -> tuple[str, Any]:
    return ("pickle", obj)


_EMPTY_TABLE = pickle.dumps(([], [], []), protocol=5)

# (id, frames, then, plant, expected error, what its message must name). ``then``: "hang"
# (the host must act on the junk alone), "exit" (EOF right after it).
PROTOCOL_ERRORS: list[tuple[str, list[Any], str, Any, str]] = [
    ("random-bytes", [("raw", bytes(range(7, 71)))], "hang", None, "bad frame magic"),
    ("wrong-magic", [frame(OK, pickled(1), magic=b"XX")], "hang", None, "bad frame magic"),
    ("unknown-type", [frame(200, pickled(1))], "hang", None, "frame type 200"),
    ("host-only-type", [frame(FrameType.CALL, pickled(1))], "hang", None, "frame type 4"),
    ("pong-out-of-turn", [frame(FrameType.PONG, b"")], "hang", None, "frame type 8"),
    ("hello-out-of-turn", [frame(FrameType.HELLO, pickled({}), call=0)], "hang", None, "type 1"),
    ("error-frame", [frame(FrameType.ERROR, b"\xff\xfe no")], "hang", None, "refused a frame"),
    ("unknown-flags", [frame(OK, pickled(1), flags=0xFE)], "hang", None, "flags 0xfe"),
    ("huge-length", [frame(OK, b"", length=2**64 - 1)], "hang", None, "exceeds the limit"),
    ("next-call-id", [frame(OK, pickled(1), call="CALL+1")], "hang", None, "reply to call"),
    ("stale-call-id", [frame(OK, pickled(1), call="CALL-1")], "hang", None, "reply to call"),
    ("error-record-not-a-pickle", [frame(ERR, b"garbage")], "hang", None, "error record"),
    ("error-record-empty", [frame(ERR, b"")], "hang", None, "error record"),
    ("error-record-short", [frame(ERR, pickled((1, 2)))], "hang", None, "error record"),
    ("error-record-not-a-tuple", [frame(ERR, pickled(7))], "hang", None, "error record"),
    ("error-record-wrong-types", [frame(ERR, pickled((1, 2, 3, 4, 5)))], "hang", None, "record"),
    (
        "error-record-exception-not-bytes",
        [frame(ERR, pickled(("E", "m", "text", "tb", 5)))],
        "hang",
        None,
        "error record",
    ),
    ("error-record-out-of-band", [frame(ERR, b"", flags=FLAG_OOB)], "hang", None, "out-of-band"),
    ("oob-payload-short", [frame(OK, b"ab", flags=FLAG_OOB)], "hang", None, "out-of-band"),
    (
        "oob-head-overruns",
        [frame(OK, ("oob-raw", b"xx", 1000), flags=FLAG_OOB)],
        "hang",
        None,
        "out-of-band",
    ),
    (
        "oob-head-not-a-pickle",
        [frame(OK, ("oob-raw", b"xxxx"), flags=FLAG_OOB)],
        "hang",
        None,
        "band",
    ),
    ("oob-table-not-a-list", [oob(5)], "hang", None, "out-of-band"),
    ("oob-entry-an-int", [oob([5])], "hang", None, "out-of-band"),
    ("oob-entry-a-dict", [oob([{"a": 1}])], "hang", None, "out-of-band"),
    ("oob-entry-empty", [oob([()])], "hang", None, "out-of-band"),
    ("oob-entry-kind-unknown", [oob([("zzz", 1)])], "hang", None, "out-of-band"),
    ("oob-inline-too-short", [oob([("inline", 0)])], "hang", None, "out-of-band"),
    ("oob-inline-length-a-str", [oob([("inline", 0, "x")])], "hang", None, "out-of-band"),
    ("oob-inline-negative", [oob([("inline", 0, -5)])], "hang", None, "out-of-band"),
    ("oob-inline-past-the-frame", [oob([("inline", 0, 10**9)])], "hang", None, "out-of-band"),
    ("oob-inline-offset-a-float", [oob([("inline", 0.5, 1)])], "hang", None, "out-of-band"),
    ("oob-shm-no-such-block", [oob([("shm", "PREFIXnope-1", 0, 8)])], "hang", None, "band"),
    ("oob-shm-foreign-name", [oob([("shm", "ce-0-foreign", 0, 8)])], "hang", None, "band"),
    ("oob-shm-name-an-int", [oob([("shm", 5, 0, 8)])], "hang", None, "out-of-band"),
    ("oob-shm-past-the-end", [oob([("shm", "BLOCK", "BLOCK_SIZE", 1)])], "hang", None, "band"),
    ("oob-shm-negative-offset", [oob([("shm", "BLOCK", -1, 1)])], "hang", None, "band"),
    ("oob-shm-offset-a-float", [oob([("shm", "BLOCK", 0.5, 1)])], "hang", None, "band"),
    ("oob-shm-length-a-str", [oob([("shm", "BLOCK", 0, "1")])], "hang", None, "band"),
    ("oob-shm-length-a-bool", [oob([("shm", "BLOCK", 0, True)])], "hang", None, "band"),
    ("oob-echo-name-an-int", [oob([("echo", 5, 0, 1)])], "hang", None, "out-of-band"),
    ("oob-retained-not-a-list", [oob([], retained=5)], "hang", None, "out-of-band"),
    ("oob-dropped-not-a-list", [oob([], dropped=5)], "hang", None, "out-of-band"),
    ("oob-dropped-unhashable", [oob([], dropped=[[1]])], "hang", None, "out-of-band"),
    (
        "oob-shm-a-directory",
        [oob([("shm", "PREFIXplanted", 0, 8)])],
        "hang",
        ("dir", "PREFIXplanted"),
        "out-of-band",
    ),
    (
        "oob-shm-a-fifo",
        [oob([("shm", "PREFIXplanted", 0, 8)])],
        "hang",
        ("fifo", "PREFIXplanted"),
        "out-of-band",
    ),
    (
        "oob-shm-a-symlink-out-of-dev-shm",
        [oob([("shm", "PREFIXplanted", 0, 8)])],
        "hang",
        ("symlink", "PREFIXplanted", "SYMLINK_TARGET"),
        "out-of-band",
    ),
]

# A complete frame that is no valid reply but ends in EOF inside the next frame.
CRASHES: list[tuple[str, list[Any]]] = [
    ("truncated-payload", [frame(OK, b"abc", length=100)]),
    ("half-a-header", [("raw", b"CE\x05")]),
    ("announced-a-gigabyte", [frame(OK, b"abc", length=1 << 30)]),
]

# Replies that are whole and in sync but whose result does not unpickle here: the documented
# SerializationError (README "Errors"); the worker then exits, so the next call needs a new one.
UNPICKLABLE: list[tuple[str, list[Any]]] = [
    ("not-a-pickle", [frame(OK, b"not a pickle")]),
    ("empty", [frame(OK, b"")]),
    ("truncated-pickle", [frame(OK, pickle.dumps(list(range(100)))[:-5])]),
    (
        "module-the-host-lacks",
        [frame(OK, b"\x80\x05\x8c\x0cno_such_mod\x94\x8c\x01x\x94\x93\x94.")],
    ),
    ("systemexit-on-load", [frame(OK, pickle.dumps(ExitOnLoad()))]),
    (
        "oob-body-not-a-pickle",
        [frame(OK, ("oob-raw", _EMPTY_TABLE + b"junk", len(_EMPTY_TABLE)), flags=FLAG_OOB)],
    ),
]

# Side frames with junk: dropped (a broken record is never fatal), the call still returns.
SIDE_JUNK: list[tuple[str, list[Any]]] = [
    ("log-not-a-pickle", [frame(LOG, b"junk")]),
    ("log-level-not-a-number", [frame(LOG, pickled(("abc", "n", "m", None, None, "log")))]),
    ("log-created-not-a-number", [frame(LOG, pickled((30, "n", "m", None, "x", "log")))]),
    ("log-exc-text-not-a-str", [frame(LOG, pickled((30, "n", "m", 5, None, "log")))]),
    ("log-short-record", [frame(LOG, pickled((30, "n")))]),
    (
        "log-systemexit-on-load",
        [frame(LOG, pickle.dumps((20, "n", ExitOnLoad(), None, None, "x")))],
    ),
    ("event-not-a-pickle", [frame(EVENT, b"junk")]),
    ("event-not-a-pair", [frame(EVENT, pickled(5))]),
    ("event-systemexit-on-load", [frame(EVENT, pickle.dumps(("kind", ExitOnLoad())))]),
    ("event-of-another-call", [frame(EVENT, pickled(("kind", 1)), call="CALL+5")]),
]

# Envelopes that are odd but not wrong: the result is built (the worker then exits).
ODD_BUT_VALID: list[tuple[str, list[Any]]] = [
    ("oob-zero-length-buffer", [oob([("shm", "BLOCK", 0, 0)])]),
    ("oob-overlapping-buffers", [oob([("shm", "BLOCK", 0, 8), ("shm", "BLOCK", 4, 8)])]),
    ("oob-one-block-three-times", [oob([("shm", "BLOCK", 0, "BLOCK_SIZE")] * 3)]),
]

# A bound on every wait: a regression that waits fails as CallTimeout, it never hangs.
CALL_TIMEOUT = 30.0


@pytest.fixture
def fuzz_config(config: comfy_env.PoolConfig) -> comfy_env.PoolConfig:
    return config.model_copy(update={"call_timeout": CALL_TIMEOUT})


@pytest.fixture
def fuzz_pool(fuzz_config: comfy_env.PoolConfig) -> Iterator[comfy_env.Pool]:
    with comfy_env.Pool(fuzz_config) as pool:
        yield pool
    # What a case planted under a block name is no block: the worker's unlink leaves it.
    for path in glob.glob(f"{shm.SHM_DIR}/ce-*planted"):
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)


def call(worker: comfy_env.Worker, mode: str, *args: Any, **options: Any) -> Any:
    """``misbehave(*args)`` through the sync call or ``acall`` (``on_event``: ``run``/``arun``)."""
    target = "tasks.fuzz:misbehave"
    if mode == "sync":
        if options:
            return worker.run(target, args, **options)
        return worker.call(target, *args)

    async def main() -> Any:
        if options:
            return await worker.arun(target, args, **options)
        return await worker.acall(target, *args)

    return asyncio.run(asyncio.wait_for(main(), CALL_TIMEOUT + 10))


def call_target(worker: comfy_env.Worker, mode: str, target: str, *args: Any) -> Any:
    if mode == "sync":
        return worker.call(target, *args)
    return asyncio.run(asyncio.wait_for(worker.acall(target, *args), CALL_TIMEOUT + 10))


def assert_invariant(worker: comfy_env.Worker) -> None:
    s = worker.stats()
    counted = s.ok + s.raised + s.crashed + s.timed_out + s.cancelled + s.failed
    assert s.submitted == counted + s.in_flight + s.queued, s


def assert_next_call_works(worker: comfy_env.Worker, generation: int) -> None:
    """The next call runs on generation ``generation`` and succeeds; the counts add up."""
    assert worker.call("tasks.remote:add", 1) == 1
    assert worker.generation == generation
    assert_invariant(worker)


def warm(pool: comfy_env.Pool) -> comfy_env.Worker:
    worker = pool.get_worker()
    assert worker.call("tasks.remote:add", 1) == 1
    assert worker.generation == 1
    return worker


MODES = ["sync", "async"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("frames", "then", "plant", "names"),
    [pytest.param(f, t, p, n, id=i) for i, f, t, p, n in PROTOCOL_ERRORS],
)
def test_a_frame_that_is_not_a_valid_reply_is_a_protocol_error_and_retires_the_worker(
    fuzz_pool: comfy_env.Pool,
    tmp_path: Any,
    mode: str,
    frames: Any,
    then: str,
    plant: Any,
    names: str,
) -> None:
    worker = warm(fuzz_pool)
    if plant is not None and "SYMLINK_TARGET" in plant:
        target = tmp_path / "not-a-block"
        target.write_bytes(b"x" * 4096)
        plant = tuple(str(target) if p == "SYMLINK_TARGET" else p for p in plant)
    with pytest.raises(ProtocolError, match="broke the protocol and was retired") as info:
        call(worker, mode, frames, then, plant)
    assert names in str(info.value)
    assert info.value.generation == 1 and info.value.env == worker.env
    assert_next_call_works(worker, generation=2)
    stats = worker.stats()
    assert stats.failed == 1 and stats.raised == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("frames", [pytest.param(f, id=i) for i, f in CRASHES])
def test_eof_inside_a_frame_is_a_crash_of_that_call_only(
    fuzz_pool: comfy_env.Pool, mode: str, frames: Any
) -> None:
    worker = warm(fuzz_pool)
    with pytest.raises(WorkerCrashed, match="exited with code 3"):
        call(worker, mode, frames, "exit")
    assert_next_call_works(worker, generation=2)
    assert worker.stats().crashed == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("frames", [pytest.param(f, id=i) for i, f in UNPICKLABLE])
def test_a_result_that_does_not_unpickle_is_a_serialization_error(
    fuzz_pool: comfy_env.Pool, mode: str, frames: Any
) -> None:
    worker = warm(fuzz_pool)
    with pytest.raises(SerializationError, match="could not be unpickled in the host"):
        call(worker, mode, frames, "exit")
    assert_next_call_works(worker, generation=2)
    assert worker.stats().raised == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("frames", [pytest.param(f, id=i) for i, f in ODD_BUT_VALID])
def test_odd_but_valid_envelopes_give_their_result(
    fuzz_pool: comfy_env.Pool, mode: str, frames: Any
) -> None:
    worker = warm(fuzz_pool)
    assert call(worker, mode, frames, "exit") is None
    assert_next_call_works(worker, generation=2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("frames", [pytest.param(f, id=i) for i, f in SIDE_JUNK])
def test_junk_log_and_event_frames_are_dropped_and_the_call_returns(
    fuzz_pool: comfy_env.Pool, mode: str, frames: Any, caplog: pytest.LogCaptureFixture
) -> None:
    worker = warm(fuzz_pool)
    events: list[comfy_env.CallEvent] = []
    # With handlers configured (caplog), records go through logging.makeRecord.
    with caplog.at_level("DEBUG"):
        assert call(worker, mode, frames, "return", on_event=events.append) == REAL_REPLY
        assert events == []
        # Without one, through the prefixed print.
        assert call(worker, mode, frames, "return") == REAL_REPLY
    assert_next_call_works(worker, generation=1)  # the same worker: junk there retires nothing
    assert worker.stats().ok == 4


# ---- random junk, seeded ----------------------------------------------------------------------

_call_ids = st.sampled_from(["CALL", "CALL+1", "CALL-1", 0, 2**64 - 1])
_types = st.one_of(st.sampled_from([OK, ERR, LOG, EVENT]), st.integers(0, 255))
# Payloads: random bytes, or pickles of small nested values (a reply, record or envelope of the
# wrong shape), or such a pickle cut short.
_values = st.recursive(
    st.none() | st.integers() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.tuples(inner, inner),
    max_leaves=8,
)
_pickles = st.builds(lambda obj: pickle.dumps(obj, protocol=5), _values)
_payloads = st.one_of(
    st.binary(max_size=64),
    _pickles,
    st.builds(lambda data, cut: data[: max(0, len(data) - cut)], _pickles, st.integers(1, 8)),
)


@st.composite
def _frames(draw: st.DrawFn) -> Any:
    payload = draw(_payloads)
    options: dict[str, Any] = {}
    if draw(st.integers(0, 9)) == 0:
        options["magic"] = draw(st.binary(min_size=2, max_size=2))
    if draw(st.integers(0, 4)) == 0:
        options["flags"] = draw(st.integers(0, 255))
    if draw(st.integers(0, 4)) == 0:
        options["length"] = draw(st.sampled_from([0, len(payload) + 1, 1 << 20, 2**64 - 1]))
    return frame(draw(_types), payload, call=draw(_call_ids), **options)


_junk = st.lists(
    st.one_of(_frames(), st.builds(lambda b: ("raw", b), st.binary(min_size=1, max_size=48))),
    min_size=1,
    max_size=3,
)


def test_random_junk_from_a_worker_never_corrupts_the_pool(
    fuzz_config: comfy_env.PoolConfig,
) -> None:
    """Seeded (``derandomize``) and bounded: a few dozen worker lives, a few seconds."""
    allowed = (ProtocolError, WorkerCrashed, SerializationError)
    with comfy_env.Pool(fuzz_config) as pool:
        worker = pool.get_worker()

        @settings(
            max_examples=60,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(junk=_junk, mode=st.sampled_from(MODES))
        def one(junk: list[Any], mode: str) -> None:
            pool.reset()  # a fresh breaker: every example kills a worker
            before = worker.stats().submitted
            try:
                call(worker, mode, junk, "exit")
            except allowed:
                pass
            assert worker.call("tasks.remote:add", 1) == 1
            stats = worker.stats()
            assert stats.submitted == before + 2
            assert_invariant(worker)

        one()


# ---- envelopes, without processes -------------------------------------------------------------

_anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["inline", "shm", "echo", "ce-fuzz-peer-x"]),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner, inner, inner),
    max_leaves=12,
)


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(table=_anything, retained=_anything, dropped=_anything, tail=st.binary(max_size=32))
def test_an_envelope_of_any_shape_unpacks_or_is_a_value_error(
    table: Any, retained: Any, dropped: Any, tail: bytes
) -> None:
    """Whatever the peer pickles as its table: a result or ``ValueError`` (the host's
    ``ProtocolError``), or ``OSError`` for a block that cannot be opened; never a
    ``TypeError``, ``KeyError`` or ``IndexError`` that no caller expects."""
    head = pickle.dumps((table, retained, dropped), protocol=5)
    payload = shm._U32.pack(len(head)) + head + pickle.dumps(None) + tail
    mappings = shm.PeerMappings("ce-fuzz-peer-")
    try:
        shm.unpack(payload, mappings, copy_out=True, loaned=[], loan_min=1, echoed=[])
    except (ValueError, OSError):
        pass
    finally:
        mappings.close_all()


# ---- whatever raises while a call holds its worker -------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_an_unforeseen_error_opening_a_reply_never_leaves_the_slot_stuck(
    fuzz_pool: comfy_env.Pool, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error nobody foresaw (here: ``open_reply`` raising ``RuntimeError``) reaches the
    caller, and the slot is free again: before, the sync path left it in the call, and every
    later call of the env queued until its deadline."""
    worker = warm(fuzz_pool)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("open_reply broke")

    # The process's ``open_reply`` is its channel's bound method, set on the instance.
    monkeypatch.setattr(worker._entry.slots[0].process, "open_reply", broken)
    with pytest.raises(RuntimeError, match="open_reply broke"):
        call_target(worker, mode, "comfy_env_worker.tasks:echo", bytes(1 << 20))
    monkeypatch.undo()
    assert worker.call("tasks.remote:add", 1) == 1
    assert_invariant(worker)
    stats = worker.stats()
    assert (stats.in_flight, stats.queued, stats.failed) == (0, 0, 1)


class _BrokenFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        raise RuntimeError("a logging filter broke")


@pytest.mark.parametrize("mode", MODES)
def test_a_log_handler_that_raises_ends_the_call_and_never_leaves_it_waiting(
    fuzz_pool: comfy_env.Pool, mode: str
) -> None:
    """A host logging handler whose filter raises while a worker's record arrives: the call
    ends with that error and its worker is stopped (the rest of its frames is unread), in
    both paths. Before, ``acall`` raised it inside a loop callback, where asyncio only logs
    it, and the call waited for a reply nobody read any more (until its deadline, or for
    ever)."""
    worker = warm(fuzz_pool)
    handler = logging.Handler()
    handler.addFilter(_BrokenFilter())
    record = frame(LOG, pickled((logging.WARNING, "fuzz", "a line", None, None, "log")))
    comfy_log = logging.getLogger("comfy_env")
    comfy_log.addHandler(handler)
    try:
        with pytest.raises(RuntimeError, match="a logging filter broke"):
            call(worker, mode, [record], "hang")
    finally:
        comfy_log.removeHandler(handler)
    assert_next_call_works(worker, generation=2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("how", "size", "error", "names"),
    [
        # The canary's reply went through the worker's first 1 MiB block: the host still maps
        # it, so its memory (which the worker writes) is read, whatever the name now names.
        ("unlink", 1 << 20, None, ""),
        # A block the host never mapped: gone, not forged (the worker made it, under its own
        # name): the result is lost, the worker broke no rule and is kept. (Before: a
        # ProtocolError that retired it.)
        ("unlink", 4 << 20, HostResourceError, "gone before the host opened it"),
        ("shrink", 1 << 20, WorkerCrashed, "SIGBUS"),
    ],
)
def test_a_reply_block_changed_behind_the_envelope_fails_that_call_only(
    fuzz_pool: comfy_env.Pool, mode: str, how: str, size: int, error: Any, names: str
) -> None:
    """The worker's reply block is unlinked or shrunk before its envelope is read: the
    result arrives whole, or the call fails with a typed error; the next call works."""
    worker = warm(fuzz_pool)
    target = "tasks.fuzz:replace_block_then_reply"
    if error is None:
        assert call_target(worker, mode, target, how, size).sum() == size // 8
        assert_next_call_works(worker, generation=1)
        return
    with pytest.raises(error, match=names):
        call_target(worker, mode, target, how, size)
    assert_next_call_works(worker, generation=1 if error is HostResourceError else 2)
    if error is HostResourceError:
        # The worker gave the gone block up (CONSUMED with FLAG_GONE) instead of putting it
        # back in its pool: the next reply of that size gets a new block and arrives.
        again = call_target(worker, mode, "tasks.remote:filled", 1.0, size // 4)
        assert again.nbytes == size and worker.generation == 1
        del again  # (the error's traceback holds this frame until a gc: not the result too)

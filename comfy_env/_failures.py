"""The errors a call ends with when its worker breaks: what happened, told once, in one place.

Every function here is a text built from facts: none of them touches the gate, a process or
the breaker. What a failure *does* (retire through the gate, collect the exit status, report
the death) is the call's own object's (``_exchange.Exchange.crashed`` / ``timed_out`` /
``protocol_broken``), which gathers the facts and then asks here for the words::

    Exchange.crashed      status_at_eof, gate(ChannelClosed g), why retired?
                            CLOSED / pool closed  -> pool_closed(label)
                            CANCELLED             -> CallCancelled(cancelled_text(...))
                            else: the status (a bounded wait for it), the last output, the
                            death reported -> crash_story(env, process, call, label, Death)
    Exchange.timed_out    gate(DeadlineHit g, call id) -> missed_deadline(...); if something
                          else retired it first, ``crashed`` tells that instead
    Exchange.protocol_broken   gate(ProtocolViolated g) -> protocol_error(env, process, detail)
                          (a frame out of turn: not_the_reply(...) is the detail)
    where the call ends   completed_timeout(...): a CallTimeout raised where the call's
                          timeout, id or target was not known gets them, once
    the breaker (_policies, _lease)   abandoned_error(env, EnvAbandoned) lists the recent deaths

The race the bounded wait prevents: "socket closed but worker still running, exit code None"
(the crash report raced the reaping of the process). The exchange applies its event through
the gate first, so whichever of the reader and the reactor retires first wins and the other's
event is dropped; the message then names the reason that actually won (``retire_reason``).
"""

from __future__ import annotations

import re
import signal
import sys
import time
from typing import TYPE_CHECKING, NamedTuple

from comfy_env_worker.protocol import FrameType, Payload

from . import _lifecycle as lc
from ._errors import (
    CallCancelled,
    CallTimeout,
    EnvAbandonedError,
    PoolClosedError,
    ProtocolError,
    WorkerCrashed,
    WorkerOutOfMemory,
    describe_exit,
    signal_name,
)

if TYPE_CHECKING:
    from ._backend import WorkerGeneration
    from ._entry import Slot
    from ._memlimit import MemoryVerdict


def retire_reason(slot: Slot, generation: int) -> lc.RetireReason | None:
    """Why ``generation`` of ``slot`` was retired, or None if it was not (or is gone)."""
    state = slot.state
    if isinstance(state, lc.Retired) and state.generation == generation:
        return state.reason
    return None


class Death(NamedTuple):
    """What the caller learnt of a worker's death (``Exchange.crashed`` gathers it): the exit
    status (None: unknown), the last output, whether the host had to kill it because it still
    ran after its channel broke, whether it still ran when the channel broke, and whether it
    ran out of memory (its memory limit's verdict, read by the exchange)."""

    rc: int | None
    tail: str
    still_running: bool
    alive_at_eof: bool
    memory: MemoryVerdict | None


def crash_story(
    env: str, process: WorkerGeneration, call_id: int, label: str, death: Death
) -> WorkerCrashed:
    """The error of a call whose worker died under it, told from the facts (``death``)."""
    rc, tail = death.rc, death.tail
    # Nothing of ours closes a live worker's channel: the env's code closed or replaced its
    # descriptors. The worker says so itself when it gets to (``_channel_failed`` in
    # comfy_env_worker.main), but the gate's kill, or its watchdog seeing the host let go,
    # may come first: the hint makes the story the same either way.
    hint = (
        " (did code in the worker close or replace descriptors it does not own: "
        "os.closerange, os.dup2, a daemonising library?)"
    )
    if process.channel is None:
        # No channel of its own that its code could close (an actor, Ray's): its death is
        # told by its backend's notice (``death_detail``, or the signal its log names).
        if rc is not None:
            what = describe_exit(rc)
        else:
            what = process.death_detail or "ended, and Ray reported no exit status"
    elif death.still_running or (death.alive_at_eof and rc == -signal.SIGKILL):
        what = "closed its channel while still running (it was killed)" + hint
    elif death.alive_at_eof and rc is not None:
        # It ended by itself once its channel was gone (its watchdog exits when the host lets
        # go of the cancel pipe, which a busy machine may get to first).
        what = f"closed its channel while still running, then {describe_exit(rc)}" + hint
    elif rc is None and process.death_detail:
        what = process.death_detail
    else:
        what = describe_exit(rc)
    verdict = death.memory
    if verdict is not None:
        what = out_of_memory(verdict)
    message = (
        f"worker for env {env} (pid {process.pid}, generation "
        f"{process.generation}) {what} during call {call_id} to {label or '?'}; "
        f"the call was not retried, the next call starts generation {process.generation + 1}"
    )
    if tail:
        message += "\n--- worker output (last lines) ---\n" + tail
    error = (WorkerCrashed if verdict is None else WorkerOutOfMemory)(
        message,
        env=env,
        pid=process.pid,
        generation=process.generation,
        exitcode=rc,
        signal=signal_name(rc),
        call_id=call_id,
        target=label or None,
        stderr_tail=tail,
    )
    if isinstance(error, WorkerOutOfMemory) and verdict is not None:
        error.limit, error.peak, error.how = verdict.limit, verdict.peak, verdict.how
    return error


def out_of_memory(verdict: MemoryVerdict) -> str:
    """What happened to a worker that ran out of memory, for the error's message ("... during
    call 3 to f")."""
    if verdict.how == "OOM killer":
        return (
            "was killed by SIGKILL while the kernel's OOM killer ran: likely out of "
            "memory (no limit of comfy-env's was reached; the machine, or a cgroup above "
            "the host, ran out)"
        )
    peak = f", peak {_size(verdict.peak)}" if verdict.peak else ""
    if verdict.how == "RLIMIT_DATA":
        return (
            f"ran out of memory: an allocation failed at its memory limit of "
            f"{_size(verdict.limit)}{peak} (RLIMIT_DATA; no memory cgroup could be used)"
        )
    return (
        f"was killed by the kernel at its memory limit of {_size(verdict.limit)}{peak} "
        f"({verdict.how})"
    )


def _size(count: int | None) -> str:
    if count is None:
        return "?"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


def cancelled_text(
    label: str, generation: int, how: lc.CancelKill | None, cancel_grace: float
) -> str:
    """What a caller whose cancelled call's worker was killed is told: only a worker that was
    asked and ran out of its grace is said to have ignored it; a second cancel (or a forced
    one, or ``cancel_grace=0``) killed it at once, whatever the call would have done."""
    worker = f"its worker (generation {generation})"
    if how is lc.CancelKill.SECOND_CANCEL:
        return f"the call to {label} was cancelled; {worker} was killed at once on a second cancel"
    if how is lc.CancelKill.FORCED:
        return f"the call to {label} was cancelled; {worker} was killed at once on a forced cancel"
    if how is lc.CancelKill.NO_GRACE:
        return (
            f"the call to {label} was cancelled; {worker} was killed at once "
            "(PoolConfig.cancel_grace=0)"
        )
    return (
        f"the call to {label} was cancelled and did not stop within "
        f"PoolConfig.cancel_grace={cancel_grace:g}s; {worker} was killed"
    )


def cancelled_error(
    env: str, label: str, process: WorkerGeneration, how: lc.CancelKill | None, grace: float
) -> CallCancelled:
    """The error of a call whose worker was killed because the call was cancelled: ``how``
    (the gate's ``GenerationEnd.cancel_kill``) is told by ``cancelled_text``."""
    generation = process.generation
    return CallCancelled(
        cancelled_text(label, generation, how, grace),
        env=env,
        pid=process.pid,
        generation=generation,
    )


def python_mismatch(env: str, process: WorkerGeneration) -> str | None:
    """Why a by-value callable cannot go to this worker, or None if it can."""
    env_version = process.python_version[:2]
    if env_version == tuple(sys.version_info[:2]):
        return None
    return (
        f"env {env} runs Python {'.'.join(map(str, env_version))}, the host "
        f"{sys.version_info[0]}.{sys.version_info[1]}: a function sent by value (a lambda, a "
        "closure, or one defined in __main__) only loads in the same Python version; pass it "
        "as 'package.module:function' instead"
    )


def missed_deadline(
    env: str, call_id: int, label: str, pid: int | None, generation: int
) -> CallTimeout:
    """The error of a call that missed its deadline once sent (its worker is stopped)."""
    worker = f"worker pid {pid}" if pid is not None else "its worker"
    return CallTimeout(
        f"call {call_id} to {label or '?'} on env {env} missed its deadline; "
        f"{worker} (generation {generation}) was stopped",
        env=env,
        pid=pid,
        generation=generation,
        call_id=call_id,
        target=label or None,
    )


def not_reached(env: str, why: str) -> CallTimeout:
    """The error of a call whose deadline passed before it reached a worker (``why``)."""
    return CallTimeout(
        f"the call's deadline passed before it reached a worker of env {env}{why}", env=env
    )


def completed_timeout(
    exc: CallTimeout, timeout: float | None, call_id: int, label: str
) -> CallTimeout:
    """``exc`` with what the site that raised it may not have known: the call's timeout in
    seconds (as given, or ``PoolConfig.call_timeout``), its call id (0: it had none yet) and
    its target. A queued call's deadline is seen where no target is known, a starting one's
    where no timeout is; each fact is set once and the message then says it, so a
    ``CallTimeout`` always tells which call, on which env, under which timeout."""
    who: list[str] = []
    if exc.call_id is None and call_id:
        exc.call_id = call_id
        who.append(f"call {call_id}")
    if exc.target is None and label:
        exc.target = label
        who.append(f"to {label}" if who else f"call to {label}")
    facts = [" ".join(who)] if who else []
    if exc.timeout is None and timeout is not None:
        exc.timeout = timeout
        facts.append(f"timeout {timeout:g}s")
    if facts and len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]} ({', '.join(facts)})",)
    return exc


def protocol_error(env: str, process: WorkerGeneration, detail: str) -> ProtocolError:
    """The error of a call whose worker broke the protocol (the caller retired it: a stream
    is never resynchronised)."""
    return ProtocolError(
        f"worker for env {env} (pid {process.pid}, generation "
        f"{process.generation}) broke the protocol and was retired: {detail}",
        env=env,
        pid=process.pid,
        generation=process.generation,
    )


def not_the_reply(ftype: int, reply_id: int, call_id: int, payload: Payload | memoryview) -> str:
    """What is wrong with a frame read where the reply to ``call_id`` belonged (both the sync
    and the asyncio path): the worker refused our frame, or said something out of turn."""
    if ftype == FrameType.ERROR:
        return "worker refused a frame: " + bytes(payload).decode("utf-8", "replace")
    return f"expected the reply to call {call_id}, got frame type {ftype} for call {reply_id}"


def pool_closed(label: str) -> PoolClosedError:
    return PoolClosedError(f"the pool was closed during the call to {label}")


# A frame of Python's own library in a ``faulthandler`` dump: a frozen module, or a file
# directly under ``lib/python3.X/`` (``Lib\`` on Windows) that is not in site-packages.
_STDLIB_FRAME = re.compile(
    r'File "(?:<frozen [^>"]*>|[^"]*[/\\](?:lib[/\\]python\d+(?:\.\d+)?|Lib)[/\\]'
    r'(?!(?:site|dist)-packages[/\\])[^"]*)"'
)


def crash_frame(output: str) -> str | None:
    """The line of a ``faulthandler`` dump in ``output`` that names where the crashing
    thread's own code was (``File "/pack/nodes.py", line 12 in crash``), or None without one.
    The dump lists the crashing thread under ``Current thread ...`` (``Stack`` when only one
    thread is dumped), most recent call first; the innermost frame outside Python's standard
    library is named, so a crash through a stdlib wrapper (``ctypes.string_at``) names the
    code that called it, not ``ctypes/__init__.py`` (a stack of stdlib frames only: its
    innermost). The last output line is the dump's ``Extension modules: ...`` list, which
    says nothing about where the worker died."""
    lines = output.splitlines()
    for i in range(len(lines) - 1, -1, -1):  # the last dump: a worker may have printed one before
        head = lines[i].lstrip()
        if head.startswith(("Current thread ", "Stack (most recent call first)")):
            frames = []
            for line in lines[i + 1 :]:
                frame = line.strip()
                if not frame.startswith('File "'):
                    break  # "<no Python frame>", a blank line, or the dump's next part
                frames.append(frame)
            own = [frame for frame in frames if not _STDLIB_FRAME.match(frame)]
            return (own or frames)[0] if frames else None
    return None


def abandoned_error(
    env: str, state: lc.EnvAbandoned, own_breaker: bool = False
) -> EnvAbandonedError:
    """The error of every call to an env the crash-loop breaker cut off: the recent deaths
    (each with the crashing frame its ``faulthandler`` dump names, else its last output
    lines) and how to recover. ``own_breaker``: the env's limits came from
    ``Pool.set_breaker`` (a ComfyUI pack's ``isolate(max_restarts=...)``), not ``PoolConfig``,
    and the message names those."""
    lines = []
    for d in state.deaths:
        if d.signal:
            how = f"signal {d.signal}"
        elif d.exitcode is not None:
            how = f"exit code {d.exitcode}"
        elif d.reason is lc.RetireReason.START_FAILED:
            how = "never launched"  # the launch itself failed: no process, no exit status
        else:
            how = "no exit status"  # a backend without one (a Ray actor)
        when = time.strftime("%H:%M:%S", time.localtime(d.when))
        frame = crash_frame(d.stderr_tail) if d.stderr_tail else None
        if frame is not None:
            detail = f"; crashed in {frame}"
        else:
            tail = d.stderr_tail.strip().splitlines()[-3:] if d.stderr_tail else []
            detail = ("; last output: " + " | ".join(tail)) if tail else ""
        lines.append(f"  {when} generation {d.generation} {d.reason.value} ({how}){detail}")
    if state.until is not None:
        last = state.deaths[-1]
        lifts = time.strftime("%H:%M:%S", time.localtime(last.when + state.until - state.at))
        recover = (
            f"calls fail until {lifts} (abandon_for={state.until - state.at:g}s), then the next "
            "call starts a fresh worker; pool.reset(env) lifts it now"
        )
    elif own_breaker:
        recover = (
            "calls fail until pool.reset(env) or a restart of this process; to have the block "
            "lift by itself after N seconds, give Pool.set_breaker (or isolate()) abandon_for=N"
        )
    else:
        recover = (
            "calls fail until pool.reset(env) or a restart of this process; to have the block "
            "lift by itself after N seconds, set PoolConfig.abandon_for (environment variable "
            "COMFY_ENV_ABANDON_FOR=N)"
        )
    deaths = f"{len(state.deaths)} worker death{'' if len(state.deaths) == 1 else 's'}"
    limits = (
        "the env's own limits, given to Pool.set_breaker or a ComfyUI pack's isolate()"
        if own_breaker
        else "PoolConfig"
    )
    return EnvAbandonedError(
        f"env {env} was abandoned after {deaths} within the restart window "
        f"(max_restarts/restart_window: {limits}); {recover}. "
        "Recent deaths:\n" + "\n".join(lines),
        env=env,
    )

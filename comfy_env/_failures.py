"""The errors a call ends with when its worker breaks: what happened, told once, in one place.

Data flow (who calls what; every builder retires through the gate first, then tells)::

    the call path (_pool, _acall)          on a read/send failure of generation g
        crash_error(...)        the exit status, if the kernel has it (status_at_eof)
                                gate(ChannelClosed g) -> why was it retired?
                                  CLOSED / pool closed  -> PoolClosedError
                                  CANCELLED             -> CallCancelled (the grace ran out,
                                                           or a second cancel: cancelled_text)
                                  else: the status (or a bounded wait for it) and the last
                                  output; the death reported (breaker, WorkerRetired);
                                  then WorkerCrashed naming signal and tail
        timeout_error(...)      gate(DeadlineHit g, call id) -> CallTimeout; if something
                                else retired it first, crash_error tells that instead
        completed_timeout(...)  where the call ends (_pool.call_prepared, run_leased;
                                _acall.arun): a CallTimeout raised where the call's timeout,
                                id or target was not known gets them, once
        protocol_error(...)     gate(ProtocolViolated g) -> ProtocolError
        not_the_reply(...)      a frame read where the reply belonged -> protocol_error
    the breaker (_policies)     abandoned_error(env, EnvAbandoned) lists the recent deaths

The race the bounded wait prevents: "socket closed but worker still running, exit code None"
(the crash report raced the reaping of the process). The builders apply their event through
the gate, so whichever of the reader and the reactor retires first wins and the other's event
is dropped; the message then names the reason that actually won.

``NotDelivered`` and ``HostFault`` are the call path's internal signals (never seen by users).
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from comfy_env_worker.protocol import FrameType, Payload

from . import _lifecycle as lc
from ._errors import (
    CallCancelled,
    CallTimeout,
    EnvAbandonedError,
    HostResourceError,
    PoolClosedError,
    ProtocolError,
    WorkerCrashed,
    WorkerOutOfMemory,
    describe_exit,
    signal_name,
)

if TYPE_CHECKING:
    from ._backend import WorkerGeneration
    from ._entry import EnvEntry, Slot


class NotDelivered(Exception):
    """The worker died without reading the request: the call may run on a fresh worker."""


class HostFault(Exception):
    """Carries a ``HostResourceError`` out of the exchange with the time of the call's reply
    (its ``Replied``), so the worker that replied whole is settled as idle (not retired) while
    the call fails."""

    def __init__(self, replied_at: float, error: HostResourceError) -> None:
        super().__init__(str(error))
        self.replied_at = replied_at
        self.error = error


def retire_reason(slot: Slot, generation: int) -> lc.RetireReason | None:
    """Why ``generation`` of ``slot`` was retired, or None if it was not (or is gone)."""
    state = slot.state
    if isinstance(state, lc.Retired) and state.generation == generation:
        return state.reason
    return None


def crash_error(
    entry: EnvEntry,
    slot: Slot,
    process: WorkerGeneration,
    call_id: int,
    label: str,
    closed: bool,
    cancel_grace: float,
    report_death: Callable[[int | None, str], None],
) -> Exception:
    """The error of a call whose worker's channel broke (``closed``: the pool is closing;
    ``report_death(exit status, last output)`` tells the breaker and subscribers)."""
    # The common crash: the kernel holds the exit status already (the process is being torn
    # down) and what it wrote is in the pipes; both are read here, before the gate's kill,
    # which then has nothing to signal. The reactor reaps and reports a moment later.
    rc = process.status_at_eof()
    # Still running although its channel closed (it closed or replaced the descriptors): the
    # gate's SIGKILL below is then the host's, and the story must not blame "a kill -9 from
    # outside" for it. (A process being torn down has its status set before its descriptors
    # close, so ``status_at_eof`` knows a real death already.)
    alive_at_eof = rc is None and not process.exited.is_set()
    entry.apply(slot, lc.ChannelClosed(process.generation))
    reason = retire_reason(slot, process.generation)
    if reason is lc.RetireReason.CLOSED or closed:
        return PoolClosedError(f"the pool was closed during the call to {label}")
    if reason is lc.RetireReason.CANCELLED:
        return CallCancelled(
            cancelled_text(label, process.generation, process.cancel_kill, cancel_grace),
            env=entry.spec.key,
            pid=process.pid,
            generation=process.generation,
        )
    # Else reap and drain here if the exit is there, or wait (bounded) for it, so the
    # message can name the signal.
    still_running = False
    if rc is None:
        process.collect_exit()
        rc = process.wait_exit(1.0)
        # A backend without exit codes (Ray) reports a death with rc None and its own words.
        still_running = rc is None and not process.exited.is_set()
        if still_running:
            process.kill(lc.Stop.KILL)
            rc = process.wait_exit(1.0)
        process.wait_output(0.5)
    tail = process.log.tail()
    # Reported (the breaker, ``WorkerRetired``) before the caller hears of it, so a caller
    # that calls again at once meets the breaker's verdict (else the reactor reports, once).
    report_death(rc, tail)
    # Nothing of ours closes a live worker's channel: the env's code closed or replaced its
    # descriptors. The worker says so itself when it gets to (``_channel_failed`` in
    # comfy_env_worker.main), but the gate's kill, or its watchdog seeing the host let go,
    # may come first: the hint makes the story the same either way.
    hint = (
        " (did code in the worker close or replace descriptors it does not own: "
        "os.closerange, os.dup2, a daemonising library?)"
    )
    if process.popen is None:
        # An actor (Ray): no channel of its own that its code could close; its death is told
        # by Ray's notice (or the signal its log names).
        if rc is not None:
            what = describe_exit(rc)
        else:
            what = process.death_detail or "ended, and Ray reported no exit status"
    elif still_running or (alive_at_eof and rc == -signal.SIGKILL):
        what = "closed its channel while still running (it was killed)" + hint
    elif alive_at_eof and rc is not None:
        # It ended by itself once its channel was gone (its watchdog exits when the host lets
        # go of the cancel pipe, which a busy machine may get to first).
        what = f"closed its channel while still running, then {describe_exit(rc)}" + hint
    elif rc is None and process.death_detail:
        what = process.death_detail
    else:
        what = describe_exit(rc)
    verdict = process.memory.verdict(rc, tail) if process.memory is not None else None
    if verdict is not None:
        what = verdict.text()
    message = (
        f"worker for env {entry.spec.key} (pid {process.pid}, generation "
        f"{process.generation}) {what} during call {call_id} to {label or '?'}; "
        f"the call was not retried, the next call starts generation {process.generation + 1}"
    )
    if tail:
        message += "\n--- worker output (last lines) ---\n" + tail
    error = (WorkerCrashed if verdict is None else WorkerOutOfMemory)(
        message,
        env=entry.spec.key,
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


def timeout_error(
    entry: EnvEntry,
    slot: Slot,
    process: WorkerGeneration,
    call_id: int,
    label: str,
    closed: bool,
    cancel_grace: float,
    report_death: Callable[[int | None, str], None],
) -> Exception:
    """The error of a call that missed its deadline: ``DeadlineHit`` stops its worker."""
    if not entry.apply(slot, lc.DeadlineHit(process.generation, call_id)):
        # Something else retired the worker first (crash, close, cancel): report that.
        return crash_error(entry, slot, process, call_id, label, closed, cancel_grace, report_death)
    return CallTimeout(
        f"call {call_id} to {label or '?'} on env {entry.spec.key} missed its deadline; "
        f"worker pid {process.pid} (generation {process.generation}) was stopped",
        env=entry.spec.key,
        pid=process.pid,
        generation=process.generation,
        call_id=call_id,
        target=label or None,
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


def protocol_error(
    entry: EnvEntry, slot: Slot, process: WorkerGeneration, detail: str
) -> ProtocolError:
    """Retire a worker that broke the protocol (a stream is never resynchronised)."""
    entry.apply(slot, lc.ProtocolViolated(process.generation))
    return ProtocolError(
        f"worker for env {entry.spec.key} (pid {process.pid}, generation "
        f"{process.generation}) broke the protocol and was retired: {detail}",
        env=entry.spec.key,
        pid=process.pid,
        generation=process.generation,
    )


def not_the_reply(
    entry: EnvEntry,
    slot: Slot,
    process: WorkerGeneration,
    ftype: int,
    reply_id: int,
    call_id: int,
    payload: Payload | memoryview,
) -> ProtocolError:
    """The error for a frame read where the reply to ``call_id`` belonged (both the sync
    and the asyncio path): the worker refused our frame, or said something out of turn."""
    if ftype == FrameType.ERROR:
        detail = bytes(payload).decode("utf-8", "replace")
        return protocol_error(entry, slot, process, f"worker refused a frame: {detail}")
    return protocol_error(
        entry,
        slot,
        process,
        f"expected the reply to call {call_id}, got frame type {ftype} for call {reply_id}",
    )


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

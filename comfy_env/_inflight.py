"""The calls this process is making right now: ``CALLS_IN_FLIGHT``, a set of the calls.

Each call is in the set for the whole of its run, added and discarded by the call itself
(``_exchange.run_prepared`` / ``run_plain``, ``_acall``), so the set's size is the count,
whatever order calls end in. Every channel's reader is handed the set at the handshake
(``_handshake`` -> ``comfy_env_worker.protocol.FrameReader.spin_wait``) and polls for a frame
only while at most one call is in flight; the worker's package never imports this module (it
must not import comfy_env), it only takes the set's size.

``set.add`` and ``set.discard`` are atomic (one C call each): no lock, and no more per call
than those two. A child forked during a call empties the set (``_shutdown``'s fork hook): the
calls of the parent's other threads are not running there, and the forking thread's call,
ending in the child, finds itself gone already (its ``discard`` does nothing).

A leaf: it imports nothing of the package, so the handshake and the call path alike can reach
it without an import circle. The set is never rebound (the readers hold the object).
"""

from __future__ import annotations

CALLS_IN_FLIGHT: set[object] = set()

"""One supervisor for a replica whose engine runs elsewhere, whatever carries it.

A worker process (:mod:`laya_core.replica.worker_client`) and a Ray actor
(:mod:`laya_core.replica.ray_client`) are two transports under one restart policy,
:func:`supervise`, run on the replica's supervising thread:

- the transport runs its child once (``_run_once``): it starts it or waits for it to load,
  serves it until it ends, and says how it ended (:class:`Outcome`);
- a child whose load raised a Python error fails at once (a restart would fail the same
  way), as an in-process replica does; a stopped replica is not restarted;
- a child that died while loading :data:`MAX_LOAD_CRASHES` times in a row is left down,
  FAILED, with why (and, for a worker, its last output) in the error;
- any other end is restarted after a backoff (``_restart_wait``; a worker's is
  :func:`backoff_s`, none once it had served :data:`STABLE_S`), counted and logged.

Ray restarts a dead actor itself (``max_restarts``), so its transport (``restarts_itself``)
only paces its asks whether the new actor has loaded, and counts the deaths it sees after
a load. The log lines go out under the transport's module's logger, as they always did.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import TYPE_CHECKING

from laya_core.replica.client import EngineState

if TYPE_CHECKING:
    from laya_core.replica.remote import RemoteEngineClient

MAX_LOAD_CRASHES = 3  # deaths while loading, in a row, before the replica is left down
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
# A child that served this long before it died starts again without waiting.
STABLE_S = 60.0


class Outcome(enum.Enum):
    """How one run of a replica's child ended."""

    FAILED = "failed"  # its load raised (or the front end refused the model): left FAILED
    CRASHED_LOADING = "crashed_loading"  # it died before it had loaded
    DIED = "died"  # it died after it had loaded (or was killed as stuck)
    STOPPED = "stopped"  # the front end stopped it


def backoff_s(crashes: int, served_s: float) -> float:
    """Seconds to wait before starting a child again, after ``crashes`` deaths while loading
    in a row, when its last run served ``served_s``."""
    return 0.0 if served_s >= STABLE_S else BACKOFF_S[min(crashes, len(BACKOFF_S) - 1)]


def supervise(replica: RemoteEngineClient) -> None:
    """Run ``replica``'s child until the replica stops, fails or is left down; see the
    module docstring. Sets the replica's ready event when it returns."""
    log = logging.getLogger(type(replica).__module__)
    crashes = 0  # deaths while loading, in a row
    while not replica._stopping.is_set():
        started = time.monotonic()
        outcome = replica._run_once()
        if replica._stopping.is_set() or outcome in (Outcome.FAILED, Outcome.STOPPED):
            break
        crashes = crashes + 1 if outcome is Outcome.CRASHED_LOADING else 0
        if crashes >= MAX_LOAD_CRASHES:
            replica._error = (f"the {replica.child} died while loading {crashes} times in a "
                              f"row ({replica._error}); left down{replica._last_words()}")
            replica._set_state(EngineState.FAILED)
            log.error("%s replica %d: %s", replica.model, replica.replica_id, replica._error)
            replica._left_down()
            break
        wait = replica._restart_wait(crashes, time.monotonic() - started)
        if not replica.restarts_itself:
            replica.restarts += 1
            log.warning("%s replica %d: restarting its %s in %.1f s", replica.model,
                        replica.replica_id, replica.kind, wait)
        if replica._stopping.wait(wait):
            break
    replica._ready.set()

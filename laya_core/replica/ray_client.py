"""The front end's side of a replica that runs as a Ray actor (``[cluster] engine = "ray"``).

:class:`RayEngineClient` is a :class:`~laya_core.replica.remote.RemoteEngineClient`: the
router, the tokenizer (``Backend.load_tokenizer``) and the chat template stay here, and
the engine runs in a :class:`~laya_core.replica.ray_actor.ReplicaActor` on whichever node has the
resources the memory plan asks for: ``num_cpus`` (``Backend.cpu_threads``, or 1) and
Ray's ``memory`` resource (the replica's ledger total, in bytes), so Ray never packs more
replicas onto a node than its memory holds. A thread per replica keeps one long poll
(``events``) in flight and hands each step's events to the event loops in one
``call_soon_threadsafe`` per loop. When the actor dies (its node is lost, a native crash,
``ray.kill``) its requests end at once (``TokenEvent.replica_lost``: a 503 with
Retry-After, or an error event mid-stream), the router marks the replica down, Ray
restarts the actor (``max_restarts``), and the replica rejoins once it has loaded again.
When to leave it down is :mod:`laya_core.replica.supervisor`'s, shared with the worker
process.

Ray is imported only here, and only when a manifest asks for it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from laya_core.backend import Backend, ModelConfig
from laya_core.replica.client import EngineState
from laya_core.replica.remote import RemoteEngineClient
from laya_core.replica.supervisor import Outcome

log = logging.getLogger(__name__)
POLL_S = 1.0  # the longest one events() call waits; the actor's state beat is 0.25 s
# Ray restarts a dead actor this many times in its life (-1: always); the supervisor's
# MAX_LOAD_CRASHES stops a replica that cannot load.
MAX_RESTARTS = -1
ACTOR_THREADS = 4  # the actor's method threads: a waiting poll, submits, cancels


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address``, else ``RAY_ADDRESS``, else start a local one."""
    try:
        import ray
    except ImportError:
        raise RuntimeError('[cluster] engine = "ray" needs Ray: pip install ray') from None
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=True)


def actor_resources(threads: int | None, planned_bytes: int | None) -> dict[str, Any]:
    """What the replica's actor asks Ray for: its compute threads (``Backend.cpu_threads``;
    None: one) and planned memory."""
    out: dict[str, Any] = {"num_cpus": threads or 1}
    if planned_bytes:
        out["memory"] = planned_bytes
    return out


class RayEngineClient(RemoteEngineClient):
    """One replica in a Ray actor; see the module docstring."""

    kind = "ray"
    child = "Ray actor"
    restarts_itself = True

    def __init__(self, config: ModelConfig, replica_id: int, backend: Backend,
                 plugins: Sequence[str] = (), planned_bytes: int | None = None,
                 on_change: Callable[[RayEngineClient], None] | None = None,
                 on_loaded: Callable[[RayEngineClient], None] | None = None) -> None:
        super().__init__(config, replica_id, backend, plugins, on_change, on_loaded)
        self.resources = actor_resources(type(backend).cpu_threads(config), planned_bytes)
        self.node_id: str | None = None
        self._actor: Any = None

    def start(self) -> None:
        import ray

        # The actor's class is the child's side (it imports laya_core.replica.worker): the
        # front end names it only to hand it to Ray.
        from laya_core.replica.ray_actor import ReplicaActor

        cls = ray.remote(ReplicaActor)
        self._actor = cls.options(  # type: ignore[attr-defined]
            name=f"laya-{self.model}-{self.replica_id}-{os.getpid()}",
            max_restarts=MAX_RESTARTS, max_task_retries=0,
            max_concurrency=ACTOR_THREADS, **self.resources,
        ).remote(self.config, self.replica_id, self._plugins)
        super().start()

    def begin_stop(self) -> None:
        self._stopping.set()
        self._send(("stop",))

    def stop(self, timeout: float = 10.0) -> None:
        self.begin_stop()
        self._thread.join(timeout)
        if self._actor is not None:
            import ray

            ray.kill(self._actor, no_restart=True)
        self._close_tokenizer()
        self._state = EngineState.STOPPED

    @property
    def actor(self) -> Any:
        """The replica's Ray actor handle."""
        return self._actor

    def runtime(self) -> dict[str, Any]:
        loaded = self._loaded
        out = dict(loaded.runtime) if loaded else {}
        out.update({"process": "ray actor", "node": self.node_id,
                    "pid": loaded.pid if loaded else None, "restarts": self.restarts})
        return out

    def _send(self, message: tuple[Any, ...]) -> bool:
        if self._actor is None or self._state is not EngineState.READY and \
                message[0] != "stop":
            return False
        self._actor.send.remote(message)  # fire and forget: replies come through events()
        return True

    # -- supervision ------------------------------------------------------------------------

    def _run_once(self) -> Outcome:
        """Wait for the actor (Ray starts it again after a death) to load, then serve it."""
        import ray.exceptions

        try:
            kind, value, node = ray.get(self._actor.loaded.remote())
        except ray.exceptions.RayActorError as e:
            self._error = f"its Ray actor died while loading: {_short(e)}"
            return Outcome.CRASHED_LOADING
        if not self._serve_loaded(kind, value, node):
            return Outcome.FAILED
        return self._poll()

    def _restart_wait(self, crashes: int, served_s: float) -> float:
        # Ray restarts the actor itself: this only paces the asks while it cannot load.
        return 0.5 * crashes

    def _left_down(self) -> None:
        import ray

        ray.kill(self._actor, no_restart=True)

    def _serve_loaded(self, kind: str, value: Any, node: str) -> bool:
        """Take the replica back once its actor has loaded; False when it cannot serve."""
        if kind == "failed":
            self._error = value
            self._set_state(EngineState.FAILED)
            return False
        self._loaded, self.node_id = value, node
        try:
            self._front_loaded(value)
        except Exception as e:  # noqa: BLE001 - the front end's check refused the model
            self._error = f"{type(e).__name__}: {e}"
            self._set_state(EngineState.FAILED)
            return False
        self._snapshot = value.state
        self._error = None
        self._set_state(EngineState.READY)
        self._ready.set()
        return True

    def _poll(self) -> Outcome:
        """Deliver the actor's messages until it dies or the replica stops."""
        import ray
        import ray.exceptions

        try:
            while not self._stopping.is_set():
                for message in ray.get(self._actor.events.remote(POLL_S)):
                    self._dispatch(message)
        except ray.exceptions.RayActorError as e:
            return self._ended(f"the Ray actor of {self.model} replica {self.replica_id} died "
                               f"({_short(e)}); retry", log)
        return Outcome.STOPPED


def _short(error: BaseException) -> str:
    """The first line of a Ray error, whose message runs to many lines."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__

"""Finding a replica for a request: a loaded one to ask about the model (an on-demand model
is loaded first), and the router's choice of the one to run it, timed (the route time of
``Server-Timing``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence

from laya_core.http.errors import QUEUE_RETRY_AFTER_S, APIError
from laya_core.replica.client import EngineClient
from laya_core.routing.router import NoRouteError
from laya_core.serving.deployment import Deployment, ModelUnavailableError, UnknownModelError
from laya_core.serving.residency import LoadFailedError, LoadQueueFullError, NoRoomError

LOAD_REFUSALS = (LoadFailedError, NoRoomError, LoadQueueFullError)


def load_refused(name: str, e: Exception) -> APIError:
    """The answer to an on-demand load that did not happen (one of LOAD_REFUSALS)."""
    if isinstance(e, LoadFailedError):
        return APIError(503, f"the model {name!r} failed to load: {e}", code="model_failed")
    if isinstance(e, LoadQueueFullError):
        return APIError(429, f"{e}; retry later", code="queue_full",
                        retry_after=QUEUE_RETRY_AFTER_S)
    return APIError(503, f"{e}; retry later", code="no_room", retry_after=QUEUE_RETRY_AFTER_S)


def client_for(deployment: Deployment, name: str, param: str = "model") -> EngineClient:
    """A loaded replica of model ``name``, or the APIError that says why there is none."""
    try:
        return deployment.any_client(name)
    except UnknownModelError:
        raise APIError(404, f"the model {name!r} does not exist; see GET /v1/models",
                       param=param, code="model_not_found") from None
    except ModelUnavailableError as e:
        if e.failed:  # no retry will help: say why, at once
            raise APIError(503, str(e), code="model_failed") from None
        raise APIError(503, str(e), code="not_ready", retry_after=5) from None


@contextlib.asynccontextmanager
async def ready_client(deployment: Deployment, name: str,
                       param: str = "model") -> AsyncIterator[tuple[EngineClient, float]]:
    """A loaded replica of model ``name`` and the seconds spent loading it (0 unless it
    loads on demand and was not loaded), or the APIError that says why there is none: 503
    ``model_failed`` when it failed to load, 503 ``no_room`` with Retry-After when no room
    could be made for it in its queue_timeout_s. An on-demand model stays loaded while the
    block runs: route the request inside it (the router's count then keeps it)."""
    residency = deployment.residency
    try:
        waited = await residency.acquire(name)
    except LOAD_REFUSALS as e:
        raise load_refused(name, e) from None
    try:
        yield client_for(deployment, name, param), waited
    finally:
        residency.release(name)


def route(deployment: Deployment, model: str, session: str | None,
          prefix: Sequence[int], t0: float) -> tuple[int, float]:
    """The replica the router picks (it counts the request in that replica's load until
    ``router.release``) and the seconds since ``t0``; 503 when none can take it."""
    try:
        replica = deployment.router.route(model, session, prefix)
    except NoRouteError as e:
        raise APIError(503, str(e), code="no_replica", retry_after=QUEUE_RETRY_AFTER_S) from None
    return replica, time.perf_counter() - t0

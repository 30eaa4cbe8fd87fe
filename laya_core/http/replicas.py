"""Finding a replica for a request: a loaded one to ask about the model, and the router's
choice of the one to run it, timed (the route time of ``Server-Timing``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from laya_core.http.errors import QUEUE_RETRY_AFTER_S, APIError
from laya_core.replica.client import EngineClient
from laya_core.routing.router import NoRouteError
from laya_core.serving.deployment import Deployment, ModelUnavailableError, UnknownModelError


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


def route(deployment: Deployment, model: str, session: str | None,
          prefix: Sequence[int], t0: float) -> tuple[int, float]:
    """The replica the router picks (it counts the request in that replica's load until
    ``router.release``) and the seconds since ``t0``; 503 when none can take it."""
    try:
        replica = deployment.router.route(model, session, prefix)
    except NoRouteError as e:
        raise APIError(503, str(e), code="no_replica", retry_after=QUEUE_RETRY_AFTER_S) from None
    return replica, time.perf_counter() - t0

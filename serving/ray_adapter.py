"""The one place that reaches into Ray's non-public code.

- `SessionRouter`: a request router for the model deployments, built on Ray Serve's
  `ConsistentHashRouter` (it reads that router's ring).
- The OpenAI ingress pieces ray.serve.llm's own builder uses (its FastAPI app with error and
  request-id middleware, its route table, its model cards), so our ingress serves the same
  `/v1/chat/completions`, `/v1/completions` and `/v1/models` as `build_openai_app`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import ray
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from pydantic import model_validator
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest as _ChatRequest
from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest as _CompletionRequest
from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS
from ray.llm._internal.serve.core.ingress.ingress import init as init_openai_app
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from serving.routing import RouteKey, order_replicas

OPENAI_ROUTES = ("models", "model_data", "completions", "chat")
__all__ = [
    "ROUTER_CLASS", "ChatRequest", "CompletionRequest", "SessionRouter", "http_host", "model_card", "openai_app",
    "openai_routes", "router_kwargs",
]  # fmt: skip
ROUTER_CLASS = "serving.ray_adapter:SessionRouter"


def _readable(data: Any, handler: Callable[[Any], Any]) -> Any:
    """vLLM's own request checks read some fields before their types are checked (`structured_outputs: 1.5` met
    `.get`): such a field is a validation error (a 422 naming the body), never an AttributeError (a 500)."""
    try:
        return handler(data)
    except (AttributeError, TypeError, KeyError) as exc:
        why = f"a field has a type the model's request checks cannot read ({exc}); see the API's schema"
        raise ValueError(why) from exc


class ChatRequest(_ChatRequest):
    """ray.serve.llm's chat completion request, whatever the types of its fields."""

    @model_validator(mode="wrap")
    @classmethod
    def _readable_fields(cls, data: Any, handler: Callable[[Any], Any]) -> Any:
        return _readable(data, handler)


class CompletionRequest(_CompletionRequest):
    """ray.serve.llm's completion request, whatever the types of its fields."""

    @model_validator(mode="wrap")
    @classmethod
    def _readable_fields(cls, data: Any, handler: Callable[[Any], Any]) -> Any:
        return _readable(data, handler)


class SessionRouter(ConsistentHashRouter):
    """Session affinity for agent turns, and the coordinator's placement keys.

    - a plain session id (the `x-session-id` of an agent's turn): the session's home replica, then
      its ring successors (exactly ConsistentHashRouter);
    - a `RouteKey` (`pc1:...`, sent by the compaction coordinator): the session's ring walk rotated
      to the key's slot, replicas that already failed the prompt last;
    - no session id: round robin over the running replicas.

    Every process builds the same ring from the same replica set, so the ingress (agent turns)
    and the coordinator (compaction prompts) agree on each session's home without talking.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._round_robin = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        session_id = pending_request.metadata.session_id
        key = RouteKey.decode(session_id)
        if key is None and session_id:
            return await super().choose_replicas(candidate_replicas, pending_request)
        pending_request.routing_context.should_backoff = True
        by_id = {replica_id.unique_id: replica for replica_id, replica in self._replicas.items()}
        if key is None or key.session is None:
            walk = sorted(by_id)
            key = RouteKey(None, next(self._round_robin), key.avoid if key else ())
        else:
            walk = [replica_id.unique_id for replica_id in self._lookup_ranked_replicas(key.session)]
        return [[by_id[r]] for r in order_replicas(walk, key) if r in by_id]

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        """Hand the replica to exactly the request it was chosen for.

        The base class matches by internal request id, which all calls made while serving one
        request share (the coordinator's chunk prompts of one compaction): with several of them
        pending, only one would ever be matched and the others would wait forever. Match the
        request's own metadata object instead.
        """
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                self._cancel_routing_task_for_pending_request(pending)
                self._record_queue_wait_time(pending)
                pending.future.set_result(replica)
                if self._pending_requests_by_id.get(request_metadata.internal_request_id) is pending:
                    self._remove_pending_request_from_indices(pending)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)


def router_kwargs() -> dict[str, Any]:
    """Walk the whole ring: a session falls back to any replica when its home is busy or gone."""
    return {"num_fallback_replicas": 1024}


def openai_app(title: str, description: str) -> FastAPI:
    """ray.serve.llm's FastAPI app (its exception, metrics and request-id middleware) without its CORS middleware
    (any origin, with credentials): the caller adds CORS for the origins it allows, if any."""
    app = init_openai_app()
    app.title = title
    app.description = description
    app.user_middleware = [m for m in app.user_middleware if m.cls is not CORSMiddleware]
    return app


def http_host(timeout_s: float = 30.0) -> str | None:
    """The host Serve's HTTP proxies bind (from the Serve controller); None when it cannot be read."""
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        options: Any = ray.get(controller.get_http_config.remote(), timeout=timeout_s)
        return str(options.host)
    except Exception:  # no controller reachable: the caller treats the host as exposed
        return None


def openai_routes(names: Sequence[str] = OPENAI_ROUTES) -> dict[str, Callable[[FastAPI], Callable[..., Any]]]:
    """ray.serve.llm's own route table for the OpenAI endpoints we serve."""
    return {name: DEFAULT_ENDPOINTS[name] for name in names}


def model_card(llm_config: Any) -> Any:
    """The `/v1/models` entry ray.serve.llm's builder makes for a model."""
    return to_model_metadata(llm_config.model_id, llm_config)

"""With `serving.ray_router` (the request router), the places that reach into Ray's non-public code.

- The OpenAI ingress pieces ray.serve.llm's own builder uses (its FastAPI app with error and
  request-id middleware, its route table, its model cards), so our ingress serves the same
  `/v1/chat/completions`, `/v1/completions` and `/v1/models` as `build_openai_app`.
"""

from __future__ import annotations

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

OPENAI_ROUTES = ("models", "model_data", "completions", "chat")
__all__ = ["ChatRequest", "CompletionRequest", "http_host", "model_card", "openai_app", "openai_routes"]


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

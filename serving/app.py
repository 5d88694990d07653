"""The Serve application: model deployments, the compaction coordinator, and the HTTP ingress.

    build_app(args) -> ray.serve.Application        (Serve config: import_path: serving.app:build_app)

Graph: `CompactionIngress` (FastAPI; OpenAI endpoints + /v1/compact) -> `Coordinator`
(`coordinator_replicas` replicas, 2 by default, so none is a single point of failure; calls that
carry a session id reach the session's coordinator replica through `SessionRouter`; admits, plans,
places, dispatches) -> one ray.serve.llm `LLMServer` deployment per model, routed by `SessionRouter`
(consistent hash on the session id, placement keys from the coordinator).
"""

from __future__ import annotations

from typing import Any, cast

import ray
from ray import serve
from ray.serve.deployment import Application, Deployment
from ray.serve.llm import build_llm_deployment
from ray.serve.llm.ingress import OpenAiIngress

from compaction.errors import CompactionError
from serving.api import make_ingress
from serving.coordinator_replica import CoordinatorDeployment
from serving.models import ModelSpec, load_catalogue
from serving.ray_adapter import model_card
from serving.ray_router import ROUTER_CLASS, router_kwargs
from serving.settings import AppArgs, parse_args

__all__ = ["AppArgs", "build_app", "hosted_specs", "parse_args"]

COORDINATOR_MAX_ONGOING = 100_000


def as_deployment(cls: type) -> Deployment:
    return cast(Deployment, serve.deployment(cls))


def actor_options(env_vars: dict[str, str] | None = None) -> dict[str, Any]:
    """Zero logical CPUs (they wait on the replicas) and the caller's runtime env, as LLMServer gets it."""
    runtime_env = dict(ray.get_runtime_context().runtime_env)
    if env_vars:
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env_vars}
    return {"num_cpus": 0, "runtime_env": runtime_env}


def hosted_specs(opts: AppArgs) -> list[ModelSpec]:
    """The catalogue entries of the hosted models, with the args' replica bounds applied."""
    catalogue = load_catalogue(opts.catalogue)
    try:
        specs = [catalogue.get(name) for name in opts.models]
    except CompactionError as exc:
        raise ValueError(str(exc)) from exc
    return [s.model_copy(update={"replicas": opts.replicas[s.name]}) if s.name in opts.replicas else s for s in specs]


def model_deployment(spec: ModelSpec, config: Any, routing: dict[str, Any]) -> Application:
    """One model's ray.serve.llm deployment; CPU replicas bound to their own cores (serving.placement)."""
    from serving.placement import CompactionLLMServer, PlacedLLMServer

    if spec.device != "cpu":
        return build_llm_deployment(
            config, override_serve_options={"request_router_config": routing}, deployment_cls=CompactionLLMServer
        )

    return build_llm_deployment(
        config,
        name_prefix="LLMServer:",
        bind_kwargs=spec.server_kwargs(),
        override_serve_options={"request_router_config": routing},
        deployment_cls=PlacedLLMServer,
    )


def build_app(args: dict[str, Any]) -> Application:
    """The whole application for the catalogue models named in `args` (see `AppArgs`)."""
    opts = parse_args(args)
    specs = hosted_specs(opts)
    configs = {spec.name: spec.llm_config() for spec in specs}
    routing = {"request_router_class": ROUTER_CLASS, "request_router_kwargs": router_kwargs()}
    llms = {spec.name: model_deployment(spec, configs[spec.name], routing) for spec in specs}
    coordinator = (
        as_deployment(CoordinatorDeployment)
        .options(
            name="Coordinator",
            num_replicas=opts.coordinator_replicas,
            ray_actor_options=actor_options(),
            max_ongoing_requests=COORDINATOR_MAX_ONGOING,  # its own Gate queues and sheds, not Serve
            request_router_config=routing,
            max_replicas_per_node=opts.coordinators_per_node,  # type: ignore[arg-type]  # None: no bound
        )
        .bind(llms, specs, opts)
    )
    options = OpenAiIngress.get_deployment_options(list(configs.values()))
    ingress = make_ingress(opts.max_request_bytes, opts.tenancy, opts.cors_origins, opts.archive)
    actor = actor_options()  # no key in it: the ingress reads its keys from its own environment or file
    deployment = as_deployment(ingress).options(name="CompactionIngress", ray_actor_options=actor, **options)
    return deployment.bind(
        llm_deployments=llms,
        model_cards={name: model_card(config) for name, config in configs.items()},
        coordinator=coordinator,
        tokenizer_sources={spec.name: spec.resolved_source() for spec in specs},
        windows={spec.name: spec.max_model_len for spec in specs},
        aliases=dict(opts.model_aliases),
        tenancy=opts.tenancy,
        allow_unauthenticated=opts.allow_unauthenticated,
        default_compaction=dict(opts.default_compaction),
        reply_budgets={s.name: s.default_max_tokens for s in specs if s.default_max_tokens is not None},
        history_limits={spec.name: spec.plan_limits() for spec in specs},
    )

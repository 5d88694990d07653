"""The HTTP ingress: ray.serve.llm's OpenAI endpoints plus `POST /v1/compact` and `GET /healthz`.

One FastAPI app (ray.serve.llm's, with its middleware) serves both, so an agent's turns and its
compactions enter through the same door. The other wire formats translate to and from the same chat
path (`serving.wire`): `POST /v1/responses` and `/v1/responses/compact` (OpenAI Responses),
`POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic Messages). Errors leave through one
table (`serving.errors`); bodies are guarded before any handler (`serving.middleware`); tenants, keys
and their limits: `serving.tenants`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle
from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from compaction.errors import (
    BackendError,
    DeadlineExceeded,
    InvalidInput,
    UnknownModel,
)
from compaction.history import parse_messages
from compaction.options import CompactionOptions
from compaction.partition import PlanLimits
from compaction.tokenizer import HFChatTokenizer
from compaction.turn_policy import parse_context_management
from serving.archive import ArchiveConfig
from serving.coordinator import CompactJob, ServiceResult
from serving.coordinator_calls import Suspects, call_coordinator
from serving.errors import field_path, install_error_handlers
from serving.middleware import BodyGuard
from serving.ray_adapter import ChatRequest, CompletionRequest, http_host, openai_app, openai_routes
from serving.recall import RecallEndpoint
from serving.replies import HandOn
from serving.tenants import (
    KeyTable,
    TenancyConfig,
    Tenant,
    TenantGate,
    allow_origins,
    check_exposure,
    read_keys,
    tenant_of,
)
from serving.turns import FIELD as CONTEXT_MANAGEMENT
from serving.turns import (
    ChatTurn,
    PromptCounter,
    TurnCompaction,
    Wire,
    check_fits,
    counted,
    edited,
    fit,
    prepare_turn,
)
from serving.wire import messages as wire_messages
from serving.wire import messages_answer, responses_answer
from serving.wire import responses as wire_responses
from serving.wire.chat import refuse_service_fields, when_sent, with_compaction
from serving.wire.codec import SESSION_HEADER, ChatCall, checked_session
from serving.wire.compact import CompactRequest
from serving.wire.errors import AnthropicErrors
from serving.wire.messages import CountTokensRequest, MessagesRequest
from serving.wire.responses import CompactResponsesRequest, ResponsesRequest
from serving.wire.responses_answer import refuse_websocket
from serving.wire.sse import chat_chunks

logger = logging.getLogger(__name__)
REPLICA_BACKOFF_S = (0.5, 1.0, 2.0)  # a chat turn whose model replica died is sent again after these pauses
DEADLINE_GRACE_S = 5.0


class CompactionIngress(OpenAiIngress):
    """ray.serve.llm's OpenAI ingress plus the compaction endpoint."""

    def __init__(
        self,
        llm_deployments: dict[str, DeploymentHandle],
        model_cards: dict[str, Any],
        *,
        coordinator: DeploymentHandle,
        tokenizer_sources: dict[str, str],
        windows: dict[str, int],
        aliases: dict[str, str] | None = None,
        lora_paths: dict[str, str] | None = None,
        tenancy: TenancyConfig | None = None,
        allow_unauthenticated: bool = False,
        default_compaction: dict[str, dict[str, Any]] | None = None,
        reply_budgets: dict[str, int] | None = None,
        history_limits: dict[str, PlanLimits] | None = None,
    ) -> None:
        if tenancy is not None:  # here, in the ingress's process: its environment holds the keys
            check_exposure(KeyTable(read_keys(tenancy)), http_host(), allow_unauthenticated, tenancy)
        super().__init__(llm_deployments, model_cards, lora_paths=lora_paths)
        self._coordinator = coordinator
        self._tokenizer_sources = tokenizer_sources
        self._windows = windows
        self._aliases = aliases or {}
        self._defaults = default_compaction or {}  # model -> the compaction entry of turns that send none
        self._reply_budgets = reply_budgets or {}  # model -> max_tokens of a turn that sets none
        self._limits = history_limits or {}  # model -> its caps on what one compaction takes
        self._tokenizers: dict[str, HFChatTokenizer] = {}
        self._counters: dict[tuple[str, str], PromptCounter] = {}  # (tenant, model) -> its sessions' counts
        self._suspects = Suspects()  # jobs coordinators died running (serving.coordinator_calls)
        self._replies = HandOn(self._reply_to)  # replies on their way to their sessions' coordinators

    async def compact(self, body: CompactRequest, request: Request) -> ServiceResult:
        """Compact a history; the stats show where each chunk ran, what the cache served and the queue wait."""
        return await self._compact(body.job(_header_session(request), tenant_of(request)))

    async def completions(self, body: CompletionRequest, request: Request) -> Response:  # type: ignore[override]
        """OpenAI completions, in the caller's own prefix-cache namespace."""
        refuse_service_fields(await request.json())
        salt = tenant_of(request).salted(body.cache_salt)
        return await super().completions(body.model_copy(update={"cache_salt": salt}), _for_replica(request))

    async def _compact(self, job: CompactJob) -> ServiceResult:
        limits = self._limits.get(job.model)
        if limits is not None:  # a history that cannot fit is refused here, not sent on (serving.turns.check_fits)
            await asyncio.to_thread(check_fits, job.messages, self._tokenizer(job.model), limits)
        # The coordinator enforces timeout_s per attempt; this bounds the whole call, retries on another
        # coordinator included (a small grace lets the coordinator's own 504 arrive first).
        try:
            async with asyncio.timeout(job.timeout_s + DEADLINE_GRACE_S if job.timeout_s else None):
                outcome = await call_coordinator(
                    self._coordinator, "compact", job, session_id=job.session_id, suspects=self._suspects
                )
        except TimeoutError as exc:
            raise DeadlineExceeded(
                f"the compaction did not finish within timeout_s = {job.timeout_s:g} s and was cancelled",
                job.timeout_s or 0.0,
            ) from exc
        assert isinstance(outcome, ServiceResult)
        return outcome

    async def chat(self, body: ChatRequest, request: Request) -> Response:  # type: ignore[override]
        """OpenAI chat completions. With `context_management` (the request's, else the model's default entry),
        compacted server-side (see serving.turns)."""
        raw = await request.json()
        refuse_service_fields(raw)
        call = self._served(ChatCall(raw, _header_session(request)))
        forward, outcome = await self._prepare(call, "chat", request)
        response = await self._answer(forward, call, request, outcome)
        return with_compaction(response, outcome) if outcome is not None else response

    async def responses(self, body: ResponsesRequest, request: Request) -> Response:
        """OpenAI Responses over the chat path, compaction items included (see serving.wire.responses)."""
        call = self._served(await asyncio.to_thread(wire_responses.to_chat, body, _header_session(request)))
        forward, outcome = await self._prepare(call, "responses", request)
        sent = forward["messages"]
        if call.compact_now:  # a compaction_trigger: the compacted context alone, as one compaction item
            if body.stream:
                return _events(responses_answer.stream_triggered(call, outcome, sent))
            return JSONResponse(responses_answer.triggered(call, outcome, sent))
        response = await self._answer(forward, call, request, outcome)
        if isinstance(response, StreamingResponse):
            return _events(responses_answer.stream(chat_chunks(response.body_iterator), call, outcome, sent))
        return JSONResponse(responses_answer.response(_json(response), call, outcome, sent))

    async def responses_compact(self, body: CompactResponsesRequest, request: Request) -> dict[str, Any]:
        """OpenAI's compaction endpoint: the kept user messages and one compaction item standing for the input."""
        served = body.model
        body = body.model_copy(update={"model": self._aliases.get(served, served)})
        call = wire_responses.compact_call(body, _header_session(request))
        self._window(body.model)
        messages = parse_messages(call.body["messages"], "input")
        tenant = tenant_of(request)
        job = CompactJob(
            model=body.model,
            messages=messages,
            options=self._compact_options(body, served),
            session_id=call.session,
            tenant=tenant.id,
            cache_salt=tenant.cache_salt,
        )
        with call.naming_fields():
            return responses_answer.compacted(await self._compact(job), call)

    async def messages(self, body: MessagesRequest, request: Request) -> Response:
        """Anthropic Messages over the chat path, the compaction beta and context edits included (see
        serving.wire.messages); the model's default compaction entry when the request sends no edit."""
        call = self._served(await asyncio.to_thread(wire_messages.to_chat, body, _header_session(request)))
        if call.edits:
            tokenizer = self._tokenizer(str(call.body["model"]))
            edited_body, applied = await asyncio.to_thread(edited, call.body, call.edits, call.thinking, tokenizer)
            call = replace(call, body=edited_body, applied_edits=tuple(applied))
        forward, outcome = await self._prepare(call, "messages", request)
        sent = forward["messages"]
        if call.pause and outcome is not None and outcome.status == "applied":  # the compaction, no reply
            if body.stream:
                return _events(messages_answer.stream(None, call, outcome, sent))
            return JSONResponse(messages_answer.paused(call, outcome, sent))
        response = await self._answer(forward, call, request, outcome)
        if isinstance(response, StreamingResponse):
            return _events(messages_answer.stream(chat_chunks(response.body_iterator), call, outcome, sent))
        return JSONResponse(messages_answer.message(_json(response), call, outcome, sent))

    async def count_tokens(self, body: CountTokensRequest, request: Request) -> dict[str, int]:
        """Tokens of the prompt the model would see for this request, by its chat template."""
        call = self._served(await asyncio.to_thread(wire_messages.to_chat, body, None))
        model = str(call.body["model"])
        counter, limits = self._counter(model, tenant_of(request)), self._limits.get(model)
        raw, tools = call.body["messages"], call.body.get("tools")
        with call.naming_fields():  # a prompt no model call could take is not counted to the end
            _, _, tokens = await asyncio.to_thread(counted, raw, tools, counter, None, limits)
        return {"input_tokens": tokens}

    def _served(self, call: ChatCall) -> ChatCall:
        """The call for the hosted model its name or alias names, with the operator's default compaction entry
        (default_compaction, by name or model) when it sends none: every chat and Messages turn, and a Responses
        compaction_trigger (Codex compacts in-band, so its turns get no threshold of the server's)."""
        served = call.body.get("model")
        if not isinstance(served, str):
            return call
        model = self._aliases.get(served, served)
        body = {**call.body, "model": model}
        default = self._default_entry(served, model)
        in_band = call.wire != "responses" or call.compact_now
        if default is not None and CONTEXT_MANAGEMENT not in body and in_band:
            body[CONTEXT_MANAGEMENT] = [default]
        return replace(call, body=body)

    def _default_entry(self, served: str, model: str) -> dict[str, Any] | None:
        """The operator's default_compaction entry for the name a request sent, else for the model it stands for."""
        return self._defaults.get(served) or self._defaults.get(model)

    def _compact_options(self, body: CompactResponsesRequest, served: str) -> CompactionOptions:
        """The request's options, else (none sent: the Agents SDK's) its model's default_compaction entry's."""
        default = self._default_entry(served, body.model)
        if default is None or body.model_fields_set & set(CompactionOptions.model_fields):
            return body.options()
        entry = parse_context_management([default], f"default_compaction.{served}")
        return body.options() if entry is None else entry.options()

    def _window(self, model: str) -> int:
        if model not in self._windows:
            raise UnknownModel("model", f"unknown model {model!r}; this service hosts {sorted(self._windows)}")
        return self._windows[model]

    async def _prepare(
        self, call: ChatCall, wire: Wire, request: Request
    ) -> tuple[dict[str, Any], TurnCompaction | None]:
        """The chat request to send the model (compacted if the entry asks) and the turn's compaction outcome."""
        model = str(call.body.get("model"))
        window = self._window(model)
        tenant = tenant_of(request)
        counter = self._counter(model, tenant)
        await self._replies.handed(call.session)
        with call.naming_fields():
            return await prepare_turn(
                call.body,
                call.session,
                counter,
                window,
                self._turn,
                wire,
                tenant,
                force=call.compact_now,
                limits=self._limits.get(model),
            )

    async def _answer(
        self, forward: dict[str, Any], call: ChatCall, request: Request, outcome: TurnCompaction | None
    ) -> Response:
        """ray.serve.llm's chat completion of `forward` within the model window (serving.turns.fit), on the
        session's replica; the reply goes to the session's coordinator when the turn's run awaits it."""
        model = str(forward.get("model"))
        budget = self._reply_budgets.get(model)
        forward = await asyncio.to_thread(fit, forward, self._tokenizer(model), self._window(model), budget)
        tenant = tenant_of(request)
        salt = tenant.salted(forward.get("cache_salt") if isinstance(forward.get("cache_salt"), str) else None)
        try:
            chat = ChatRequest.model_validate({**forward, "cache_salt": salt} if salt else forward)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise InvalidInput(field_path(("body", *first["loc"])), f"{first['msg']} (in the chat request)") from exc
        response = await self._chat_on_a_live_replica(chat, _for_replica(request, call.session))
        counter = self._counter(str(forward.get("model")), tenant)
        awaits = outcome.reply_for if outcome is not None and call.session else None

        def sent(reply: dict[str, Any] | None) -> None:
            counter.replied(call.session)  # the agent is in its tools from then
            if awaits is not None and reply is not None and call.session:
                self._replies(call.session, model, tenant.id, awaits, reply)

        return when_sent(response, sent)

    async def _reply_to(self, session: str, model: str, tenant: str, messages: int, reply: dict[str, Any]) -> None:
        """Hand a turn's reply to its session's coordinator (serving.replies)."""
        args = (model, tenant, session, messages, reply)
        await call_coordinator(self._coordinator, "chat_reply", *args, session_id=session)

    async def _chat_on_a_live_replica(self, chat: ChatRequest, request: Request) -> Response:
        """ray.serve.llm's chat, sent again when the replica died before its first token (a turn has no side
        effects): Serve's router drops the dead replica and the turn goes to a live one. A death after the
        first token ends the stream; the client sees it cut short."""
        for attempt, pause in enumerate(REPLICA_BACKOFF_S):
            try:
                return await super().chat(chat, request)
            except (RayActorError, ActorUnavailableError) as exc:
                logger.warning("a model replica was lost before answering (attempt %d): %r", attempt + 1, exc)
                await asyncio.sleep(pause)
        raise BackendError("no model replica could answer this turn right now; retry after the Retry-After seconds")

    def _tokenizer(self, model: str) -> HFChatTokenizer:
        self._window(model)
        if model not in self._tokenizers:
            self._tokenizers[model] = HFChatTokenizer.from_path(self._tokenizer_sources[model])
        return self._tokenizers[model]

    def _counter(self, model: str, tenant: Tenant) -> PromptCounter:
        """The tenant's prompt counter of `model` (one tenant's sessions never evict or skew another's)."""
        if (tenant.id, model) not in self._counters:
            tokenizer = self._tokenizer(model)
            self._counters[(tenant.id, model)] = PromptCounter(tokenizer, tokenizer.special_tokens)
        return self._counters[(tenant.id, model)]

    async def _turn(self, turn: ChatTurn) -> TurnCompaction:
        """The coordinator's decision for a turn, on the replica the session hashes to (retried on a live one)."""
        outcome = await call_coordinator(
            self._coordinator, "chat_turn", turn, session_id=turn.session_id, suspects=self._suspects
        )
        assert isinstance(outcome, TurnCompaction)
        return outcome

    async def healthz(self) -> dict[str, Any]:
        """Ready when a coordinator answers and every model has a running replica."""
        try:
            replicas = await asyncio.wait_for(call_coordinator(self._coordinator, "replicas"), timeout=10)
        except TimeoutError as exc:
            raise BackendError("the compaction coordinator is not answering within 10 s") from exc
        starting = sorted(name for name, count in replicas.items() if count == 0)
        if starting:
            raise BackendError(f"no running replica yet for {starting}; the models are starting or failed")
        return {"status": "ok", "models": sorted(replicas), "replicas": replicas}


def _header_session(request: Request) -> str | None:
    return checked_session(request.headers.get(SESSION_HEADER), SESSION_HEADER)


def _json(response: Response) -> dict[str, Any]:
    payload = json.loads(bytes(response.body))
    return payload if isinstance(payload, dict) else {}


def _events(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


def _for_replica(request: Request, session: str | None = None) -> Request:
    """The request as the model replica sees it: no credentials (the key stays in the ingress), x-session-id set
    to `session` (the model call's replica affinity reads that header)."""
    dropped = {b"authorization", b"x-api-key", *((SESSION_HEADER.encode(),) if session else ())}
    headers = [(k, v) for k, v in request.scope["headers"] if k.lower() not in dropped]
    session_header = [(SESSION_HEADER.encode(), session.encode())] if session else []
    return Request({**request.scope, "headers": [*headers, *session_header]}, request.receive)


def compaction_routes() -> dict[str, Any]:
    return {
        "compact": lambda app: app.post(
            "/v1/compact", response_model=ServiceResult, summary="Compact a conversation history"
        ),
        "responses": lambda app: app.post("/v1/responses", summary="OpenAI Responses, with compaction items"),
        "responses_compact": lambda app: app.post(
            "/v1/responses/compact", summary="OpenAI Responses compaction: a compaction item for the input"
        ),
        "messages": lambda app: app.post("/v1/messages", summary="Anthropic Messages, with the compaction beta"),
        "count_tokens": lambda app: app.post("/v1/messages/count_tokens", summary="Anthropic Messages token count"),
        "healthz": lambda app: app.get("/healthz", summary="Liveness of the ingress and the coordinator"),
    }


def make_ingress(
    max_request_bytes: int,
    tenancy: TenancyConfig | None = None,
    cors_origins: Sequence[str] = (),
    archive: ArchiveConfig | None = None,
) -> type:
    """The ingress class, bound to a FastAPI app with the error table, size limit, tenants and auth (the keys
    are read where the app runs), CORS only for `cors_origins`, and the archive's MCP endpoint at /mcp."""
    app: FastAPI = openai_app(
        "Parallel context compaction",
        "POST /v1/compact compacts an agent's history with parallel chunk summaries; the OpenAI "
        "endpoints serve the agent's own turns on the same replicas.",
    )
    install_error_handlers(app)
    app.add_middleware(BodyGuard, max_bytes=max_request_bytes)
    app.add_middleware(TenantGate, config=tenancy or TenancyConfig())
    app.add_middleware(AnthropicErrors)
    allow_origins(app, cors_origins)  # outermost: a preflight carries no key
    app.add_api_websocket_route("/v1/responses", refuse_websocket)
    app.router.routes.append(Route("/mcp", RecallEndpoint(archive or ArchiveConfig())))
    return make_fastapi_ingress(CompactionIngress, endpoint_map={**openai_routes(), **compaction_routes()}, app=app)

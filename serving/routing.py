"""Where the chunk prompts of one compaction go: a cost model, and the routing keys that realise it.

Pure: no Ray import. The request router (`serving.ray_router.SessionRouter`) reads the keys.

Replicas and sessions
    Every replica set forms a consistent-hash ring (Ray Serve's `ConsistentHashRouter`). A
    session's *home* is the first replica of its ring walk: the agent's own
    `/v1/chat/completions` turns with `x-session-id: S` land there, so its prefix cache holds the
    session's rendered history. Walking on from home gives slots 1, 2, ...: a deterministic order
    of the other replicas that every router process agrees on.

Cost model (per compaction, for each candidate placement)
    For replica j with the chunk prompts P_j (in chunk order) and the history prefix c_j it is
    assumed to hold (home: the session's history up to its last message; others: nothing):

        new_j   = sum over p in P_j of len(p) - reuse(p), where reuse(p) is the longest of
                  min(c_j, history prefix of p) and the common prefix of p with the previous prompt
                  on j, rounded down to whole cache blocks (vLLM reuses full blocks only)
        time_j  = new_j / prefill_tokens_per_s + D * decode_step_s * (1 + batch_growth * (|P_j| - 1))
        cost    = max_j time_j (replicas work in parallel); work = sum_j new_j

    with D the summary budget (decode steps). Candidates:
      - pinned: every prompt on home. Least prefill: the prompts share one prefix chain and home
        already holds the history. Best when prefill dominates.
      - spread: the chunks cut into S = min(replicas, chunks) contiguous ranges; the last range
        (the longest prompts) on home, earlier ranges on slots 1..S-1. Each replica decodes fewer
        sequences, but the others must prefill their ranges' prefixes again. Best when decode
        dominates (large D, many chunks, a steep batch_growth) or the layout has no shared prefix.
    `auto` takes spread only when its estimate beats pinned by `tie_margin` (it always does more
    total prefill work). The estimates and the choice are returned in `Placement`; the prefill
    actually done is what the engine reports (stats), never this estimate.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PlacementMode = Literal["auto", "pinned", "spread", "round_robin"]
KEY_PREFIX = "pc1"


@dataclass(frozen=True)
class RouteKey:
    """A placement request for one prompt, carried to the router as the request's session id."""

    session: str | None  # consistent-hash key; None asks for round robin
    slot: int = 0  # rank in the session's ring walk: 0 is its home replica
    avoid: tuple[str, ...] = ()  # replicas that already failed this prompt

    def encode(self) -> str:
        return f"{KEY_PREFIX}:{self.slot}:{','.join(self.avoid)}:{self.session or ''}"

    @classmethod
    def decode(cls, raw: str | None) -> RouteKey | None:
        """The key inside a session id, or None for a plain session id (an agent's own turns)."""
        if not raw or not raw.startswith(KEY_PREFIX + ":"):
            return None
        parts = raw.split(":", 3)
        if len(parts) != 4 or not parts[1].isdigit():
            return None
        avoid = tuple(a for a in parts[2].split(",") if a)
        return cls(parts[3] or None, int(parts[1]), avoid)

    def avoiding(self, replica: str | None) -> RouteKey:
        if replica is None or replica in self.avoid:
            return self
        return replace(self, avoid=(*self.avoid, replica))


def order_replicas(walk: Sequence[str], key: RouteKey) -> list[str]:
    """Replicas to try for `key`, best first: the walk rotated to the key's slot, failed ones dropped.

    If every replica has failed the prompt, all are offered again (the failure may have passed).
    """
    if not walk:
        return []
    start = key.slot % len(walk)
    rotated = [*walk[start:], *walk[:start]]
    healthy = [r for r in rotated if r not in key.avoid]
    return healthy or rotated


def history_key(token_ids: Sequence[int], block_size: int) -> str:
    """A session key for a compaction without a session id: the same history start, the same home."""
    head = ",".join(map(str, token_ids[: 2 * block_size]))
    return "history-" + hashlib.sha256(head.encode()).hexdigest()[:16]


class CostModel(BaseModel):
    """Per-model speed figures the placement decision uses (estimates; the stats report real work)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    prefill_tokens_per_s: float = Field(
        350.0, gt=0, le=1e7, description="Prompt tokens one replica computes per second (vLLM-CPU SmolLM2: ~350)."
    )
    decode_step_s: float = Field(
        0.03, gt=0, le=10, description="Seconds per decode step of a single sequence on one replica."
    )
    batch_growth: float = Field(
        0.05, ge=0, le=10, description="Extra fraction of a decode step per additional sequence in the batch."
    )
    tie_margin: float = Field(
        0.1, ge=0, le=1, description="Spread is chosen only when estimated this fraction faster than pinned."
    )


@dataclass(frozen=True)
class PromptShape:
    """What the cost model needs of one chunk prompt."""

    token_ids: Sequence[int]  # the whole prompt (a tuple; the simulator passes a cheaper sequence)
    history_prefix: int  # leading tokens identical to the session's rendered history


class Estimate(BaseModel):
    model_config = ConfigDict(frozen=True)
    replicas: int = Field(description="Replicas the candidate uses.")
    new_prefill_tokens: int = Field(description="Prompt tokens the model expects to compute (not from cache).")
    seconds: float = Field(description="Estimated wall time: the slowest replica's prefill plus decode.")


class Placement(BaseModel):
    """The routing decision of one compaction, returned in its stats."""

    model_config = ConfigDict(frozen=True)
    requested: PlacementMode = Field(description="The placement the caller asked for.")
    kind: Literal["pinned", "spread", "round_robin"] = Field(description="What was done.")
    reason: str = Field(description="Why, in words, with the estimates.")
    session: str | None = Field(description="Consistent-hash key of the compaction (its home replica).")
    replicas_available: int = Field(description="Running replicas of the model when the compaction started.")
    assumed_cached_tokens: int = Field(description="History tokens the home replica was assumed to hold.")
    slots: list[int] = Field(description="Ring slot of each chunk (0 = home); unused (0) for round robin.")
    estimates: dict[str, Estimate] = Field(description="Cost-model estimates of the candidates.")

    def routes(self) -> list[str | None]:
        """One routing key per chunk for `Compactor.run`."""
        if self.kind == "round_robin":
            return [RouteKey(None).encode() for _ in self.slots]
        return [RouteKey(self.session, slot).encode() for slot in self.slots]


def common_prefix(a: Sequence[int], b: Sequence[int], known: int = 0) -> int:
    """Length of the common prefix of a and b, given that the first `known` tokens agree."""
    lo, hi = min(known, len(a), len(b)), min(len(a), len(b))
    while lo < hi:  # invariant: a[:lo] == b[:lo]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def new_prefill_tokens(prompts: Sequence[PromptShape], cached: int, block_size: int) -> int:
    """Prompt tokens one replica must compute for `prompts`, holding `cached` history tokens."""
    total = 0
    previous: PromptShape | None = None
    for p in prompts:
        reuse = min(cached, p.history_prefix)
        if previous is not None:
            known = min(previous.history_prefix, p.history_prefix)
            reuse = max(reuse, common_prefix(previous.token_ids, p.token_ids, known))
        reuse = min(reuse, len(p.token_ids) - 1) // block_size * block_size
        total += len(p.token_ids) - reuse
        previous = p
    return total


def contiguous_slots(chunks: int, replicas: int) -> list[int]:
    """Slot of each chunk when spreading: S contiguous ranges, the last range on slot 0 (home)."""
    ranges = max(1, min(replicas, chunks))
    base, extra = divmod(chunks, ranges)
    slots: list[int] = []
    for r in range(ranges):
        slots += [ranges - 1 - r] * (base + (1 if r < extra else 0))
    return slots


def estimate(
    prompts: Sequence[PromptShape], slots: Sequence[int], cached: int, max_tokens: int, block: int, cost: CostModel
) -> Estimate:
    by_slot: dict[int, list[PromptShape]] = {}
    for p, slot in zip(prompts, slots, strict=True):
        by_slot.setdefault(slot, []).append(p)
    new_total, slowest = 0, 0.0
    for slot, group in by_slot.items():
        new = new_prefill_tokens(group, cached if slot == 0 else 0, block)
        decode = max_tokens * cost.decode_step_s * (1 + cost.batch_growth * (len(group) - 1))
        new_total += new
        slowest = max(slowest, new / cost.prefill_tokens_per_s + decode)
    return Estimate(replicas=len(by_slot), new_prefill_tokens=new_total, seconds=round(slowest, 3))


@dataclass(frozen=True)
class PlacementInput:
    """Everything the decision looks at."""

    prompts: tuple[PromptShape, ...]  # the chunk prompts, in chunk order
    session: str  # consistent-hash key (the caller's session id, or a key of the history)
    has_session: bool  # the caller named a session, so its home is assumed to hold the history
    assumed_cached_tokens: int  # history tokens home is assumed to hold when has_session
    replicas: int  # running replicas of the model
    max_tokens: int  # decode budget per chunk
    block_size: int  # prefix-cache block of the engine


def place(inp: PlacementInput, mode: PlacementMode, cost: CostModel) -> Placement:
    """Decide where each chunk prompt goes (see the module docstring for the model)."""
    n = len(inp.prompts)
    cached = inp.assumed_cached_tokens if inp.has_session else 0
    pinned_slots = [0] * n
    spread_slots = contiguous_slots(n, inp.replicas)
    estimates = {"pinned": estimate(inp.prompts, pinned_slots, cached, inp.max_tokens, inp.block_size, cost)}
    if len(set(spread_slots)) > 1:
        estimates["spread"] = estimate(inp.prompts, spread_slots, cached, inp.max_tokens, inp.block_size, cost)

    def made(kind: Literal["pinned", "spread", "round_robin"], slots: list[int], reason: str) -> Placement:
        return Placement(
            requested=mode, kind=kind, reason=reason, session=inp.session, replicas_available=inp.replicas,
            assumed_cached_tokens=cached, slots=slots, estimates=estimates,
        )  # fmt: skip

    if n == 0:
        return made("pinned", [], "no model prompts (extractive compaction)")
    if mode == "round_robin":
        return made("round_robin", [0] * n, "round robin requested: session affinity off")
    pin, spread = estimates["pinned"], estimates.get("spread")
    if spread is None:
        why = "one chunk" if n == 1 else "one replica running"
        return made("pinned", pinned_slots, f"{why}: all prompts on the session's replica")
    summary = (
        f"pinned ~{pin.seconds:.1f} s ({pin.new_prefill_tokens} new prefill tokens) vs spread over "
        f"{spread.replicas} ~{spread.seconds:.1f} s ({spread.new_prefill_tokens} new prefill tokens)"
    )
    if mode == "pinned":
        return made("pinned", pinned_slots, f"pinned requested; {summary}")
    if mode == "spread":
        return made("spread", spread_slots, f"spread requested; {summary}")
    if spread.seconds < pin.seconds * (1 - cost.tie_margin):
        return made("spread", spread_slots, f"decode dominates: {summary}")
    return made("pinned", pinned_slots, f"prefill dominates: {summary}")

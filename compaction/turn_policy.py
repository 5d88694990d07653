"""Compaction inside an agent's own chat turns: when to compact, what a snapshot is, how results splice on.

Pure decisions (no Ray, no HTTP); `serving.turns` wires them to requests, the coordinator and replicas.

A chat request opts in with one `context_management` entry (the OpenAI Responses API's shape):
    {"type": "compaction", "compact_threshold": N, "background_threshold": M?, ...compaction options}
and the turn's rendered prompt of P tokens is handled by `decide`:
    P <= compact_threshold, no background work    -> none (or start one in the background when P > M,
                                                     or when P plus G, the most one turn of the session
                                                     grew it lately, passes N; only for an agent that
                                                     leaves the engine idle between its turns)
    P <= compact_threshold, background under way  -> none for now; the result waits for a later turn
    background result ready                       -> apply it: summary + every message after the snapshot
                                                     (at the next turn; with apply_background "threshold",
                                                     only once P > compact_threshold)
    P >  compact_threshold, background under way  -> wait for what is left of it (at the agent's priority)
    P >  compact_threshold, nothing usable        -> compact now (blocking), the current turn kept verbatim
With apply_background "rolling" the background work is chunk summaries for the chunk cache, never a result
to splice: below the threshold a run starts (as above), again each time a whole chunk's worth of history
has become final since the last (each looking one turn of G ahead), and at the last turn before the
threshold (one more turn of 1.5 G would pass it), whose run summarises the whole history, its last chunk too;
past the threshold the turn compacts as a blocking one would, taking the rolled summaries and joining the
run in flight; its kept turns start where that last run ended when that keeps at most a quarter of
keep_recent_tokens more, so it finds every chunk summarised.
The protocol is stateless: the client keeps `compaction.messages + history[replaces_through:]`.
A background snapshot is the request's whole message list; a later turn can use its result only
if its own history still starts with exactly those messages (`Snapshot.covers`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from compaction.errors import InvalidInput
from compaction.history import Message
from compaction.options import LEDGER_SHARE, CompactionOptions
from compaction.render import rendered_views
from compaction.tokenizer import ChatTokenizer

# Defaults that follow the threshold when the entry does not set them.
KEEP_RECENT_SHARE = 0.25  # the newest turns up to this share of the threshold stay verbatim (`window_threshold`)
CARRY_SHARE = 0.25  # earlier summaries are carried verbatim while within this share of compact_threshold
USER_WORDS_SHARE = 0.075  # the user's words kept verbatim: this share of compact_threshold (Codex: 20k of 272k)
LAST_ROLL_IDLE_SHARE = 0.25  # the last rolling run before the threshold needs this share of background_min_idle_s
LAST_ROLL_GROWTH = 1.5  # a rolling session's next turn may be this much longer than its longest recent one
ENTRY_TYPE = "compaction"


class ContextManagement(CompactionOptions):
    """One `context_management` entry of a chat request: thresholds plus every /v1/compact option."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["compaction"] = Field(description='The kind of context management; only "compaction".')
    compact_threshold: int = Field(
        ge=256,
        le=1_048_576,
        description="When the turn's rendered prompt passes this many tokens, the turn is answered from a "
        "compacted prompt (a finished background compaction, else one made now).",
    )
    background_threshold: int | None = Field(
        None,
        ge=128,
        le=1_048_576,
        description="With a session id: the first turn past this many tokens starts compacting its history in "
        "the background and is answered at once; the result is used when a later turn passes compact_threshold.",
    )
    keep_current_turn: bool = Field(True, description="The last user message and everything after it stay verbatim.")
    background_min_idle_s: float = Field(
        0.5,
        ge=0.0,
        le=3600.0,
        description="Background compaction starts only for a session whose recent turns came at least this "
        "long (on average) after the previous reply: the compaction runs while the agent is in its tools. An "
        "agent that sends its turns back to back leaves it no time, so its turns compact blocking. 0: always.",
    )
    apply_background: Literal["rolling", "ready", "threshold"] = Field(
        "ready",
        description="What background work is and when it is applied. rolling: past background_threshold, every "
        "chunk of B tokens older than keep_recent_tokens is summarised in the background as it becomes final, and "
        "the last turn before compact_threshold summarises all its history; the turn that passes compact_threshold "
        "compacts as a blocking compaction would, taking those summaries (so the compactions are blocking's, only "
        "the wait is shorter; a short reply blocking would summarise, at most a quarter of keep_recent_tokens, "
        "stays verbatim instead); ready: a "
        "compaction of the snapshot, applied at the session's next turn (no wait, and every later turn is "
        "answered from the shorter prompt); threshold: the same, applied only once a turn passes "
        "compact_threshold.",
    )

    @model_validator(mode="before")
    @classmethod
    def _threshold_defaults(cls, data: Any) -> Any:
        """keep_recent_tokens, carry_summary_tokens, user_words_tokens and ledger_tokens default to shares of the
        thresholds (`keep_recent_default`)."""
        if isinstance(data, dict) and isinstance(data.get("compact_threshold"), int):
            threshold = data["compact_threshold"]
            data = {
                "keep_recent_tokens": keep_recent_default(
                    threshold, data.get("background_threshold"), data.get("apply_background", "ready")
                ),
                "carry_summary_tokens": int(threshold * CARRY_SHARE),
                "user_words_tokens": int(threshold * USER_WORDS_SHARE),
                "ledger_tokens": int(threshold * LEDGER_SHARE),
                **data,
            }
        return data


def window_threshold(threshold: int, background: Any, apply_background: Any) -> int:
    """The threshold the kept window must stay under: compact_threshold for "rolling" (its compaction there is
    blocking's; its background work splices nothing), else the lower one (a spliced background result must fit
    under background_threshold)."""
    lower = isinstance(background, int) and 0 < background < threshold and apply_background != "rolling"
    return background if lower else threshold


def keep_recent_default(threshold: int, background: Any, apply_background: Any) -> int:
    """keep_recent_tokens when the entry does not set it: a quarter of its `window_threshold`."""
    return int(window_threshold(threshold, background, apply_background) * KEEP_RECENT_SHARE)


def parse_context_management(raw: Any, field: str = "context_management") -> ContextManagement | None:
    """The request's compaction entry, or None when there is none. Raises InvalidInput naming the field."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise InvalidInput(field, 'must be a list of entries such as [{"type": "compaction", "compact_threshold": N}]')
    entries = list(enumerate(raw))
    for i, entry in entries:
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind != ENTRY_TYPE:
            raise InvalidInput(f"{field}[{i}].type", f'unknown entry type {kind!r}; the one supported is "compaction"')
    if len(entries) > 1:
        raise InvalidInput(f"{field}[1]", "only one compaction entry is allowed")
    if not entries:
        return None
    try:
        entry = ContextManagement.model_validate(entries[0][1])
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise InvalidInput(f"{field}[0].{loc}".rstrip("."), first["msg"]) from exc
    _check_thresholds(entry, f"{field}[0]")
    return entry


def _check_thresholds(entry: ContextManagement, at: str) -> None:
    if entry.background_threshold is not None and entry.background_threshold >= entry.compact_threshold:
        raise InvalidInput(
            f"{at}.background_threshold",
            f"{entry.background_threshold} must be below compact_threshold ({entry.compact_threshold})",
        )
    lowest = window_threshold(entry.compact_threshold, entry.background_threshold, entry.apply_background)
    if entry.keep_recent_tokens >= lowest:
        name = "background_threshold" if lowest != entry.compact_threshold else "compact_threshold"
        raise InvalidInput(
            f"{at}.{name}",
            f"{lowest} is not above keep_recent_tokens ({entry.keep_recent_tokens}), which stay verbatim: "
            "a compaction could not bring the prompt under it; raise the threshold or keep fewer tokens",
        )


def check_window(entry: ContextManagement, window: int, reply_tokens: int, at: str = "context_management[0]") -> None:
    """compact_threshold must leave room for the reply in the model's window."""
    room = window - reply_tokens
    if entry.compact_threshold > room:
        raise InvalidInput(
            f"{at}.compact_threshold",
            f"{entry.compact_threshold} leaves no room for the reply in the model window of {window} tokens "
            f"({reply_tokens} reserved for it); use at most {max(room, 0)}",
        )


def prompt_tokens(
    messages: Sequence[Message], tokenizer: ChatTokenizer, tools: Sequence[Mapping[str, Any]] | None = None
) -> int:
    """Tokens of the prompt the model would see for these messages and this tool list: the chat template (over
    the views `compaction.render` renders from) with the tools and the generation prompt."""
    views = rendered_views(messages, tokenizer, tools)
    return len(tokenizer.encode(tokenizer.render(views, add_generation_prompt=True, tools=tools)))


def message_digests(messages: Sequence[Message]) -> list[str]:
    """One stable digest per message (null fields dropped, keys sorted)."""
    dumps = (json.dumps(m.model_dump(exclude_none=True), sort_keys=True) for m in messages)
    return [hashlib.blake2b(text.encode(), digest_size=16).hexdigest() for text in dumps]


@dataclass(frozen=True)
class Snapshot:
    """The history a background compaction summarises: the request's messages when it started."""

    length: int  # messages in the snapshot
    digest: str  # digest of those messages, in order

    @classmethod
    def of(cls, digests: Sequence[str]) -> Snapshot:
        return cls(len(digests), _chain(digests))

    def covers(self, digests: Sequence[str]) -> bool:
        """True when a history (given as message digests) still starts with exactly this snapshot."""
        return len(digests) >= self.length and _chain(digests[: self.length]) == self.digest


def _chain(digests: Sequence[str]) -> str:
    return hashlib.blake2b("".join(digests).encode(), digest_size=16).hexdigest()


Background = Literal["absent", "running", "done", "failed"]
Action = Literal["none", "start_background", "wait", "apply", "compact"]


def wants_background(tokens: int, growth: int, entry: ContextManagement, idle_s: float | None = None) -> bool:
    """Past background_threshold, or one more turn growing the prompt by `growth` would pass compact_threshold;
    and the agent leaves the engine idle: `idle_s`, its mean time between a reply and its next turn lately
    (None: not measured yet), is at least background_min_idle_s.

    The second case keeps a turn longer than the gap between the thresholds from skipping the
    background compaction (and compacting blocking on the next turn). The idle condition keeps a
    back-to-back agent from a background run that could only progress in the gaps it does not leave:
    held back behind every turn, it would finish late, from an old snapshot, and leave a larger prompt.
    """
    bg = entry.background_threshold
    busy = idle_s is not None and idle_s < entry.background_min_idle_s
    return bg is not None and not busy and (tokens > bg or tokens + growth > entry.compact_threshold)


def decide(
    tokens: int,
    entry: ContextManagement,
    background: Background,
    has_session: bool,
    growth: int = 0,
    idle_s: float | None = None,
    force: bool = False,
    fresh: int | None = None,
) -> Action:
    """What this turn does (see the module docstring). `background`: the session's usable snapshot, if any;
    `growth`: the most one turn of the session grew its prompt lately (tokens); `idle_s`: its mean idle
    time between a reply and its next turn lately (None: unknown); `force`: the client asked for a compaction
    now (Codex's compaction_trigger), as if the prompt had passed compact_threshold; `fresh`: tokens the
    prompt gained since the snapshot of the session's last background run (None: all of them)."""
    if force:
        tokens = max(tokens, entry.compact_threshold + 1)
    if entry.apply_background == "rolling":
        fresh = tokens if fresh is None else fresh
        return _rolling(tokens, entry, background, has_session, growth, idle_s, fresh)
    if background == "done" and (tokens > entry.compact_threshold or entry.apply_background == "ready"):
        return "apply"
    if tokens > entry.compact_threshold:
        return "wait" if background == "running" else "compact"
    if background in ("running", "done"):
        return "none"
    if has_session and background == "absent" and wants_background(tokens, growth, entry, idle_s):
        return "start_background"
    return "none"


def last_before_threshold(tokens: int, growth: int, entry: ContextManagement) -> bool:
    """One more turn up to LAST_ROLL_GROWTH times `growth` passes compact_threshold: a rolling run started now
    summarises the whole history, its last chunk too (`serving.background`). The margin: an agent's turns vary
    (a LoCoMo session after shorter ones is half again as long as any of the last four), and a turn that passes
    the threshold unforeseen waits for a whole blocking compaction."""
    return tokens + LAST_ROLL_GROWTH * growth > entry.compact_threshold


def _rolling(
    tokens: int, entry: ContextManagement, background: Background, has_session: bool, growth: int,
    idle_s: float | None, fresh: int,
) -> Action:  # fmt: skip
    """apply_background "rolling": past the threshold, compact as blocking would (after what the run in flight has
    left, at the agent's priority); below it, roll on once a whole new chunk has become final since the last run,
    and at every turn after which one more like it would pass the threshold, for an agent that leaves the engine
    any idle time (a quarter of background_min_idle_s): so every chunk the threshold's compaction takes is
    summarised, or in flight, when it comes (a run still in flight, another last turn's too, then goes on beside
    it, `serving.background`).
    An agent that sends its turns back to back gives such a run no gap to progress in; it would only slow that
    agent's turns."""
    if tokens > entry.compact_threshold:
        return "wait" if background == "running" else "compact"
    if not has_session or entry.background_threshold is None:
        return "none"
    some_idle = idle_s is None or idle_s >= entry.background_min_idle_s * LAST_ROLL_IDLE_SHARE
    again = background == "absent" or fresh > 0
    if last_before_threshold(tokens, growth, entry) and again and some_idle:
        return "start_background"  # the last turn before it: its run is the threshold's own work
    if background == "running" or not wants_background(tokens, growth, entry, idle_s):
        return "none"
    return "start_background" if background == "absent" or fresh >= entry.chunk_tokens else "none"


def spliced(head: Sequence[Message], replaces_through: int, messages: Sequence[Message]) -> list[Message]:
    """The prompt a compaction leaves: its head (kept messages + summary), then the request's messages after it."""
    return [*head, *messages[replaces_through:]]

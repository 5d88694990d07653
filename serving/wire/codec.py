"""The compaction item of the Responses API and block of the Messages API: the replacement context, carried.

An item carries the complete context that replaces everything before it, as chat messages: the
compacted head (summaries) plus the messages the compaction kept verbatim, up to and including the
request it answered (minus the system message the format's `instructions` / `system` make, which the
client sends with every request). It is our own encoding, not a secret, and stateless: any replica of
any service build with this codec decodes it, restarted or not.

    encoding = "pc1." + base64url(zlib(json(messages)))     (no padding)

A malformed or foreign value is refused with InvalidInput naming the field it came in.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from compaction.context_edits import Edit
from compaction.errors import InvalidInput
from compaction.history import Message, parse_messages
from serving.middleware import MAX_DEPTH, json_depth
from serving.turns import WIRE_FIELD, TurnCompaction

SESSION_HEADER = "x-session-id"
PREFIX = "pc1."
MAX_DECODED_BYTES = 16 << 20  # a decoded item may not inflate past this (a compressed bomb is refused)


@dataclass(frozen=True)
class ChatCall:
    """A request of a wire format as a chat completion body, and what its answer needs from the request."""

    body: dict[str, Any]  # the chat completion request, context_management included
    session: str | None = None  # the session id: the x-session-id header, else the format's own field
    session_field: str = SESSION_HEADER  # where the session id came from (errors name it)
    system: bool = False  # the body's first message is the one instructions / system made; items omit it
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the answer repeats
    pause: bool = False  # Messages' pause_after_compaction: an applied compaction is answered alone
    fields: dict[str, str] = field(default_factory=dict)  # chat-side field name prefix -> this format's name
    namespaces: dict[str, str] = field(default_factory=dict)  # a flattened tool's name -> its namespace (Responses)
    compact_now: bool = False  # the client asked for a compaction and nothing else (Codex's compaction_trigger)
    edits: tuple[Edit, ...] = ()  # Anthropic context edits other than compaction, applied before the turn
    thinking: tuple[int, str] = (0, "")  # thinking the request carried and dropped: assistant turns, its text
    applied_edits: tuple[dict[str, Any], ...] = ()  # the context edits applied, as Anthropic reports them
    wire: str = "chat"  # the API format the call arrived in (chat, responses, messages)

    def wire_field(self, name: str) -> str:
        """A chat-side field name (of an InvalidInput) as this format names it."""
        if name == WIRE_FIELD:
            return self.session_field
        for chat, ours in self.fields.items():
            if name == chat or name.startswith((f"{chat}.", f"{chat}[")):
                # Responses items are not one chat message each: an index into the messages names no item.
                return ours if self.wire == "responses" else ours + name[len(chat) :]
        return name

    @contextlib.contextmanager
    def naming_fields(self) -> Iterator[None]:
        """Caller errors raised inside name their field as this format names it (chat's `messages` is `input`)."""
        try:
            yield
        except InvalidInput as exc:
            raise type(exc)(self.wire_field(exc.field), exc.message) from exc

    def carried(self, forwarded: Sequence[dict[str, Any]]) -> list[Message]:
        """What a compaction item carries: the chat messages the model was sent, minus that system message."""
        return parse_messages(forwarded[1:] if self.system else forwarded)


def checked_session(value: Any, field: str) -> str | None:
    """A session id as sent (None when absent); the same check wherever it came from (header or body)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > 256 or any(ord(c) < 32 for c in value):
        raise InvalidInput(field, "a session id is a string of at most 256 printable characters")
    return value


def session_of(header: str | None, own: Any, own_field: str) -> tuple[str | None, str]:
    """The session id and its field: the x-session-id header first, then the format's own field."""
    if header:
        return checked_session(header, SESSION_HEADER), SESSION_HEADER
    return checked_session(own, own_field), own_field


def outcome_json(outcome: TurnCompaction | None) -> dict[str, Any] | None:
    """The turn's compaction outcome as the answers' extra `compaction` field (status applied|running|none,
    tokens, stall_s, source, stats); the item or block carries the messages."""
    return None if outcome is None else outcome.model_dump(mode="json", exclude={"messages", "replaces_through"})


def dumps(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Chat messages as JSON objects, null fields dropped (so they can be sent back as they are)."""
    return [m.model_dump(mode="json", exclude_none=True) for m in messages]


def encode(messages: Sequence[Message]) -> str:
    text = json.dumps(dumps(messages), ensure_ascii=False, separators=(",", ":"))
    return PREFIX + base64.urlsafe_b64encode(zlib.compress(text.encode(), 6)).decode().rstrip("=")


def item_id(encoding: str, prefix: str = "cmp_") -> str:
    """A stable id for an item: the same encoding always gets the same id."""
    return prefix + hashlib.blake2b(encoding.encode(), digest_size=12).hexdigest()


def decode(value: Any, field: str) -> list[Message]:
    """The messages an item carries. Raises InvalidInput naming `field` for anything this codec did not write."""
    if not isinstance(value, str) or not value.startswith(PREFIX):
        raise InvalidInput(
            field,
            f"not a compaction this service issued (ours start with {PREFIX!r}); send the item back exactly as "
            "it came, or drop it and send the messages it replaced",
        )
    try:
        packed = base64.urlsafe_b64decode(value[len(PREFIX) :] + "=" * (-len(value) % 4))
        inflate = zlib.decompressobj()
        text = inflate.decompress(packed, MAX_DECODED_BYTES)
        if inflate.unconsumed_tail or not inflate.eof:
            raise ValueError(f"truncated, or inflating past {MAX_DECODED_BYTES} bytes")
        if json_depth(text) > MAX_DEPTH:
            raise ValueError(f"JSON nested deeper than {MAX_DEPTH}")
        raw = json.loads(text)
    except (binascii.Error, zlib.error, ValueError) as exc:
        raise InvalidInput(field, f"malformed compaction encoding ({exc}); send the item back unchanged") from exc
    if not isinstance(raw, list) or not raw:
        raise InvalidInput(field, "the compaction encoding holds no messages; send the item back unchanged")
    try:
        return parse_messages(raw, field)
    except InvalidInput as exc:
        raise InvalidInput(field, f"the compaction encoding holds an invalid message ({exc})") from exc

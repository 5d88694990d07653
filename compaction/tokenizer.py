"""What the core needs of a model's tokenizer and chat template (`ChatTokenizer`), and its Hugging Face
implementation (transformers is imported lazily)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from compaction.errors import InvalidInput

_PROBE = "\x00PROBE\x00"


class ChatTokenizer(Protocol):
    """What the core needs from a model's tokenizer and chat template."""

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat template applied to the messages (by default without a generation prompt; `tools`: the tool
        list a chat completion hands the template)."""
        ...

    def encode_with_offsets(self, text: str, as_text: bool = False) -> tuple[list[int], list[int]]:
        """Token ids of `text` (no special tokens added) and each token's start character.

        `as_text`: control tokens spelled in `text` are tokenised as plain text, not parsed.
        """
        ...

    @property
    def control_token_ids(self) -> frozenset[int]:
        """Ids the tokenizer parses out of text by their spelling (the template's markers among them)."""
        ...

    def preamble(self, first_role: str) -> str:
        """Text the template writes before the first message's own turn when it has this role."""
        ...

    @property
    def max_token_chars(self) -> int:
        """The most characters one token of the vocabulary spells (a text of c characters takes at least
        c / max_token_chars tokens)."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def user_turn(self, content: str) -> str:
        """Text that appends a user turn holding `content`, then the assistant generation prompt."""
        ...

    @property
    def end_of_turn(self) -> str:
        """Text the template writes after a message's content to close its turn."""
        ...


class HFChatTokenizer:
    """A model's tokenizer and chat template, loaded from a local Hugging Face folder."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidInput("model", "the tokenizer has no chat template")
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise InvalidInput("model", "the tokenizer has no tokenizer.json (a fast tokenizer); convert it first")
        # Whether special tokens are parsed out of a text is state of a Rust tokenizer, which transformers sets
        # on each call: two threads (counting a turn, planning a compaction) would race for it, and a lock made
        # a small planning wait behind every call of a large one. Two copies, one per setting, never changed.
        self._parsing, self._as_text = (_copy(backend, split) for split in (False, True))
        self._preambles: dict[str, str] = {}

    @classmethod
    def from_path(cls, path: str | Path) -> HFChatTokenizer:
        """A model's tokenizer.json and tokenizer_config.json (its chat template too), from a local folder or a hub
        repo id, read with transformers' tokenizers-backed class. Not AutoTokenizer: it imports torch through the
        model config classes, which a coordinator, running no model, would hold for nothing (270 MiB and 3.5 s a
        process)."""
        if Path(path).is_dir() and not (Path(path) / "tokenizer.json").is_file():
            raise InvalidInput("model", f"{path} has no tokenizer.json (a fast tokenizer); convert it first")
        from transformers import PreTrainedTokenizerFast

        return cls(PreTrainedTokenizerFast.from_pretrained(str(path)))

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        text = self._tok.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return str(text)

    def encode_with_offsets(self, text: str, as_text: bool = False) -> tuple[list[int], list[int]]:
        (enc,) = (self._as_text if as_text else self._parsing).encode_batch([text], add_special_tokens=False)
        return list(enc.ids), [start for start, _ in enc.offsets]

    @cached_property
    def control_token_ids(self) -> frozenset[int]:
        """The special added tokens: the tokenizer parses their spelling out of any text unless told not to."""
        return frozenset(i for i, token in self._tok.added_tokens_decoder.items() if token.special)

    @cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry as the tokenizer spells it: one symbol per byte for byte-level BPE,
        "<0x41>" for a byte fallback, never fewer than the characters the token stands for."""
        return max(len(token) for token in self._tok.get_vocab())

    def encode(self, text: str) -> list[int]:
        (enc,) = self._parsing.encode_batch([text], add_special_tokens=False)  # the batch call releases the GIL
        return list(enc.ids)

    @cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The text of every special token (role markers, end of turn, end of text)."""
        return tuple(str(t) for t in getattr(self._tok, "all_special_tokens", ()))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def chat_prompt_tokens(self, views: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> int:
        """Tokens of the prompt a chat completion of `views` (chat views) with `tools` prefills: the template with
        its tool list and generation prompt, as vLLM's chat endpoint renders it."""
        return len(self.encode(self.render(views, add_generation_prompt=True, tools=tools)))

    @cached_property
    def _turn_parts(self) -> tuple[str, str, str]:
        """(end of a turn, text before a user turn's content, text after it incl. the generation prompt)."""
        system = [{"role": "system", "content": _PROBE}]
        closed = self.render(system)
        end_of_turn = closed[closed.index(_PROBE) + len(_PROBE) :]
        both = self.render([*system, {"role": "user", "content": _PROBE}], add_generation_prompt=True)
        if not both.startswith(closed):
            raise InvalidInput("model", "the chat template does not append a user turn after a history")
        before, after = both[len(closed) :].split(_PROBE)
        return end_of_turn, before, after

    def preamble(self, first_role: str) -> str:
        """Text the template writes before the first message's own turn (e.g. a default system prompt)."""
        if first_role not in self._preambles:
            probe = {"role": first_role, "content": _PROBE}
            system = [{"role": "system", "content": _PROBE}]
            closed, after = self.render(system), self.render([*system, probe])
            head = after[len(closed) :].split(_PROBE)[0] if after.startswith(closed) else None
            before = self.render([probe]).split(_PROBE)[0]
            if head is None or not before.endswith(head):
                raise InvalidInput("model", f"the chat template does not open a {first_role} turn the same way twice")
            self._preambles[first_role] = before[: len(before) - len(head)]
        return self._preambles[first_role]

    @property
    def end_of_turn(self) -> str:
        return self._turn_parts[0]

    def user_turn(self, content: str) -> str:
        _, before, after = self._turn_parts
        return f"{before}{content}{after}"


def _copy(backend: Any, split_special_tokens: bool) -> Any:
    """A copy of a Rust tokenizer that encodes special tokens' spelling as text (True) or parses it (False)."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = split_special_tokens
    return copy

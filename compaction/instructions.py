"""The instruction text that goes at the tail of every compaction prompt.

Instructions never precede the history: anything per-chunk before the history would break
prefix reuse from the first token. The tail names the target, the variant and the budget.
"""

from __future__ import annotations

from compaction.options import CompactionOptions, Layout, Variant

_VARIANTS: dict[Variant, str] = {
    "concise": "Summarise {target} in a few short sentences.",
    "default": (
        "Summarise {target}. Keep the facts that may matter later: who said or did what, names, dates, "
        "places, numbers, decisions and open tasks."
    ),
    "detailed": (
        "Write a detailed summary of {target}. Keep every fact in order: who said or did what, names, "
        "dates, places, numbers, decisions, plans and open tasks."
    ),
}

# The retry of an empty, runaway or ungrounded summary.
_STRICT = (
    "Write plain sentences and never repeat a sentence. Use only names, numbers, file paths, commands and "
    "quotes that appear in the conversation above, copied exactly; add nothing that is not there."
)


def target_phrase(layout: Layout | None, index: int, opening: str) -> str:
    """How the tail names what to summarise. `layout` None means the sequential whole-history prompt."""
    if layout is None:
        return "the conversation above"
    # No chunk count here: the tail of chunk k must not change when the history grows by more chunks,
    # or its summary could not be reused by the next compaction (compaction.chunk_cache).
    part = f"part {index + 1} of the conversation above"
    if layout in ("prefix_exact", "windowed", "auto"):
        return (
            f"{part}: only the last part, which begins with “{opening}” and runs to the end. "
            "The earlier parts are context only; do not summarise them"
        )
    if layout == "prefix_exact_marked":
        return (
            f"{part}: only the text inside the last <segment> and </segment> markers. "
            "The earlier segments are context only; do not summarise them"
        )
    if layout in ("paper", "shared_full"):
        return "the text between <target> and </target> above. The rest is context only; do not summarise it"
    return "the conversation excerpt above"


def caller_instructions(options: CompactionOptions, index: int) -> str | None:
    """The caller's own instructions for chunk `index`: its chunk_instructions entry, then `instructions`."""
    parts = [(options.chunk_instructions or {}).get(index), options.instructions]
    return " ".join(p.strip() for p in parts if p and p.strip()) or None


def words_for(max_tokens: int) -> int:
    """A word budget the model can follow, from a token budget (about 0.6 words per token of headroom)."""
    return max(5, int(max_tokens * 0.6))


def instruction_text(
    variant: Variant,
    target: str,
    max_tokens: int,
    extra: str | None = None,
    strict: bool = False,
    content: str | None = None,
) -> str:
    """The user-turn content of a compaction tail; `content`: the instructions chosen for the chunk's content."""
    parts = [_VARIANTS[variant].format(target=target), f"Use at most {words_for(max_tokens)} words."]
    if strict:
        parts.append(_STRICT)
    if content:
        parts.append(content)
    if extra:
        parts.append(extra.strip())
    parts.append("Write only the summary.")
    return " ".join(parts)

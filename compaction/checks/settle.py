"""What text is kept for one chunk: the checks of its model summaries, the retry rule, the fallbacks.

Every attempt is judged (empty, runaway, an echo of its prompt's instructions) and checked for
grounding. A chunk whose first summary fails either check is retried once with a stricter tail (an
echo only where no agent waits for the chunk: the background's; one waited for keeps its extractive
text at once). Of the attempts, the best is kept; then nothing bad reaches the output: an empty
summary becomes the chunk's text (nothing lost), a runaway keeps each sentence once, an echo or a
summary below the grounding threshold becomes the chunk's extractive summary, and a grounded-enough
one loses the sentences that state invented tokens or restate the instructions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from compaction.backend import Generation
from compaction.checks.grounding import Grounding, Source, prune
from compaction.checks.quality import Verdict, collapse_repeats, drop_instructions, judge
from compaction.options import CompactionOptions
from compaction.result import ChunkStatus


@dataclass(frozen=True)
class Attempt:
    """One model summary of a chunk and its two checks."""

    generation: Generation  # what the backend returned
    verdict: Verdict  # ok, empty, runaway or echo
    grounding: Grounding  # its salient tokens against the chunk's source
    instructions: str = ""  # the prompt's tail: sentences restating it are no summary

    @classmethod
    def of(cls, generation: Generation, source: Source, instructions: str = "") -> Attempt:
        text = generation.text.strip()
        verdict = judge(text, generation.finish_reason, instructions=instructions)
        return cls(generation, verdict, source.check(text), instructions)

    def grounded(self, threshold: float) -> bool:
        return threshold == 0 or self.grounding.score >= threshold

    def good(self, options: CompactionOptions) -> bool:
        """Keep without a retry: not empty or looping (unless decode is forced) and grounded enough."""
        return (self.verdict == "ok" or options.fixed_output_tokens) and self.grounded(options.grounding_threshold)


def should_retry(attempts: Sequence[Attempt], options: CompactionOptions, echo: bool = True) -> bool:
    """A second, stricter attempt: only after a bad first one, and never in matched-decode benchmarks. `echo`
    False: a first summary that only restated its instructions is not retried (an agent waits for the chunk, and
    its extractive text is as good a fallback as a second asking, at no wait)."""
    first = attempts[0] if len(attempts) == 1 else None
    return (
        first is not None
        and not first.good(options)
        and (echo or first.verdict != "echo")
        and options.retry_bad_summaries
        and not options.fixed_output_tokens
    )


@dataclass(frozen=True)
class Settled:
    """The text kept for a chunk and how it came about."""

    text: str  # what is merged into the summary
    status: ChunkStatus  # see ChunkStats.status
    dropped_sentences: int  # sentences removed for stating invented tokens
    grounding: Grounding  # the kept text checked against the source


def _best(attempts: Sequence[Attempt], threshold: float) -> Attempt:
    """The attempt to keep: usable over empty or looping, grounded over not, then the higher score; ties go late."""
    return max(
        reversed(attempts),
        key=lambda a: (a.verdict == "ok", a.verdict != "empty", a.grounded(threshold), a.grounding.score),
    )


def settle(
    attempts: Sequence[Attempt],
    options: CompactionOptions,
    source: Source,
    verbatim: Callable[[], str],
    extractive: Callable[[], str],
) -> Settled:
    """The kept text of a chunk from its attempts. `verbatim` and `extractive` give the chunk's fallbacks;
    sentences restating the kept attempt's instructions are dropped, and a summary that was nothing else
    falls back to the extractive text."""
    threshold = options.grounding_threshold
    best = _best(attempts, threshold)
    text, echoed = drop_instructions(best.generation.text.strip(), best.instructions)
    if echoed and not text:
        fallback = extractive()
        return Settled(fallback, "extractive_fallback", echoed, source.check(fallback))
    status: ChunkStatus = "ok" if len(attempts) == 1 else "retried"
    if options.fixed_output_tokens:
        pass  # matched-decode benchmarks keep what the model wrote; only the grounding check applies
    elif best.verdict == "empty":
        raw = verbatim()
        return Settled(raw, "kept_verbatim", 0, source.check(raw))
    elif best.verdict == "runaway":
        text, status = collapse_repeats(text), "runaway_trimmed"
    dropped = echoed
    if threshold > 0:
        checked = source.check(text)
        if checked.score >= threshold and checked.ungrounded:
            text, dropped = prune(text, checked.ungrounded)
        if checked.score < threshold or not text:
            fallback = extractive()
            return Settled(fallback, "extractive_fallback", 0, source.check(fallback))
    return Settled(text, status, dropped, source.check(text))

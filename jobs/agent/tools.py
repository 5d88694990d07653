"""How long an agent spends in its tools between two model calls: the idle engine time background compaction uses.

Real coding agents run a tool after most model calls. The default model is fitted to the SyFI Trace
Atlas (University of Washington, https://tracelab.cs.washington.edu/, dataset of 357k agent steps and
432k tool calls of real Claude Code and Codex sessions; code and figures at github.com/uw-syfi/TraceLab):
Codex tool calls take 626 ms at the median (tool_latency_distribution) and 418.1 h over 253k timed
calls end to end, 5.95 s on average (codex_wall_internal_gap); about 88 % finish under 10 s and 3.1 %
take over a minute. A log-normal with that median and mean has sigma = sqrt(2 ln(5.95 / 0.626)) =
2.12, which puts 90 % under 10 s and 1.6 % over a minute. Draws are capped at `cap_s` (60 s) so a
benchmark stays bounded; capped, the mean is about 4.0 s. Each turn's draw comes from a seeded
generator, so every mode of a benchmark sees the same tool times, turn by turn.

    ToolTime.parse("codex")   the fitted distribution (default)
    ToolTime.parse("5")       a fixed 5 s after every turn
    ToolTime.parse("0")       back to back, no tool time
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

CODEX_MEDIAN_S = 0.626  # SyFI Trace Atlas: Codex tool-call latency, median
CODEX_MEAN_S = 418.1 * 3600 / 253_000  # 418.1 h end to end over 253k timed Codex calls: 5.95 s
CODEX_SIGMA = math.sqrt(2 * math.log(CODEX_MEAN_S / CODEX_MEDIAN_S))
CAP_S = 60.0


@dataclass(frozen=True)
class ToolTime:
    """Seconds of tool time after each agent turn: fixed, or drawn from the Codex fit."""

    fixed_s: float | None = None  # None: the Codex log-normal
    cap_s: float = CAP_S
    seed: int = 0

    @classmethod
    def parse(cls, spec: str, seed: int = 0) -> ToolTime:
        """`codex` or a number of seconds (>= 0). Raises ValueError naming the problem."""
        text = spec.strip().lower()
        if text == "codex":
            return cls(None, seed=seed)
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"tool time must be 'codex' or a number of seconds, got {spec!r}") from None
        if not 0 <= seconds <= 3600 or math.isnan(seconds):
            raise ValueError(f"tool time must be between 0 and 3600 seconds, got {spec!r}")
        return cls(seconds, seed=seed)

    def seconds(self, turns: int) -> list[float]:
        """The tool time after each of `turns` turns, the same for every call with the same seed."""
        rng = random.Random(self.seed)
        return [self.draw(rng) for _ in range(turns)]

    def draw(self, rng: random.Random) -> float:
        """One tool time from `rng` (the fixed value, or a capped draw of the Codex fit)."""
        if self.fixed_s is not None:
            return self.fixed_s
        return min(self.cap_s, rng.lognormvariate(math.log(CODEX_MEDIAN_S), CODEX_SIGMA))

    def label(self) -> str:
        return "codex" if self.fixed_s is None else f"{self.fixed_s:g}s"

"""Agent sessions: what each turn adds to the history and when compaction runs (the run's configuration and the
streams: `jobs.sim.config`).

A session loops: wait `think_s` (tools, the user), append the next observation of its stream (a LoCoMo session or a
HotpotQA paragraph per turn, as `jobs.data.episodes` builds them, counted in tokens), then send one turn (prompt =
the history, `answer_tokens` out) to its home replica. What each turn does about compaction is the service's own
rule (`compaction.turn_policy.decide`, over the entry `SimConfig.entry` builds, with the session's recent growth
and idle time as the service measures them):
  - blocking: the turn whose prompt passes `tau` waits for the whole compaction of the history;
  - background: a turn past `background_share x tau` (or one turn's growth short of `tau`), of an agent that leaves
    the engine idle, starts compacting that snapshot at background priority (`yielding`: its prompts prefill only
    while the replica runs no agent request) and goes on at once; when it is done, its compacted prompt is
    prefilled on the home replica at background priority too (`warm`), and the session's next turn continues from
    the summary plus everything after the snapshot (`apply_background` "ready"; "threshold": only the turn passing
    `tau`). The turn passing `tau` while it still runs raises it to the agent's priority and waits only for the
    rest. A refused background run leaves the turn past `tau` to compact blocking;
  - rolling (`apply_background` "rolling"): whole chunks are summarised as they become final and the turn past
    `tau` compacts as blocking does, taking them (`Session._compact_rolling`).
A refused blocking compaction (429) is retried after `retry_after_s`; the wait counts as stall.
"""

from __future__ import annotations

import random
from collections.abc import Generator, Hashable
from dataclasses import dataclass, field
from typing import Any, cast

import simpy

from compaction.pacing import AGENT, BACKGROUND
from compaction.partition import partition
from compaction.plan import PREFER_SLACK_SHARE
from compaction.turn_policy import Background, decide, last_before_threshold, wants_background
from jobs.agent.tools import ToolTime
from jobs.sim.cluster import Cluster, CompactionJob, CompactionOutcome, JobKind
from jobs.sim.config import SUMMARY_HEADER_TOKENS, SimConfig
from jobs.sim.engine import Request
from jobs.sim.shapes import ChunkTokens, prompt_lengths

CODEX = ToolTime()  # the Codex fit of jobs.agent.tools
GENERATION_PROMPT_TOKENS = 3  # "<|im_start|>assistant\n": opens the answer, stays in the history
END_OF_TURN_TOKENS = 2  # "<|im_end|>\n" after the answer
RECENT_TURNS = 4  # the turns whose growth and idle time the service weighs (serving.turns.RECENT_TURNS)


@dataclass
class _Background:
    """A session's background run: a compaction (then, with `warm`, its compacted prompt prefilled), or (rolling)
    chunk summaries for the threshold's compaction to take."""

    job: CompactionJob
    snapshot: int  # history tokens when it started
    cut: tuple[int, int]  # where its span starts, where the tail it keeps verbatim starts
    compaction: simpy.Process
    ready: simpy.Process  # done when the result may be applied without waiting
    last: bool = False  # rolling: the last run before the threshold (the reply to its turn is rolled after it)


@dataclass
class Recorder:
    """Per-run tallies the sessions write."""

    stalls: list[float] = field(default_factory=list)  # agent-visible wait per compaction
    session_s: float = 0.0  # summed time sessions were active
    refused: int = 0  # compactions refused at admission
    background_used: int = 0  # tau crossings served (partly) by a background compaction or rolled chunks
    rolled_chunks: int = 0  # chunk summaries rolled in the background (apply_background "rolling")
    rolled_taken: int = 0  # of them, taken by a compaction at the threshold (done, or joined in flight)
    ended_s: list[float] = field(default_factory=list)  # scripted sessions: when each played its last turn
    compacted_at: list[int] = field(default_factory=list)  # scripted sessions: the turns that compacted


@dataclass(frozen=True)
class Script:
    """A session played turn by turn instead of drawn (the validation replays of `jobs.bench.agent`): what each turn
    adds to the history, the tool time after it, and the tokens its answer decodes."""

    observations: tuple[int, ...]
    gaps: tuple[float, ...]  # tool time before each turn (the first: before the first)
    answers: tuple[int, ...]


class Session:
    """One agent: its history (where each turn starts, the summaries carried at its head), its chain in the cache,
    its background run and, rolling, the chunk summaries rolled for its next compaction."""

    def __init__(
        self,
        index: int,
        config: SimConfig,
        cluster: Cluster,
        stream: tuple[int, ...],
        rng: random.Random,
        script: Script | None = None,
    ):
        self.id = f"session-{index}"
        self.config, self.cluster, self.stream, self.rng, self.script = config, cluster, stream, rng, script
        self.entry = config.entry()
        self.epoch = 0
        self.position = rng.randrange(len(stream))
        start = rng.uniform(0, config.tau * 0.95) if config.warm_start and script is None else 0.0
        self.tokens = config.system_tokens + int(start)
        self.head = config.system_tokens  # the system prompt and the summaries carried verbatim
        self.starts: list[int] = [self.head] if start else []  # where each turn's user message starts
        self.background: _Background | None = None
        self.follow: simpy.Process | None = None  # rolling: the run of the last turn's history with its reply
        self.rolled: dict[tuple[int, int, bool], tuple[CompactionJob, int]] = {}  # (start, end, ends span) -> prompt
        self.growths: tuple[int, ...] = ()  # how much each of its last turns grew the prompt (as the ingress counts)
        self.gaps: tuple[float, ...] = ()  # its last idle times between a reply and the next turn
        self.retries = random.Random(f"retries-{config.seed}-{index}")  # which chunk prompts are asked again

    @property
    def namespace(self) -> Hashable:
        return (self.id, self.epoch)

    def cut(self, snapshot: int, keep: int, current_turn: bool = True, prefer: int | None = None) -> tuple[int, int]:
        """(span start, kept tail start) of compacting the first `snapshot` tokens, as `compaction.plan.kept_ends`
        cuts it in whole turns: the summaries carried at the head stay while within carry_summary_tokens, the newest
        turns within `keep` stay verbatim (the current one always, with `current_turn`), `prefer` moves the tail's
        start back by at most a quarter of keep_recent_tokens."""
        c = self.config
        fits = self.head - c.system_tokens <= self.entry.carry_summary_tokens
        start = self.head if fits else c.system_tokens
        starts = [t for t in self.starts if start < t < snapshot]
        tail = snapshot
        for t in reversed(starts):
            if snapshot - t > keep:
                break
            tail = t
        if current_turn and starts:
            tail = min(tail, starts[-1])
        slack = c.keep_recent_tokens * PREFER_SLACK_SHARE
        if prefer is not None and start < prefer < tail and tail - prefer <= slack:
            tail = prefer
        return start, tail

    def job(
        self,
        cut: tuple[int, int],
        last_turn: int,
        priority: int = AGENT,
        kind: JobKind = "compaction",
        ahead: bool = False,
        supersedes: bool = False,
    ) -> tuple[CompactionJob, list[Request]]:
        """The compaction of `cut`'s span without the chunks rolled already (rolling), and the rolled prompts it takes
        instead (done or in flight). `kind` roll: only the chunks not rolled yet, the span's last one only when
        `ahead` (the last run before the threshold), put in `rolled` as they are sent; `supersedes` (a turn's last
        run, not its reply's): earlier last chunks from one of its chunks' starts are given up, unless raised."""
        c = self.config
        block = self.cluster.profile.block_size
        prompts = prompt_lengths(self.namespace, cut, c.options(), block, ChunkTokens(tail=c.tail_tokens))
        chunks = partition(*cut, c.chunk_tokens, block) if self._rolling() else ()
        keys = [(ch.start, ch.end, ch.end == cut[1]) for ch in chunks]
        if supersedes:
            starts = {key[0] for key in keys}
            for key in [k for k in self.rolled if k[2] and k[0] in starts and k not in keys]:
                request = self._rolled(key)
                if request is None or request.priority > AGENT:
                    self._drop(key)
        taken = [r for key in keys if (r := self._rolled(key)) is not None]
        if not chunks:
            todo = list(range(len(prompts)))
        elif kind == "compaction":
            todo = [k for k, key in enumerate(keys) if self._rolled(key) is None]
        else:  # a roll: what no run has sent yet; its last chunk ends at the span's end, not at a border, unless ahead
            todo = [k for k, key in enumerate(keys) if key not in self.rolled and (ahead or k < len(keys) - 1)]
        per_chunk = max(16, c.summary_tokens // len(prompts))
        outputs = [per_chunk * (1 + (self.retries.random() < c.retry_share)) for _ in todo]  # a retry decodes again
        job = CompactionJob(
            self.id, self.namespace, [prompts[k] for k in todo], outputs,
            self.tokens - last_turn, cut[1] - cut[0], priority=priority, kind=kind,
        )  # fmt: skip
        if kind == "roll":
            self.rolled |= {keys[k]: (job, i) for i, k in enumerate(todo)}
        return job, taken if kind == "compaction" else []

    def _rolled(self, key: tuple[int, int, bool]) -> Request | None:
        job, index = self.rolled.get(key, (None, 0))
        return job.dispatched[index] if job is not None and index < len(job.dispatched) else None

    def _drop(self, key: tuple[int, int, bool]) -> None:
        """A rolled chunk no compaction will take: its prompt cancelled on its replica if in flight."""
        request = self._rolled(key)
        del self.rolled[key]
        if request is not None:
            self.cluster.replicas[request.replica].cancel(request)

    def _rolling(self) -> bool:
        c = self.config
        return c.mode == "background" and c.apply_background == "rolling" and c.strategy == "parallel"

    def applied(self, cut: tuple[int, int]) -> None:
        """A compaction of `cut` replaces its span: the new summary after the head (kept summaries included), then
        the tail verbatim."""
        head, tail = self._head_after(cut), cut[1]
        self.cluster.replicas[self.cluster.home(self.id)].cache.drop(self.namespace)
        self.starts = [head + t - tail for t in self.starts if t >= tail]
        self.tokens, self.head = head + self.tokens - tail, head
        self.epoch += 1
        for key in list(self.rolled):  # what the session's runs still have in flight is cancelled
            self._drop(key)
        self.background, self.follow = None, None

    def _head_after(self, cut: tuple[int, int]) -> int:
        """Tokens before the tail once `cut` is compacted: the system prompt, the summaries carried (when the span
        starts after them), the new summary."""
        c = self.config
        kept = self.head if cut[0] == self.head else c.system_tokens
        return kept + SUMMARY_HEADER_TOKENS + c.summary_text()

    def run(self, recorder: Recorder) -> Generator[simpy.Event, Any, None]:
        env, c = self.cluster.env, self.config
        if self.script is None:
            yield env.timeout(self.rng.uniform(0, c.ramp_s))
        recorder.session_s += max(0.0, c.duration_s - env.now)
        turns = 0
        while env.now < c.duration_s and (self.script is None or turns < len(self.script.observations)):
            think = self._think(turns)
            yield env.timeout(think)
            self.gaps = (*self.gaps, think)[-RECENT_TURNS:]
            observation, answer = self._next(turns)
            turns += 1
            self.starts.append(self.tokens)
            self.tokens += observation
            growth, idle = max(self.growths, default=0), sum(self.gaps) / len(self.gaps)
            state = self._state()
            fresh = self.tokens - self.background.snapshot if self.background is not None else None
            action = decide(self.tokens, self.entry, state, True, growth, idle, fresh=fresh)
            if action == "start_background":
                self._start_background(observation, growth, recorder)
            elif action in ("apply", "wait", "compact"):
                yield from self._compact(observation, state, recorder)
                recorder.compacted_at += [turns - 1] if self.script is not None else []
                if wants_background(self.tokens, growth, self.entry, idle):  # the compacted prompt: the next snapshot
                    self._start_background(observation, growth, recorder)
            turn = self.cluster.turn(self.id, self.namespace, self.tokens + GENERATION_PROMPT_TOKENS, answer)
            yield turn.done
            grown = observation + GENERATION_PROMPT_TOKENS + answer + END_OF_TURN_TOKENS
            self.growths = (*self.growths, grown)[-RECENT_TURNS:]
            self.tokens += GENERATION_PROMPT_TOKENS + answer + END_OF_TURN_TOKENS
            if self.background is not None and self.background.last and self.follow is None:  # the reply, rolled
                self.follow = self._start_roll(True, 0, recorder).compaction
        recorder.ended_s.append(env.now)

    def _next(self, turn: int) -> tuple[int, int]:
        """What turn `turn` adds to the history, and the tokens its answer decodes."""
        if self.script is not None:
            return self.script.observations[turn], self.script.answers[turn]
        observation = self.stream[self.position % len(self.stream)]
        self.position += 1
        return observation, self.config.answer_tokens

    def _think(self, turn: int) -> float:
        """The agent's time in its tools (or the user's) before its next turn."""
        c = self.config
        if self.script is not None:
            return self.script.gaps[turn]
        if c.tool_model == "codex":
            return CODEX.draw(self.rng)
        return self.rng.expovariate(1 / c.think_s) if c.think_s else 0.0

    def _state(self) -> Background:
        """The session's background run as the service's turn policy sees it."""
        if self.background is None:
            return "absent"
        if not self.background.ready.triggered:
            return "running"
        done = cast(CompactionOutcome, self.background.ready.value)
        return "done" if done.admitted else "failed"

    def _start_background(self, observation: int, growth: int, recorder: Recorder) -> None:
        """A background run of the history as it is now: its compaction (keeping one turn of `growth` fewer recent
        tokens: that turn stays verbatim by the time it is applied), or, rolling, the chunks of it not rolled yet."""
        c = self.config
        priority = BACKGROUND if c.yielding else AGENT
        if self._rolling():
            last = last_before_threshold(self.tokens, growth, self.entry)
            self.background, self.follow = self._start_roll(last, growth, recorder, supersedes=last), None
            return
        cut = self.cut(self.tokens, max(0, c.keep_recent_tokens - growth))
        job, _ = self.job(cut, observation, priority)
        compaction = self.cluster.env.process(self.cluster.compact(job))
        ready = self.cluster.env.process(self._warm(compaction)) if c.warm else compaction
        self.background = _Background(job, self.tokens, cut, compaction, ready)

    def _start_roll(self, last: bool, growth: int, recorder: Recorder, supersedes: bool = False) -> _Background:
        """A rolling run: the whole chunks one more turn of `growth` leaves older than keep_recent_tokens, or, `last`,
        every chunk of the history; only those not rolled yet are sent (`job`'s `supersedes`)."""
        c = self.config
        keep = 0 if last else max(0, c.keep_recent_tokens - growth)
        cut = self.cut(self.tokens, keep, current_turn=not last)
        job, _ = self.job(cut, 0, BACKGROUND if c.yielding else AGENT, "roll", ahead=last, supersedes=supersedes)
        recorder.rolled_chunks += len(job.prompts)
        if job.prompts:
            process = self.cluster.env.process(self.cluster.compact(job))
        else:  # nothing left to roll: done at once
            process = cast(simpy.Process, self.cluster.env.event().succeed(CompactionOutcome(admitted=True)))
        return _Background(job, self.tokens, cut, process, process, last)

    def _warm(self, compaction: simpy.Process) -> Generator[simpy.Event, Any, CompactionOutcome]:
        """The background result, once its compacted prompt is prefilled on the home replica (next epoch's chain)."""
        outcome = yield compaction
        if outcome.admitted and self.background is not None:
            c = self.config
            tokens = self._head_after(self.background.cut) + self.background.snapshot - self.background.cut[1]
            home, namespace = self.cluster.home(self.id), (self.id, self.epoch + 1)
            priority = BACKGROUND if c.yielding else AGENT
            warm = self.cluster.submit(home, tokens, 0, namespace, tokens, kind="warm", priority=priority)
            yield warm.done
        return outcome

    def _compact(self, observation: int, state: Background, recorder: Recorder) -> Generator[simpy.Event, Any, None]:
        env, c = self.cluster.env, self.config
        waited_from = env.now
        background, cut = self.background, None
        if self._rolling():
            yield from self._compact_rolling(observation, state, recorder)
            recorder.stalls.append(env.now - waited_from)
            return
        outcome: CompactionOutcome | None = None
        if background is not None:
            cut = background.cut
            if not background.compaction.triggered:
                self.cluster.escalate(background.job)
            outcome = yield background.compaction
            if outcome is not None and outcome.admitted:
                recorder.background_used += 1
            else:
                recorder.refused += 1
                outcome = None  # fall back to a blocking compaction now
        while outcome is None or not outcome.admitted:
            if outcome is not None:
                recorder.refused += 1
                yield env.timeout(c.retry_after_s)
            cut = self.cut(self.tokens, c.keep_recent_tokens)
            outcome = yield env.process(self.cluster.compact(self.job(cut, observation)[0]))
        recorder.stalls.append(env.now - waited_from)
        assert cut is not None
        self.applied(cut)

    def _compact_rolling(
        self, observation: int, state: Background, recorder: Recorder
    ) -> Generator[simpy.Event, Any, None]:
        """The compaction at the threshold, as blocking's (`serving.background`): the rolled chunks taken, those in
        flight raised to the agent's priority and joined, the rest computed. Without the reply's follow-up done, the
        tail kept starts where the last run ended if that keeps at most a quarter of keep_recent_tokens more."""
        env, c = self.cluster.env, self.config
        background, prefer = self.background, None
        followed = self.follow is not None and self.follow.triggered
        if background is not None and background.last and not followed and state in ("running", "done"):
            prefer = background.snapshot
        while True:
            cut = self.cut(self.tokens, c.keep_recent_tokens, prefer=prefer)
            job, taken = self.job(cut, observation)
            for request in taken:
                if request.finished != request.finished:  # in flight (finished is NaN)
                    self.cluster.replicas[request.replica].escalate(request)
            recorder.rolled_taken += len(taken)
            recorder.background_used += bool(taken)
            waits = [env.process(self.cluster.compact(job))] if job.prompts else []
            outcomes = yield simpy.AllOf(env, [*waits, *(r.done for r in taken)])
            if not waits or outcomes[waits[0]].admitted:
                break
            recorder.refused += 1
            yield env.timeout(c.retry_after_s)
        self.applied(cut)

"""The state ledger of a coding agent's session, derived from the chat history without a model.

Files read or modified, shell commands and queries with their last outcome (a failure's first error line,
or what a short output found), the errors still open, the latest task list, the user's constraints and
the agent's decisions, one line per entry. A compaction writes the
ledger verbatim in the head of the compacted history (`render`, under `LEDGER_HEADER`); the next one
reads it back (`parse`) and updates it with the messages it compacts (`derive` with `prior`), so the
ledger is anchored across a chain of compactions and never re-summarised. Later facts win: a file read
then modified is modified, a command's outcome is its last run's, a task list replaces the one before;
constraints and decisions accumulate, each once. The same messages always give the same ledger and text.

Tool shapes recognised (names case-insensitive): the generated traces' `read_file`/`edit_file`/
`run_command`; Claude Code's `Read`/`Edit`/`MultiEdit`/`Write`/`NotebookEdit`/`Bash`/`TodoWrite`; Codex
CLI's `shell`/`exec_command`/`apply_patch`/`update_plan`; OpenCode's `read`/`write`/`edit`/`bash`/
`todowrite`; and by name any tool that writes, edits, patches, creates or replaces (or reads, views,
opens) a path-like argument. Shell commands that write files (`sed -i`, `>`, `tee`, `mv`, `rm`, `touch`,
`cp`) mark them modified, best effort.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from compaction import ledger_reading as reading
from compaction.history import Message, ToolCall
from compaction.ledger_reading import ENTRY_CHARS as ENTRY_CHARS
from compaction.ledger_reading import ERROR_CHARS as ERROR_CHARS
from compaction.ledger_reading import LEDGER_HEADER, Action, CommandRun, Task
from compaction.ledger_reading import without_ledger as without_ledger

SUMMARY_HEADER = "Summary of the earlier conversation (compacted):"  # compaction.plan's, which may import this
MAX_COMMANDS = 40  # the most recent distinct commands kept (the render budget trims further)
MAX_FILES = 200  # likewise, the most recently touched files
MAX_DECISIONS = 100  # likewise, the latest decisions
FINISHED = frozenset({"completed", "complete", "done", "cancelled", "canceled"})  # task statuses trimmed first


@dataclass(frozen=True)
class FileTouch:
    path: str  # as the tool call named it
    action: Action  # "modified" once any call wrote it
    tool: str  # the last call that touched it with this action


@dataclass(frozen=True)
class Ledger:
    """One session's state; every section oldest first (a file or command moves to the end when touched again)."""

    files: tuple[FileTouch, ...] = ()
    commands: tuple[CommandRun, ...] = ()
    open_errors: tuple[CommandRun, ...] = ()  # commands whose last run failed, still failing
    tasks: tuple[Task, ...] = ()  # the latest task list, in its own order
    constraints: tuple[str, ...] = ()  # the user's rules, verbatim sentences
    decisions: tuple[str, ...] = ()  # the agent's decisions and their reasons, verbatim sentences

    def entries(self) -> list[str]:
        """Every entry line in render order (each rendered once per section it is in)."""
        return [line for _, lines in _sections(self) for line in lines]

    def is_empty(self) -> bool:
        return not any(lines for _, lines in _sections(self))


# ---- rendering and parsing -------------------------------------------------------------------------------

FILE_LINE = re.compile(r"^- (.+): (read|modified) \((.*)\)$")
RUN_LINE = re.compile(r"^- (.+?) — (passed|failed|ok|no result|exit -?\d+)(?:: (.*))?$")
TASK_LINE = re.compile(r"^- \[([^\]]*)\] (.+)$")
TEXT_LINE = re.compile(r"^- (.+)$")
TITLES = ("Files", "Commands", "Open errors", "Tasks", "Constraints", "Decisions")


def _run_line(run: CommandRun) -> str:
    return f"- {run.command} — {run.outcome}" + (f": {run.detail}" if run.detail else "")


def _sections(ledger: Ledger) -> list[tuple[str, list[str]]]:
    """(title, entry lines) of every section, in render order."""
    return list(
        zip(
            TITLES,
            [
                [f"- {f.path}: {f.action} ({f.tool})" for f in ledger.files],
                [_run_line(r) for r in ledger.commands],
                [_run_line(r) for r in ledger.open_errors],
                [f"- [{t.status}] {t.text}" for t in ledger.tasks],
                [f"- {c}" for c in ledger.constraints],
                [f"- {d}" for d in ledger.decisions],
            ],
            strict=True,
        )
    )


def _drop_order(ledger: Ledger) -> list[tuple[int, int]]:
    """(section, entry) in the order the budget drops them, each kind oldest first: files only read, commands that
    did not fail and found nothing, finished tasks, failed commands, open errors (a command can be run again), what
    short outputs found (a fact the agent asked for), decisions and next steps (their reasons cannot be found
    again), the other tasks (last first), files modified, the constraints last."""
    failed = [i for i, run in enumerate(ledger.commands) if reading.failing(run)]
    found = [i for i, run in enumerate(ledger.commands) if run.detail and i not in failed]
    finished = [i for i, t in enumerate(ledger.tasks) if t.status in FINISHED]
    return [
        *((0, i) for i, f in enumerate(ledger.files) if f.action == "read"),
        *((1, i) for i in range(len(ledger.commands)) if i not in failed and i not in found),
        *((3, i) for i in finished),
        *((1, i) for i in failed),
        *((2, i) for i in range(len(ledger.open_errors))),
        *((1, i) for i in found),
        *((5, i) for i in range(len(ledger.decisions))),
        *((3, i) for i in reversed(range(len(ledger.tasks))) if i not in finished),
        *((0, i) for i, f in enumerate(ledger.files) if f.action == "modified"),
        *((4, i) for i in range(len(ledger.constraints))),
    ]


def _text(sections: list[tuple[str, list[str]]], dropped: set[tuple[int, int]]) -> str:
    lines: list[str] = []
    for s, (title, entries) in enumerate(sections):
        kept = [line for i, line in enumerate(entries) if (s, i) not in dropped]
        lines += [f"## {title}", *kept] if kept else []
    return "\n".join([LEDGER_HEADER, *lines]) if lines else ""


def render(ledger: Ledger, budget_tokens: int, count: Callable[[str], int]) -> str:
    """The ledger block, within `budget_tokens` as `count` measures text: entries dropped in `_drop_order`
    until it fits (the fewest such that it does, found by bisection). "" when empty or nothing fits."""
    if budget_tokens <= 0 or ledger.is_empty():
        return ""
    sections, order = _sections(ledger), _drop_order(ledger)
    whole = _text(sections, set())
    if count(whole) <= budget_tokens:
        return whole
    low, high = 1, len(order)  # dropping all of them leaves "", which fits
    while low < high:
        mid = (low + high) // 2
        if count(_text(sections, set(order[:mid]))) <= budget_tokens:
            high = mid
        else:
            low = mid + 1
    return _text(sections, set(order[:low]))


def parse(text: str) -> Ledger | None:
    """The last ledger block found in `text`, read back (a compacted head writes it after the model's summary,
    which might echo a ledger header); None when there is none. Lines it cannot read are skipped."""
    span = reading.span(text, last=True)
    if span is None:
        return None
    found: dict[str, list[Any]] = {title: [] for title in TITLES}
    title = ""
    for line in text[span[0] : span[1]].splitlines()[1:]:
        line = line.rstrip("\r")
        if line.startswith("## "):
            title = line[3:].strip()
        elif title in found and (entry := _entry(title, line)) is not None:
            found[title].append(entry)
    return Ledger(*(tuple(found[t]) for t in TITLES))


def _entry(title: str, line: str) -> FileTouch | CommandRun | Task | str | None:
    if title == "Files":
        m = FILE_LINE.match(line)
        return FileTouch(m[1], "modified" if m[2] == "modified" else "read", m[3]) if m else None
    if title in ("Commands", "Open errors"):
        m = RUN_LINE.match(line)
        return CommandRun(m[1], m[2], m[3] or "") if m else None
    if title == "Tasks":
        m = TASK_LINE.match(line)
        return Task(m[2], m[1]) if m else None
    m = TEXT_LINE.match(line)
    return m[1] if m else None


# ---- deriving ----------------------------------------------------------------------------------------------


class _State:
    """The ledger being updated, message by message (private to `derive`)."""

    def __init__(self, prior: Ledger) -> None:
        self.files = {f.path: f for f in prior.files}
        self.commands = {r.command: r for r in prior.commands}
        self.open = {r.command: r for r in prior.open_errors}
        self.tasks = prior.tasks
        self.constraints = dict.fromkeys(prior.constraints)
        self.decisions = dict.fromkeys(prior.decisions)
        self.pending: dict[str, str] = {}  # call id → the command awaiting its result

    def touch(self, path: str, action: Action, tool: str) -> None:
        path = reading.cut(path)
        if not path:
            return
        last = self.files.pop(path, None)
        if last is not None and last.action == "modified" and action == "read":
            self.files[path] = last  # modified wins; the read moves it to the end
        else:
            self.files[path] = FileTouch(path, action, reading.cut(tool, 60))
        _cap(self.files, MAX_FILES)

    def call(self, call: ToolCall) -> None:
        name, args = call.function.name.lower(), reading.arguments(call)
        tasks = reading.task_list(name, args)
        if tasks is not None:
            self.tasks = tasks
            return
        shell = any(w in name for w in ("bash", "shell", "command", "exec", "terminal"))
        command = reading.command(args) if shell else None
        patch = reading.patch(name, args, call.function.arguments, command)
        if patch is not None:
            for path in reading.patched(patch):
                self.touch(path, "modified", call.function.name)
        elif command is not None:
            for path in reading.shell_writes(command):
                self.touch(path, "modified", call.function.name)
            self.run(reading.cut(command.replace(" — ", " - ")), call.id)
        elif (query := reading.query(name, args)) is not None:
            self.run(reading.cut(query.replace(" — ", " - ")), call.id)
        else:
            for path, action in reading.file_touches(name, args):
                self.touch(path, action, call.function.name)

    def run(self, command: str, call_id: str) -> None:
        if not command:
            return
        last = self.commands.pop(command, None)
        self.commands[command] = last or CommandRun(command, "no result")
        self.pending[call_id] = command
        _cap(self.commands, MAX_COMMANDS)

    def result(self, call_id: str, text: str) -> None:
        command = self.pending.pop(call_id, None)
        if command is None:
            return
        run = CommandRun(command, *reading.outcome(text))
        if command in self.commands:
            self.commands[command] = run
        self.open.pop(command, None)
        if reading.failing(run):
            self.open[command] = run
            _cap(self.open, MAX_COMMANDS)
        elif run.outcome == "passed" and reading.PASSED.search(text):  # a passing test run settles its narrower runs
            for settled in [c for c in self.open if reading.narrower(c, command)]:
                del self.open[settled]

    def note(self, message: Message) -> None:
        """The user's constraints or the agent's decisions stated in a message's prose."""
        found = reading.CONSTRAINT if message.role == "user" else reading.DECISION
        into = self.constraints if message.role == "user" else self.decisions
        for sentence in reading.sentences(message.text()):
            if found.search(sentence):
                into.setdefault(sentence)
        _cap(self.decisions, MAX_DECISIONS)

    def ledger(self) -> Ledger:
        return Ledger(
            tuple(self.files.values()),
            tuple(self.commands.values()),
            tuple(self.open.values()),
            self.tasks,
            tuple(self.constraints),
            tuple(self.decisions),
        )


def _cap(entries: dict[str, Any], most: int) -> None:
    """Drop the oldest entries past `most`."""
    for key in list(entries)[: max(0, len(entries) - most)]:
        del entries[key]


def derive(messages: Sequence[Message], prior: Ledger | None = None) -> Ledger:
    """`prior` (or an empty ledger) updated by `messages`, in order. Constraints come from user messages only,
    decisions from assistant prose only; earlier compaction summaries are skipped (their ledger is `prior`)."""
    state = _State(prior or Ledger())
    for message in messages:
        if message.text().startswith(SUMMARY_HEADER):
            continue
        if message.role in ("user", "assistant"):
            state.note(message)
        if message.role == "assistant":
            for call in message.tool_calls or []:
                state.call(call)
        if message.role == "tool":
            state.result(message.tool_call_id or "", message.text())
    return state.ledger()

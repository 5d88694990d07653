"""The state ledger of a coding agent's session, derived from the chat history without a model.

Files read or modified, shell commands with their last outcome, the errors still open, the latest task
list, the user's constraints and the agent's decisions, one line per entry. A compaction writes the
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

import json
import re
import shlex
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from compaction.history import Message, ToolCall

LEDGER_HEADER = "State ledger (kept verbatim, updated at each compaction):"
SUMMARY_HEADER = "Summary of the earlier conversation (compacted):"  # compaction.plan's, which may import this
ENTRY_CHARS = 300  # an entry's text is cut at a word border past this
ERROR_CHARS = 120  # a failure's first error line, likewise
MAX_COMMANDS = 40  # the most recent distinct commands kept (the render budget trims further)
MAX_FILES = 200  # likewise, the most recently touched files
MAX_DECISIONS = 100  # likewise, the latest decisions
FINISHED = frozenset({"completed", "complete", "done", "cancelled", "canceled"})  # task statuses trimmed first

Action = Literal["read", "modified"]


@dataclass(frozen=True)
class FileTouch:
    path: str  # as the tool call named it
    action: Action  # "modified" once any call wrote it
    tool: str  # the last call that touched it with this action


@dataclass(frozen=True)
class CommandRun:
    command: str  # the shell command, on one line
    outcome: str  # passed, failed, exit N, ok, or "no result" when its result was not seen
    error: str = ""  # the first error line of a failing run


@dataclass(frozen=True)
class Task:
    text: str
    status: str  # as the agent's tool wrote it, lowercased: pending, in_progress, completed, …


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
BLOCK_END = re.compile(r"\n[ \t]*\r?\n")
TITLES = ("Files", "Commands", "Open errors", "Tasks", "Constraints", "Decisions")


def _run_line(run: CommandRun) -> str:
    return f"- {run.command} — {run.outcome}" + (f": {run.error}" if run.error else "")


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
    did not fail, finished tasks, failed commands, open errors (a command can be run again), decisions and next
    steps (their reasons cannot be found again), the other tasks (last first), files modified, the constraints
    last."""
    failed = [i for i, run in enumerate(ledger.commands) if _failing(run)]
    finished = [i for i, t in enumerate(ledger.tasks) if t.status in FINISHED]
    return [
        *((0, i) for i, f in enumerate(ledger.files) if f.action == "read"),
        *((1, i) for i in range(len(ledger.commands)) if i not in failed),
        *((3, i) for i in finished),
        *((1, i) for i in failed),
        *((2, i) for i in range(len(ledger.open_errors))),
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


def _span(text: str, last: bool = False) -> tuple[int, int] | None:
    """Where the first (or last) ledger block starts (its header) and ends (the first blank line after it, or
    the text's end)."""
    start = text.rfind(LEDGER_HEADER) if last else text.find(LEDGER_HEADER)
    if start < 0:
        return None
    end = BLOCK_END.search(text, start)
    return start, end.start() if end else len(text)


def parse(text: str) -> Ledger | None:
    """The last ledger block found in `text`, read back (a compacted head writes it after the model's summary,
    which might echo a ledger header); None when there is none. Lines it cannot read are skipped."""
    span = _span(text, last=True)
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


def without_ledger(text: str) -> str:
    """`text` with every ledger block removed, and the blank lines that set it apart."""
    while (span := _span(text)) is not None:
        before = re.sub(r"(?:\r?\n[ \t]*)+$", "", text[: span[0]])
        after = re.sub(r"^(?:[ \t]*\r?\n)+", "", text[span[1] :])
        text = f"{before}\n\n{after}" if before and after else before or after
    return text


# ---- reading the messages --------------------------------------------------------------------------------

EXIT = re.compile(
    r"\b(?:exit(?:[ _]?code| status)\"?\s*[:=]?\s*|exited with (?:exit )?(?:code |status )?)(-?\d+)", re.I
)
FAILURE = re.compile(
    r"\b[1-9]\d* (?:failed|errors?)\b|^FAILED\b|^Traceback \(most recent call last\)"
    r"|^[\w.]*(?:Error|Exception):|^(?:error|fatal)(?:\[\w+\])?:",
    re.M,
)
PASSED = re.compile(r"\b[1-9]\d* passed\b|^OK\b", re.M)
ERROR_LINE = re.compile(
    r"^(?:E\s+\S|FAILED\b|ERROR\b|[\w.]*(?:Error|Exception)\b|(?:error|fatal)\b)|\berror:|\b[1-9]\d* failed\b"
)
CONSTRAINT = re.compile(
    r"(?<!\w)(?:must|never|always|don['’]t|do not|only|avoid|make sure|keep|required|no longer|constraints?)(?!\w)",
    re.I,
)
DECISION = re.compile(
    r"(?<!\w)(?:decided|decision|we['’]ll|I['’]ll use|chose|going with|the plan:|the fix|instead|because"
    r"|root cause|found it|next step)(?!\w)",
    re.I,
)
FENCED = re.compile(r"```.*?(?:```|\Z)", re.S)
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\n+")
BULLET = re.compile(r"^(?:[-*•]|\d+[.)])\s+")
PATCH_FILE = re.compile(r"^\*\*\* (?:Update|Add|Delete) File: (.+)$|^\*\*\* Move to: (.+)$|^\+\+\+ (?:b/)?(.+)$", re.M)
PATH_KEYS = ("path", "file_path", "filepath", "filename", "notebook_path")
SHELLS = frozenset({"bash", "sh", "zsh", "dash"})
SEPARATORS = frozenset({"&&", "||", ";", "|", "&", "(", ")", ";;", "|&"})
REDIRECTS = frozenset({">", ">>", "&>", "&>>", ">|"})
OPERATOR_CHARS = frozenset("<>&|")


def _cut(text: str, limit: int = ENTRY_CHARS) -> str:
    """`text` on one line (whitespace collapsed, the ledger header taken out), cut at a word border past `limit`."""
    text = " ".join(text.split())
    while LEDGER_HEADER in text:
        text = " ".join(text.replace(LEDGER_HEADER, " ").split())
    if len(text) <= limit:
        return text
    head = text[: limit - 1]
    space = head.rfind(" ")
    return (head[:space] if space > limit // 2 else head).rstrip() + "…"


def _outcome(result: str) -> tuple[str, str]:
    """A command's outcome and, when it failed, its first error line, read from its tool result."""
    code = EXIT.search(result)
    if code:
        failed = int(code[1]) != 0
        outcome = f"exit {int(code[1])}" if failed else "passed"
    else:
        failed = FAILURE.search(result) is not None
        outcome = "failed" if failed else "passed" if PASSED.search(result) else "ok"
    return outcome, _first_error(result) if failed else ""


def _first_error(result: str) -> str:
    lines = [line.strip() for line in result.splitlines() if line.strip() and not EXIT.search(line)]
    first = next((line for line in lines if ERROR_LINE.search(line)), lines[-1] if lines else "")
    return _cut(first, ERROR_CHARS)


def _failing(run: CommandRun) -> bool:
    return run.outcome == "failed" or run.outcome.startswith("exit ")


def _narrower(failing: str, passing: str) -> bool:
    """Whether `failing` runs the program `passing` runs, with more arguments: `pytest -q` passing settles
    `pytest tests/a.py -x -k slow`."""
    words, theirs = passing.split(), failing.split()
    return theirs[:1] == words[:1] and {w for w in words if not w.startswith("-")} <= set(theirs)


def _sentences(text: str) -> Iterator[str]:
    """The sentences of prose (fenced code and any ledger block left out), bullets stripped."""
    for piece in SENTENCE_BREAK.split(FENCED.sub("\n", without_ledger(text))):
        sentence = BULLET.sub("", piece.strip()).strip()
        if sentence:
            yield _cut(sentence)


def _arguments(call: ToolCall) -> dict[str, Any]:
    """The call's arguments; none when they are not a JSON object."""
    try:
        args = json.loads(call.function.arguments or "{}")
    except (ValueError, RecursionError):
        return {}
    return args if isinstance(args, dict) else {}


def _task_list(name: str, args: dict[str, Any]) -> tuple[Task, ...] | None:
    """The task list a todo or plan tool wrote (TodoWrite, todowrite, update_plan), else None."""
    items = next((args[k] for k in ("todos", "plan", "tasks") if isinstance(args.get(k), list)), None)
    if items is None or not ("todo" in name or "plan" in name):
        return None
    tasks: list[Task] = []
    for item in items:
        fields = item if isinstance(item, dict) else {"content": item}
        texts = [fields.get(k) for k in ("content", "step", "text", "title", "task")]
        text = _cut(next((t for t in texts if isinstance(t, str)), ""))
        status = fields.get("status")
        status = _cut(re.sub(r"[\[\]]", "", status).lower(), 40) if isinstance(status, str) else ""
        if text:
            tasks.append(Task(text, status or "pending"))
    return tuple(tasks)


def _patched(patch: str) -> list[str]:
    """The files a patch touches: Codex's `*** Update/Add/Delete File:` lines, or a unified diff's `+++` lines."""
    paths = (next(g for g in m.groups() if g).strip() for m in PATCH_FILE.finditer(patch))
    return [p for p in paths if p and p != "/dev/null"]


def _patch(name: str, args: dict[str, Any], raw: str, command: str | None) -> str | None:
    """The patch a call applies: Codex's apply_patch (its `input`, or freeform arguments), a shell command
    running it, or any patch tool's `patch`; else None."""
    if command is not None:
        return command if "*** Begin Patch" in command else None
    if "patch" not in name:
        return None
    text = args.get("input", args.get("patch"))
    if isinstance(text, str):
        return text
    return raw if "*** Begin Patch" in raw else None


def _command(args: dict[str, Any]) -> str | None:
    """A shell tool's command: a string, or an argv (`["bash", "-lc", cmd]` gives cmd)."""
    raw = args.get("command", args.get("cmd"))
    if isinstance(raw, str):
        return raw
    if not (isinstance(raw, list) and raw and all(isinstance(a, str) for a in raw)):
        return None
    if len(raw) >= 3 and raw[0].rsplit("/", 1)[-1] in SHELLS and raw[1] in ("-c", "-lc", "-ic"):
        return raw[2]
    return shlex.join(raw)


def _words(command: str) -> list[list[str]]:
    """The simple commands of a shell line, as words (operators split off; quotes respected when balanced)."""
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:
        tokens = command.split()
    segments: list[list[str]] = [[]]
    for token in tokens:
        if token in SEPARATORS:
            segments.append([])
        else:
            segments[-1].append(token)
    return [s for s in segments if s]


def _operator(word: str) -> bool:
    return bool(word) and set(word) <= OPERATOR_CHARS


def _shell_writes(command: str) -> list[str]:
    """The files a shell command plainly writes: redirect targets, and the operands of sed -i, tee, mv, rm,
    touch and cp (its destination)."""
    out: list[str] = []
    for words in _words(command):
        argv: list[str] = []
        for before, word, after in zip(["", *words[:-1]], words, [*words[1:], ""], strict=True):
            if _operator(word):  # a redirection; its target (or fd) is no argument
                if word in REDIRECTS and after and not after.startswith(("&", "/dev/")):
                    out.append(after)
            elif not _operator(before) and not (word.isdigit() and _operator(after)):
                argv.append(word)
        while argv and (argv[0] == "sudo" or re.match(r"^\w+=", argv[0])):
            argv.pop(0)
        operands = [w for w in argv[1:] if not w.startswith("-")]
        program = argv[0].rsplit("/", 1)[-1] if argv else ""
        if program == "sed" and any(w.startswith(("-i", "--in-place")) for w in argv):
            out += operands[1:]
        elif program in ("tee", "mv", "rm", "touch"):
            out += operands
        elif program == "cp":
            out += operands[-1:]
    return out


def _file_touches(name: str, args: dict[str, Any]) -> list[tuple[str, Action]]:
    """The path a file tool reads or modifies, judged by its name (directory listings and searches: none)."""
    path = next((v for k, v in args.items() if k.lower() in PATH_KEYS and isinstance(v, str) and v.strip()), None)
    if path is None or any(w in name for w in ("dir", "folder", "search", "grep", "glob", "list")):
        return []
    if args.get("command") == "view":  # Anthropic's text editor tool viewing a file
        return [(path, "read")]
    if any(w in name for w in ("write", "edit", "patch", "create", "replace")):
        return [(path, "modified")]
    if any(w in name for w in ("read", "view", "open")) or "cat" in re.split(r"[\W_]+", name):
        return [(path, "read")]
    return []


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
        path = _cut(path)
        if not path:
            return
        last = self.files.pop(path, None)
        if last is not None and last.action == "modified" and action == "read":
            self.files[path] = last  # modified wins; the read moves it to the end
        else:
            self.files[path] = FileTouch(path, action, _cut(tool, 60))
        _cap(self.files, MAX_FILES)

    def call(self, call: ToolCall) -> None:
        name, args = call.function.name.lower(), _arguments(call)
        tasks = _task_list(name, args)
        if tasks is not None:
            self.tasks = tasks
            return
        shell = any(w in name for w in ("bash", "shell", "command", "exec", "terminal"))
        command = _command(args) if shell else None
        patch = _patch(name, args, call.function.arguments, command)
        if patch is not None:
            for path in _patched(patch):
                self.touch(path, "modified", call.function.name)
        elif command is not None:
            for path in _shell_writes(command):
                self.touch(path, "modified", call.function.name)
            self.run(_cut(command.replace(" — ", " - ")), call.id)
        else:
            for path, action in _file_touches(name, args):
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
        run = CommandRun(command, *_outcome(text))
        if command in self.commands:
            self.commands[command] = run
        self.open.pop(command, None)
        if _failing(run):
            self.open[command] = run
            _cap(self.open, MAX_COMMANDS)
        elif run.outcome == "passed" and PASSED.search(text):  # a passing test run settles its narrower runs
            for settled in [c for c in self.open if _narrower(c, command)]:
                del self.open[settled]

    def note(self, message: Message) -> None:
        """The user's constraints or the agent's decisions stated in a message's prose."""
        found = CONSTRAINT if message.role == "user" else DECISION
        into = self.constraints if message.role == "user" else self.decisions
        for sentence in _sentences(message.text()):
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

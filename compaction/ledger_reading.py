"""What the state ledger reads from a session's tool calls and results: shell commands (a string or an argv) and
the files they plainly write, queries (SQL, Python) run the same way, patches and the files they touch, the paths
file tools read or modify, task lists, a command's outcome with its first error line or, for a short output, what it
found, and the sentences of prose that state a constraint or a decision.

It also holds the few ledger pieces that reading needs (`Action`, `CommandRun`, `Task`, `LEDGER_HEADER`,
`without_ledger`), so that `compaction.ledger` imports this module and never the reverse; `compaction.ledger`
re-exports them.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from compaction.history import ToolCall

LEDGER_HEADER = "State ledger (kept verbatim, updated at each compaction):"
ENTRY_CHARS = 300  # an entry's text is cut at a word border past this
ERROR_CHARS = 120  # a failure's first error line, likewise
FINDING_LINES, FINDING_CHARS = 3, 200  # an output this short is what the command found: kept beside its outcome
BLOCK_END = re.compile(r"\n[ \t]*\r?\n")

Action = Literal["read", "modified"]


@dataclass(frozen=True)
class CommandRun:
    command: str  # the shell command, on one line
    outcome: str  # passed, failed, exit N, ok, or "no result" when its result was not seen
    detail: str = ""  # a failing run's first error line, or what a short output found (a version, a port, a count)


@dataclass(frozen=True)
class Task:
    text: str
    status: str  # as the agent's tool wrote it, lowercased: pending, in_progress, completed, …


def span(text: str, last: bool = False) -> tuple[int, int] | None:
    """Where the first (or last) ledger block starts (its header) and ends (the first blank line after it, or
    the text's end)."""
    start = text.rfind(LEDGER_HEADER) if last else text.find(LEDGER_HEADER)
    if start < 0:
        return None
    end = BLOCK_END.search(text, start)
    return start, end.start() if end else len(text)


def without_ledger(text: str) -> str:
    """`text` with every ledger block removed, and the blank lines that set it apart."""
    while (block := span(text)) is not None:
        before = re.sub(r"(?:\r?\n[ \t]*)+$", "", text[: block[0]])
        after = re.sub(r"^(?:[ \t]*\r?\n)+", "", text[block[1] :])
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
RULE = re.compile(r"^[-=+|:\s]*$")  # a table's rule line
OUTPUT_HEADER = re.compile(r"^Output:\s*$", re.M)  # Codex's exec output: metadata lines, then "Output:"
QUERY_TOOLS = ("sql", "query", "python", "repl", "eval")  # tools run like commands: their text is the command
QUERY_KEYS = ("query", "sql", "code")
ERROR_LINE = re.compile(
    r"^(?:E\s+\S|FAILED\b|ERROR\b|[\w.]*(?:Error|Exception)\b|(?:error|fatal)\b)|\berror:|\b[1-9]\d* failed\b"
)
CONSTRAINT = re.compile(
    r"(?<!\w)(?:must|never|always|don['’]t|do not|only|avoid|make sure|keep|required|no longer|constraints?"
    r"|every|each|at least|at most|exactly|no more than)(?!\w)",
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


def cut(text: str, limit: int = ENTRY_CHARS) -> str:
    """`text` on one line (whitespace collapsed, the ledger header taken out), cut at a word border past `limit`."""
    text = " ".join(text.split())
    while LEDGER_HEADER in text:
        text = " ".join(text.replace(LEDGER_HEADER, " ").split())
    if len(text) <= limit:
        return text
    head = text[: limit - 1]
    space = head.rfind(" ")
    return (head[:space] if space > limit // 2 else head).rstrip() + "…"


def outcome(result: str) -> tuple[str, str]:
    """A command's outcome and its detail, read from its tool result: a failure's first error line; what a short
    output found (not for a test run's tally)."""
    code = EXIT.search(result)
    if code:
        failed = int(code[1]) != 0
        outcome = f"exit {int(code[1])}" if failed else "passed"
    else:
        failed = FAILURE.search(result) is not None
        outcome = "failed" if failed else "passed" if PASSED.search(result) else "ok"
    if failed:
        return outcome, _first_error(result)
    return outcome, "" if PASSED.search(result) else finding(result)


def finding(result: str) -> str:
    """What a short output said, its lines joined (rule lines, exit codes and Codex's metadata left out); "" when
    it is empty or longer than `FINDING_LINES` lines or `FINDING_CHARS` characters (a listing is looked up again)."""
    if len(result) > 4 * FINDING_CHARS:  # too long even with Codex's metadata: never parsed (a large JSON output)
        return ""
    try:
        parsed = json.loads(result)
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("output"), str):  # Codex's JSON exec output
        result = parsed["output"]
    header = OUTPUT_HEADER.search(result)
    body = result[header.end() :] if header else result
    lines = [line.strip() for line in body.splitlines() if not RULE.match(line) and not EXIT.search(line)]
    text = "; ".join(lines)
    return text if len(lines) <= FINDING_LINES and len(text) <= FINDING_CHARS else ""


def _first_error(result: str) -> str:
    lines = [line.strip() for line in result.splitlines() if line.strip() and not EXIT.search(line)]
    first = next((line for line in lines if ERROR_LINE.search(line)), lines[-1] if lines else "")
    return cut(first, ERROR_CHARS)


def failing(run: CommandRun) -> bool:
    return run.outcome == "failed" or run.outcome.startswith("exit ")


def narrower(failing: str, passing: str) -> bool:
    """Whether `failing` runs the program `passing` runs, with more arguments: `pytest -q` passing settles
    `pytest tests/a.py -x -k slow`."""
    words, theirs = passing.split(), failing.split()
    return theirs[:1] == words[:1] and {w for w in words if not w.startswith("-")} <= set(theirs)


def sentences(text: str) -> Iterator[str]:
    """The sentences of prose (fenced code and any ledger block left out), bullets stripped."""
    for piece in SENTENCE_BREAK.split(FENCED.sub("\n", without_ledger(text))):
        sentence = BULLET.sub("", piece.strip()).strip()
        if sentence:
            yield cut(sentence)


def arguments(call: ToolCall) -> dict[str, Any]:
    """The call's arguments; none when they are not a JSON object."""
    try:
        args = json.loads(call.function.arguments or "{}")
    except (ValueError, RecursionError):
        return {}
    return args if isinstance(args, dict) else {}


def task_list(name: str, args: dict[str, Any]) -> tuple[Task, ...] | None:
    """The task list a todo or plan tool wrote (TodoWrite, todowrite, update_plan), else None."""
    items = next((args[k] for k in ("todos", "plan", "tasks") if isinstance(args.get(k), list)), None)
    if items is None or not ("todo" in name or "plan" in name):
        return None
    tasks: list[Task] = []
    for item in items:
        fields = item if isinstance(item, dict) else {"content": item}
        texts = [fields.get(k) for k in ("content", "step", "text", "title", "task")]
        text = cut(next((t for t in texts if isinstance(t, str)), ""))
        status = fields.get("status")
        status = cut(re.sub(r"[\[\]]", "", status).lower(), 40) if isinstance(status, str) else ""
        if text:
            tasks.append(Task(text, status or "pending"))
    return tuple(tasks)


def patched(patch: str) -> list[str]:
    """The files a patch touches: Codex's `*** Update/Add/Delete File:` lines, or a unified diff's `+++` lines."""
    paths = (next(g for g in m.groups() if g).strip() for m in PATCH_FILE.finditer(patch))
    return [p for p in paths if p and p != "/dev/null"]


def patch(name: str, args: dict[str, Any], raw: str, command: str | None) -> str | None:
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


def query(name: str, args: dict[str, Any]) -> str | None:
    """The text a query tool runs (`run_sql`'s query, `run_python`'s code), else None."""
    if not any(w in name for w in QUERY_TOOLS):
        return None
    text = next((args[k] for k in QUERY_KEYS if isinstance(args.get(k), str)), None)
    return text if text and text.strip() else None


def command(args: dict[str, Any]) -> str | None:
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


def shell_writes(command: str) -> list[str]:
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


def file_touches(name: str, args: dict[str, Any]) -> list[tuple[str, Action]]:
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

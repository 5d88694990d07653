"""Generated coding-agent sessions with planted facts, for compaction tests and the retention benchmark.

    python -m jobs.data.traces --seed 0 --tokens 20000 > trace.json          (a JSON list of messages)
    python -m jobs.data.traces --seed 0 --tokens 20000 --with-facts > t.json  ({seed, messages, facts})

A session: the system prompt of a coding agent with tools, the user's task with one constraint,
then assistant turns with `tool_calls` (`content: null`, sometimes several calls in one turn) and
`tool` results (test runs, file dumps, code search hits, listings), assistant prose between them,
the fix, a passing run, and the user's next request. One fact of each kind is planted once, in a
plausible place (the constraint in the task, the failing test in the first test run, the
reproduction command in a tool call, the root cause and the chosen fix in assistant prose), and
filler that never spells them grows the session to about `target_tokens`. Deterministic per seed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, Literal

from compaction.history import parse_messages, template_view
from compaction.tokenizer import ChatTokenizer
from jobs.data.trace_text import (
    CONSTRAINTS,
    PROJECTS,
    Bug,
    Project,
    code_file,
    failing_run,
    git_log,
    grep_hits,
    ident,
    listing,
    note,
    passing_run,
    reproduction_output,
    test_file_for,
)

FactKind = Literal["failing_test", "root_cause", "constraint", "fix", "command"]
CHARS_PER_TOKEN = 2.9  # SmolLM2's tokenizer on this text, for counting without a tokenizer

QUESTIONS: dict[FactKind, str] = {
    "failing_test": "Which test was failing when the session started?",
    "root_cause": "What was the root cause of the failing test?",
    "constraint": "What constraint did the user set for the change?",
    "fix": "Which fix did the agent choose?",
    "command": "Which command did the agent run to reproduce the failure on its own?",
}


@dataclass(frozen=True)
class PlantedFact:
    kind: str  # a FactKind for coding traces (other generators plant other kinds)
    text: str  # the exact string planted; exact-string recall = it occurs in the compacted history
    question: str  # a question whose answer is `text` (for judged recall)
    message_index: int  # the message it was planted in (the only message that holds it)


@dataclass(frozen=True)
class CodingTrace:
    messages: list[dict[str, Any]]  # OpenAI chat messages
    facts: list[PlantedFact]
    seed: int


class Session(ABC):
    """Builds one session's messages; tool call ids and every choice come from one seeded generator."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.messages: list[dict[str, Any]] = []

    def say(self, role: str, content: str) -> int:
        self.messages.append({"role": role, "content": content})
        return len(self.messages) - 1

    def call(self, *calls: tuple[str, dict[str, Any], str], content: str | None = None) -> int:
        """One assistant turn with these (tool, arguments, result) calls, then one tool message per call."""
        ids = [f"call_{self.rng.getrandbits(48):012x}" for _ in calls]
        tool_calls = [
            {"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args, _) in zip(ids, calls, strict=True)
        ]
        self.messages.append({"role": "assistant", "content": content, "tool_calls": tool_calls})
        at = len(self.messages) - 1
        for i, (_, _, result) in zip(ids, calls, strict=True):
            self.messages.append({"role": "tool", "tool_call_id": i, "content": result})
        return at

    @abstractmethod
    def filler(self) -> None:
        """One step that states no planted fact (each generator's own)."""


class _CodingSession(Session):
    def __init__(self, rng: random.Random, project: Project) -> None:
        super().__init__(rng)
        self.project = project

    def read(self, module: str) -> tuple[str, dict[str, Any], str]:
        path = f"src/{self.project.name}/{module}.py"
        return "read_file", {"path": path}, code_file(self.rng, self.project, module, self.rng.randint(3, 8))

    def filler(self) -> None:
        """One exploration step that states no planted fact."""
        rng, project = self.rng, self.project
        module = rng.choice(sorted(project.modules))
        kind = rng.choice(["read", "read", "grep", "parallel", "tests", "note", "log", "ls"])
        lead = rng.choice([None, None, f"Let me look at {module}."])
        if kind == "read":
            self.call(self.read(module), content=lead)
        elif kind == "grep":
            pattern = ident(rng, project, module)
            self.call(("search_code", {"pattern": pattern, "path": "src"}, grep_hits(rng, project, pattern)))
        elif kind == "parallel":
            other = rng.choice([m for m in sorted(project.modules) if m != module])
            pattern = ident(rng, project, other)
            search = ("search_code", {"pattern": pattern, "path": "src"}, grep_hits(rng, project, pattern))
            self.call(self.read(module), self.read(other), *([search] if rng.random() < 0.5 else []))
        elif kind == "tests":
            path = test_file_for(project, module)
            self.call(("run_command", {"command": f"python -m pytest {path} -q"}, passing_run(rng, path)))
        elif kind == "log":
            self.call(("run_command", {"command": "git log --oneline -8"}, git_log(rng, project)), content=lead)
        elif kind == "ls":
            self.call(("list_dir", {"path": f"src/{project.name}"}, listing(rng, project)))
        else:
            self.say("assistant", note(rng, project))


SYSTEM = (
    "You are a coding agent working in the repository /workspace/{name}. You can call these tools:\n"
    "- read_file(path): the contents of a file\n- search_code(pattern, path): matching lines as path:line:text\n"
    "- list_dir(path): the entries of a folder\n- run_command(command): run a shell command, returns its output\n"
    "- edit_file(path, old, new): replace one exact snippet in a file\n"
    "Work step by step: reproduce the problem, find its cause, make the smallest fix, and run the tests. "
    "Explain your reasoning briefly between tool calls."
)


def _tool(name: str, description: str, *params: str) -> dict[str, Any]:
    properties = {p: {"type": "string"} for p in params}
    schema = {"type": "object", "properties": properties, "required": list(params)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


# The tools of SYSTEM as the agent's /v1/chat/completions turns list them.
TOOLS = [
    _tool("read_file", "The contents of a file.", "path"),
    _tool("search_code", "Matching lines as path:line:text.", "pattern", "path"),
    _tool("list_dir", "The entries of a folder.", "path"),
    _tool("run_command", "Run a shell command; returns its output.", "command"),
    _tool("edit_file", "Replace one exact snippet in a file.", "path", "old", "new"),
]


class TokenCounter:
    """Running token count of a growing session, as the model's chat template renders it.

    Only new messages are rendered (after the session's system message, which is subtracted), so
    growing a session is linear; without a tokenizer the count is a character estimate.
    """

    def __init__(self, tokenizer: ChatTokenizer | None, system: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.system = system
        self.base = self._raw([])
        self.total, self.counted = 0, 0

    def _raw(self, messages: list[dict[str, Any]]) -> int:
        views = [template_view(m) for m in parse_messages([self.system, *messages])]
        if self.tokenizer is None:
            return int(sum(len(v["content"]) + 8 for v in views) / CHARS_PER_TOKEN)
        return len(self.tokenizer.encode(self.tokenizer.render(views)))

    def of(self, messages: list[dict[str, Any]]) -> int:
        """Tokens these messages add to a session."""
        return self._raw(messages) - self.base

    def __call__(self, messages: list[dict[str, Any]]) -> int:
        """Tokens of the session `messages` (grown by appending since the last call)."""
        self.total += self.of(messages[self.counted :]) if self.counted else self._raw(messages[1:])
        self.counted = len(messages)
        return self.total


def grow_until(session: Session, count: TokenCounter, until: int) -> None:
    """Add the session's filler steps until it holds `until` tokens."""
    while count(session.messages) < until:
        session.filler()


def coding_trace(seed: int = 0, target_tokens: int = 20_000, tokenizer: ChatTokenizer | None = None) -> CodingTrace:
    """A coding-agent session of about `target_tokens` tokens with five planted facts."""
    rng = random.Random(seed)
    project = rng.choice(PROJECTS)
    bug: Bug = rng.choice(project.bugs)
    constraint = rng.choice(CONSTRAINTS).format(api=project.api)
    command = f"python -m pytest {bug.test_id.split('::')[0]} -x -q -rN -k {bug.keyword}"
    s = _CodingSession(rng, project)
    s.say("system", SYSTEM.format(name=project.name))
    count = TokenCounter(tokenizer, s.messages[0])
    planted: dict[FactKind, tuple[str, int]] = {}
    task = (
        f"The test suite of {project.name} ({project.purpose}) started failing after the last merge. "
        f"Please find out why and fix it. One constraint: {constraint}. Tell me what you changed."
    )
    planted["constraint"] = constraint, s.say("user", task)
    s.call(("list_dir", {"path": f"src/{project.name}"}, listing(rng, project)))
    run = ("run_command", {"command": "python -m pytest -q"}, failing_run(rng, project, bug))
    planted["failing_test"] = bug.test_id, s.call(run, content="I will start by running the test suite.") + 1
    grow_until(s, count, int(0.25 * target_tokens))
    repro = ("run_command", {"command": command}, reproduction_output(rng, bug))
    planted["command"] = command, s.call(repro, content="Reproducing the failure on its own.")
    grow_until(s, count, int(0.48 * target_tokens))
    s.call(s.read(bug.module))
    cause = f"Found it: {bug.root_cause}. That explains the assertion in the failing test."
    planted["root_cause"] = bug.root_cause, s.say("assistant", cause)
    grow_until(s, count, int(0.68 * target_tokens))
    planted["fix"] = bug.fix, s.say("assistant", f"The plan: {bug.fix}. It is the smallest change that fixes it.")
    path = f"src/{project.name}/{bug.module}.py"
    edit = {"path": path, "old": "# see above", "new": bug.fixed_line}
    s.call(("edit_file", edit, f"Applied 1 edit to {path} (+2 -1)."))
    ending = _ending(rng, project, path)
    grow_until(s, count, target_tokens - count.of(ending))
    s.messages += ending
    facts = [PlantedFact(kind, text, QUESTIONS[kind], index) for kind, (text, index) in planted.items()]
    check_planted(s.messages, facts)
    return CodingTrace(s.messages, sorted(facts, key=lambda f: f.message_index), seed)


def _ending(rng: random.Random, project: Project, path: str) -> list[dict[str, Any]]:
    """The passing run, the agent's report and the user's next request."""
    end = _CodingSession(rng, project)
    total = rng.randint(90, 180)
    end.call(("run_command", {"command": "python -m pytest -q"}, f"{'.' * 60} [100%]\n{total} passed in 3.1s"))
    end.say("assistant", f"All {total} tests pass now. The change is limited to {path}; nothing else was touched.")
    end.say("user", "Thanks. Before you open the pull request, please add a short entry to CHANGELOG.md.")
    return end.messages


def check_planted(messages: list[dict[str, Any]], facts: list[PlantedFact]) -> None:
    """Every fact occurs in its own message and in no other (a generator bug otherwise)."""
    texts = [template_view(m)["content"] for m in parse_messages(messages)]
    for fact in facts:
        holders = [i for i, text in enumerate(texts) if fact.text in text]
        if holders != [fact.message_index]:
            raise RuntimeError(f"planted {fact.kind} {fact.text!r} occurs in messages {holders}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.data.traces", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=20_000, help="about this many tokens (CPU default model)")
    parser.add_argument("--with-facts", action="store_true", help="print {seed, messages, facts} instead of the list")
    args = parser.parse_args(argv)
    from serving.weights import is_ready, model_dir

    tokenizer = None
    if is_ready():
        from compaction.tokenizer import HFChatTokenizer

        tokenizer = HFChatTokenizer.from_path(model_dir())
    else:
        print("[traces] CPU default model not fetched: counting tokens approximately", file=sys.stderr)
    trace = coding_trace(args.seed, args.tokens, tokenizer)
    out: Any = asdict(trace) if args.with_facts else trace.messages
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The session generators of the chain-of-compactions benchmark: `chain_session` builds a coding or a
data-analysis agent session (`ChainSession`, defined with the canary model and checks in `jobs.data.canaries`)
in rounds of about `tokens_per_round` tokens, from the pools of canary texts here (constraints, safety rules,
facts, files, decisions, next steps, plan steps), planting round 1's canary of every kind and the later rounds'
few (`LATER`) among filler (file reads, listings, test runs, searches, SQL results), then checks them with
`check_canaries`. Deterministic per seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

from compaction.tokenizer import ChatTokenizer
from jobs.data.analysis_traces import DATASETS, Dataset, _Analysis
from jobs.data.analysis_traces import SYSTEM as ANALYSIS_SYSTEM
from jobs.data.canaries import KINDS, LATER, Canary, CanaryKind, ChainSession, SessionKind, check_canaries
from jobs.data.trace_text import PROJECTS, Project, failing_run, note
from jobs.data.traces import SYSTEM, TOOLS, Session, TokenCounter, _CodingSession, _tool

Call = tuple[str, dict[str, Any], str]  # (tool, arguments, result)
NL = "\n"


UPDATE_PLAN: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "update_plan",
        "description": "Replace the task plan: its steps, each with its status. At most one step is in_progress.",
        "parameters": {
            "type": "object",
            "properties": {
                "explanation": {"type": "string"},
                "plan": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "step": {"type": "string"},
                            "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                        },
                        "required": ["step", "status"],
                    },
                },
            },
            "required": ["plan"],
        },
    },
}

ANALYSIS_TOOLS = [
    _tool("describe_table", "The columns of a table and their types.", "table"),
    _tool("run_sql", "Run a query; returns the result table (at most 20 rows).", "query"),
    _tool("run_python", "Run pandas code on the last result; returns what it prints.", "code"),
    _tool("save_plot", "Save a chart of the last result.", "path", "kind"),
    _tool("edit_file", "Replace one exact snippet in a file.", "path", "old", "new"),
]

PLAN_LINE = "You can also call update_plan(plan) to keep a short plan: its steps, each with its status."
ANALYSIS_LINE = (
    "You can also call edit_file(path, old, new) to change a query or report file, and update_plan(plan) "
    "to keep a short plan: its steps, each with its status."
)


@dataclass(frozen=True)
class _Material:
    """What one session plants, drawn per seed; a check is a distinctive part of its sentence."""

    system: str
    task: str  # the user's task; the constraint sentence is appended to it
    constraint: tuple[str, tuple[str, ...]]  # (sentence, checks)
    safety_rule: tuple[str, tuple[str, ...]]
    facts: list[tuple[Call, str, str]]  # (the call, the planted output line, its check), one per fact planted
    files: list[tuple[str, str, str]]  # (path, old, new) of the edits, one per file planted
    decisions: list[tuple[str, tuple[str, ...]]]
    next_step: tuple[str, tuple[str, ...]]
    steps: tuple[str, str, str]  # the plan; the first step moves from in_progress to completed
    prompts: tuple[str, ...]  # the user's messages that open later rounds
    opening: tuple[Call, str]  # round 1's first look (a test run, a table description) and its lead
    prose: Callable[[], str]  # an assistant remark that states no canary


def _coding(rng: random.Random, project: Project) -> _Material:
    name, modules = project.name, sorted(project.modules)
    bug = rng.choice(project.bugs)
    module = bug.module
    other = rng.choice([m for m in modules if m != module])
    constraints = [
        (f"Keep the public API of {name}.{other} unchanged.", ("public API", f"{name}.{other}")),
        ("Stay compatible with Python 3.8.", ("Python 3.8",)),
        ("Do not add any new dependencies to pyproject.toml.", ("dependencies", "pyproject.toml")),
        ("Keep the whole change under 30 lines.", ("30 lines",)),
    ]
    rules = [
        ("Never run `git push --force` to the main branch.", ("git push --force",)),
        ("Do not run `make release` from your environment; releases go through CI.", ("make release",)),
        ("Never delete or regenerate anything under tests/golden/.", ("tests/golden/",)),
        ("Do not open or print the .env.production file.", (".env.production",)),
    ]
    facts = [
        (("run_command", {"command": "./scripts/env-info staging"}, "environment: staging\nhost: db.staging.internal"),
         "the staging database listens on port 6543", "port 6543"),
        (("run_command", {"command": "redis-cli -h cache.internal INFO server | head -4"}, "# Server"),
         "redis_version:7.2.4", "7.2.4"),
        (("run_command", {"command": "./scripts/env-info ci"}, "environment: ci\nrunner image: ubuntu-22.04"),
         "CI runners have 14 GiB of memory", "14 GiB"),
        (("run_command", {"command": "python scripts/flaky_report.py --days 30"}, "scanned 412 CI runs"),
         "quarantined: 37 flaky tests", "37 flaky tests"),
        (("run_command", {"command": "psql \"$STAGING_URL\" -c 'SELECT version()'"}, "version\n-------"),
         "PostgreSQL 15.6 on x86_64-pc-linux-gnu", "PostgreSQL 15.6"),
    ]  # fmt: skip
    files = [
        (f"src/{name}/_compat.py", "", "import sys\n\nPY38 = sys.version_info < (3, 9)\n"),
        (f"tests/test_{module}_regression.py", "", f"from {name} import {module}\n"),
        (f"benchmarks/bench_{module}.py", "", "import timeit\n"),
        ("tests/conftest.py", "import pytest\n", "import pytest\n\npytest_plugins = []\n"),
    ]
    decisions = [
        ("Decision: use `pytest.approx` instead of exact float equality because the results differ on the "
         "ARM runners.", ("pytest.approx", "ARM runners")),
        ("Decision: use `dataclasses.replace` instead of mutating objects in place because the worker threads "
         "share them.", ("dataclasses.replace", "worker threads")),
        ("Decision: use `subprocess.run` with check=True instead of `os.system` because exit codes were "
         "silently ignored.", ("subprocess.run", "exit codes")),
        ("Decision: use `time.monotonic()` instead of `time.time()` because NTP adjustments made durations "
         "negative.", ("time.monotonic", "NTP")),
        ("Decision: use the `tmp_path` fixture instead of writing to /tmp because two xdist workers clobbered "
         "each other's files.", ("tmp_path", "xdist")),
    ]  # fmt: skip
    next_steps = [
        (f"Next step: benchmark {name} on the 50 MB fixture before opening the pull request.", ("50 MB fixture",)),
        ("Next step: ask on issue #482 whether anything relies on the old behaviour.", ("issue #482",)),
        (f"Next step: run mutation tests with mutmut on the {module} module.", ("mutmut",)),
        ("Next step: profile the slow path with py-spy before optimising anything.", ("py-spy",)),
    ]
    prompts = ("Continue.", "Go on, please.", f"Also check whether {other} has the same problem.", "Carry on.")
    return _Material(
        system=f"{SYSTEM.format(name=name)}\n{PLAN_LINE}",
        task=(
            f"The test suite of {name} ({project.purpose}) started failing after the last merge. "
            "Please find out why and fix it."
        ),
        constraint=rng.choice(constraints),
        safety_rule=rng.choice(rules),
        facts=rng.sample(facts, 2),
        files=rng.sample(files, 3),
        decisions=rng.sample(decisions, 2),
        next_step=rng.choice(next_steps),
        steps=(f"Reproduce the failing {module} test", f"Fix the root cause in {module}", "Add a regression test"),
        prompts=prompts,
        opening=(
            ("run_command", {"command": "python -m pytest -q"}, failing_run(rng, project, bug)),
            "First the tests.",
        ),
        prose=lambda: note(rng, project),
    )


def _analysis(rng: random.Random, data: Dataset) -> _Material:
    table, columns = data.table, list(data.columns)
    group = columns[0]
    stamp = next(c for c, t in data.columns.items() if t == "timestamp")
    constraints = [
        ("Only use rows from 2023; nothing before 2023-01-01 counts.", ("2023-01-01",)),
        ("Round every reported figure to two decimals.", ("two decimals",)),
        (f"Work on analytics.{table}_sample only, never on the full table.", (f"{table}_sample",)),
    ]
    rules = [
        ("Never run DELETE or UPDATE statements; the warehouse is shared.", ("DELETE",)),
        ("Do not copy raw email addresses into any output, file or plot.", ("email addresses",)),
        ("Never query the pii schema, not even to count rows.", ("pii schema",)),
    ]
    name, value = data.metric
    metric: Call = ("run_python", {"code": f"print(summary[{name!r}])"}, "")
    latest: Call = ("run_sql", {"query": f"SELECT MAX({stamp}) AS latest FROM analytics.{table}"}, "latest\n------")
    size: Call = ("run_python", {"code": "print(f'{len(df):,} rows')"}, "")
    facts = [(metric, f"{name}: {value}", value)]
    facts += rng.sample([(latest, "2024-03-31 23:58:41", "2024-03-31"), (size, "2,418,906 rows", "2,418,906")], 1)
    files = [
        (f"queries/{table}_by_{group}.sql", "", f"SELECT {group}, COUNT(*) FROM analytics.{table} GROUP BY {group}\n"),
        (f"reports/{table}_findings.md", "", f"# Findings on {table}\n"),
        (f"notebooks/{table}_checks.py", "", "import pandas as pd\n"),
    ]
    decisions = [
        ("Decision: use `percentile_cont(0.5)` instead of AVG because a few outliers above the 99.9th "
         "percentile dominate the mean.", ("percentile_cont", "99.9th percentile")),
        ("Decision: use weekly buckets instead of daily ones because weekend traffic makes daily values swing "
         "by a factor of three.", ("weekly buckets", "weekend")),
        ("Decision: use a LEFT JOIN on analytics.calendar instead of the raw dates because days without rows "
         "would vanish from the chart.", ("analytics.calendar", "days without rows")),
        ("Decision: use a log scale instead of a linear one because the largest group is two orders of "
         "magnitude above the rest.", ("log scale", "orders of magnitude")),
    ]  # fmt: skip
    next_steps = [
        ("Next step: repeat the analysis on the 2022 data to see whether the pattern is seasonal.", ("2022 data",)),
        ("Next step: share the chart with the finance team before the Friday review.", ("finance team",)),
        ("Next step: cross-check the totals against the Looker dashboard.", ("Looker dashboard",)),
    ]
    schema = "\n".join(f"{c:<14} {t}" for c, t in data.columns.items())

    def prose() -> str:
        a, b = rng.sample(columns, 2)
        return f"The {a} column looks complete; next I compare it with {b} per group."

    return _Material(
        system=f"{ANALYSIS_SYSTEM}\n{ANALYSIS_LINE}",
        task=f"I need to understand {data.purpose}, from analytics.{table}.",
        constraint=rng.choice(constraints),
        safety_rule=rng.choice(rules),
        facts=facts,
        files=rng.sample(files, 3),
        decisions=rng.sample(decisions, 2),
        next_step=rng.choice(next_steps),
        steps=(f"Profile the columns of {table}", f"Aggregate {table} per {group}", "Write up the findings"),
        prompts=("Continue.", "Go on, please.", f"Also look at the {rng.choice(columns[1:])} column.", "Carry on."),
        opening=(("describe_table", {"table": table}, f"table analytics.{table}\n{schema}"), "First the columns."),
        prose=prose,
    )


class _AnalysisSession(_Analysis):
    """An analysis session whose filler also previews table rows, the large results of real sessions."""

    def filler(self) -> None:
        if self.rng.random() < 0.5:
            rows = self.rng.randint(10, 20)
            preview = f"SELECT * FROM analytics.{self.data.table} LIMIT {rows}"
            self.call(("run_sql", {"query": preview}, self.table(list(self.data.columns), rows)))
        else:
            super().filler()


class _Planter:
    """Plants the canaries of one session into it, in the order the rounds call for them."""

    def __init__(self, session: Session, material: _Material) -> None:
        self.s, self.m = session, material
        self.canaries: list[Canary] = []
        self.used = {kind: 0 for kind in KINDS}  # how many of each kind were planted

    def add(self, kind: CanaryKind, round: int, checks: tuple[str, ...], index: int, text: str) -> None:
        self.canaries.append(Canary(kind, round, checks, index, text))
        self.used[kind] += 1

    def plan(self, round: int, statuses: tuple[str, str, str]) -> None:
        items = [{"step": step, "status": status} for step, status in zip(self.m.steps, statuses, strict=True)]
        lead = "Here is my plan." if round == 1 else "Updating the plan."
        index = self.s.call(("update_plan", {"plan": items}, "Plan updated"), content=lead)
        for i, canary in enumerate(self.canaries):
            if canary.kind == "task_status" and canary.checks[0] == items[0]["step"] and canary.superseded_in is None:
                self.canaries[i] = replace(canary, superseded_in=round)
        self.add("task_status", round, (items[0]["step"], items[0]["status"]), index, json.dumps(items[0]))

    def plant(self, kind: CanaryKind, round: int) -> None:
        s, m, n = self.s, self.m, self.used[kind]
        if kind == "fact":
            (tool, args, head), line, check = m.facts[n]
            result = f"{head}\n{line}" if head else line
            self.add(kind, round, (check,), s.call((tool, args, result)) + 1, line)
        elif kind == "file_modified":
            path, old, new = m.files[n]
            result = f"Applied 1 edit (+{new.count(NL)} -{old.count(NL)})."
            self.add(kind, round, (path,), s.call(("edit_file", {"path": path, "old": old, "new": new}, result)), path)
        elif kind == "decision":
            sentence, checks = m.decisions[n]
            self.add(kind, round, checks, s.say("assistant", sentence), sentence)
        elif kind == "next_step":
            sentence, checks = m.next_step
            self.add(kind, round, checks, s.say("assistant", sentence), sentence)
        elif kind == "task_status":
            self.plan(round, ("completed", "in_progress", "pending"))
        elif kind == "safety_rule":
            s.say("assistant", m.prose())
            sentence, checks = m.safety_rule
            self.add(kind, round, checks, s.say("user", f"One more thing before you go on. {sentence}"), sentence)
        else:
            raise ValueError(f"{kind} canaries are planted with the task")


def _fill_to(session: Session, count: TokenCounter, until: int, ceiling: int) -> None:
    """Add filler steps until the session holds `until` tokens: a step that would take it past `ceiling` is
    drawn again, and after a few such draws the session stays short of `until` instead."""
    misses = 0
    while count(session.messages) < until and misses < 20:
        mark = len(session.messages)
        session.filler()
        if count.total + count.of(session.messages[mark:]) > ceiling:
            del session.messages[mark:]
            misses += 1


def chain_session(
    kind: SessionKind,
    seed: int,
    rounds: int = 5,
    tokens_per_round: int = 3000,
    tokenizer: ChatTokenizer | None = None,
) -> ChainSession:
    """A session of `rounds` rounds of about `tokens_per_round` tokens each, with canaries planted in them."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    rng = random.Random(seed)
    session: Session
    if kind == "coding":
        project = rng.choice(PROJECTS)
        session, material, tools = _CodingSession(rng, project), _coding(rng, project), [*TOOLS, UPDATE_PLAN]
    elif kind == "analysis":
        data = rng.choice(DATASETS)
        session, material, tools = _AnalysisSession(rng, data), _analysis(rng, data), [*ANALYSIS_TOOLS, UPDATE_PLAN]
    else:
        raise ValueError(f"no {kind!r} sessions: coding or analysis")
    session.say("system", material.system)
    count = TokenCounter(tokenizer, session.messages[0])
    planter = _Planter(session, material)

    def grow(round: int, share: float) -> None:
        _fill_to(session, count, int((round - 1 + share) * tokens_per_round), round * tokens_per_round)

    def finish(round: int, ending: str) -> None:
        end = round * tokens_per_round - count.of([{"role": "assistant", "content": ending}])
        _fill_to(session, count, end, end + tokens_per_round // 10)

    sentence, checks = material.constraint
    planter.add("constraint", 1, checks, session.say("user", f"{material.task} {sentence}"), sentence)
    planter.plan(1, ("in_progress", "pending", "pending"))
    session.call(material.opening[0], content=material.opening[1])
    grow(1, 0.2)
    planter.plant("fact", 1)
    grow(1, 0.4)
    planter.plant("safety_rule", 1)
    grow(1, 0.6)
    planter.plant("decision", 1)
    planter.plant("file_modified", 1)
    finish(1, material.next_step[0])
    planter.plant("next_step", 1)
    starts = [len(session.messages)]
    for round in range(2, rounds + 1):
        session.say("user", material.prompts[(round - 2) % len(material.prompts)])
        plants = LATER.get(round, ())
        for i, later in enumerate(plants):
            grow(round, (i + 1) / (len(plants) + 1))
            planter.plant(later, round)
        ending = material.prose()
        finish(round, ending)
        session.say("assistant", ending)
        starts.append(len(session.messages))
    bounds = [0, *starts]
    parts = [session.messages[a:b] for a, b in pairwise(bounds)]
    chain = ChainSession(parts[0], parts[1:], planter.canaries, tools, kind, seed)
    check_canaries(chain)
    return chain

"""The text of generated coding-agent sessions: scenarios (a small project with one bug) and filler.

Everything here is deterministic given a `random.Random`; `jobs.data.traces` assembles the
pieces into a session. Filler never spells a scenario's planted facts (the assembler checks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    """One defect of a project, with the facts the session plants about it."""

    module: str  # the module holding the defect (a key of Project.modules)
    test_id: str  # pytest node id of the failing test: the `failing_test` fact
    keyword: str  # `-k` selector of the reproduction command
    error: str  # the assertion line the failing test prints
    root_cause: str  # the `root_cause` fact, as the agent states it
    fix: str  # the `fix` fact, as the agent states it
    fixed_line: str  # the line the edit_file call writes


@dataclass(frozen=True)
class Project:
    """A small Python repository the agent works in."""

    name: str  # repository and package name
    purpose: str  # one line for the task description
    api: str  # a public function the user may want unchanged
    modules: dict[str, list[str]]  # module name -> nouns its code talks about
    bugs: tuple[Bug, ...]  # one is chosen per session


PROJECTS: tuple[Project, ...] = (
    Project(
        name="tomlette",
        purpose="a small TOML-like configuration parser",
        api="tomlette.loads",
        modules={
            "lexer": ["token", "quote", "span", "cursor"],
            "parser": ["table", "key", "array", "node"],
            "values": ["datetime", "number", "boolean", "offset"],
            "errors": ["location", "message", "context"],
            "cli": ["argument", "path", "output"],
        },
        bugs=(
            Bug("lexer", "tests/test_lexer.py::test_nested_quotes", "nested",
                "AssertionError: assert ['key', '=', 'a '] == ['key', '=', 'a \"b\" c']",
                "_scan_string resets the quote depth after an escaped quote",
                "track escapes with a separate flag in _scan_string",
                "escaped = char == '\\\\' and not escaped"),
            Bug("values", "tests/test_values.py::test_datetime_offset", "offset",
                "AssertionError: assert datetime(..., tzinfo=-05:00) == datetime(..., tzinfo=-05:30)",
                "parse_datetime drops the minutes of a negative UTC offset",
                "negate hours and minutes together when parse_datetime builds the timedelta",
                "delta = -timedelta(hours=hours, minutes=minutes) if sign == '-' else delta"),
        ),
    ),
    Project(
        name="shipq",
        purpose="a small persistent job queue with retries",
        api="shipq.enqueue",
        modules={
            "queue": ["job", "priority", "payload", "lease"],
            "worker": ["poll", "handler", "heartbeat", "lease"],
            "retry": ["attempt", "delay", "jitter", "policy"],
            "storage": ["row", "expiry", "connection", "batch"],
        },
        bugs=(
            Bug("retry", "tests/test_retry.py::test_backoff_caps_at_max_delay", "caps",
                "AssertionError: assert 96.0 <= 60.0",
                "backoff_delay multiplies before clamping, so the cap is exceeded from the sixth attempt",
                "clamp the exponent before multiplying in backoff_delay",
                "exponent = min(attempt, policy.max_exponent)"),
            Bug("worker", "tests/test_worker.py::test_visibility_timeout_requeues", "requeues",
                "TypeError: can't compare offset-naive and offset-aware datetimes",
                "Worker.poll compares a naive datetime with an aware lease expiry",
                "store lease expiries as UTC-aware datetimes in storage.py",
                "expiry = datetime.now(timezone.utc) + lease"),
        ),
    ),
    Project(
        name="pixelgrid",
        purpose="an image tiling and resampling library",
        api="pixelgrid.tile",
        modules={
            "tiles": ["tile", "bounds", "column", "overlap"],
            "resample": ["kernel", "scale", "pixel", "filter"],
            "imageio": ["header", "stride", "buffer", "channel"],
        },
        bugs=(
            Bug("tiles", "tests/test_tiles.py::test_edge_tiles_cover_image", "edge",
                "AssertionError: assert 1000 == 1024",
                "tile_bounds uses floor division for the column count and drops the right edge",
                "round the column count up with ceiling division in tile_bounds",
                "columns = -(-width // size)"),
        ),
    ),
    Project(
        name="ledgerly",
        purpose="a command-line ledger for small accounts",
        api="ledgerly.Money",
        modules={
            "money": ["amount", "currency", "rounding", "cents"],
            "csv_import": ["row", "column", "dialect", "account"],
            "report": ["balance", "period", "total", "account"],
        },
        bugs=(
            Bug("money", "tests/test_money.py::test_rounding_half_even", "half_even",
                "AssertionError: assert Money('2.67') == Money('2.68')",
                "Money.__round__ goes through float before quantize, so 2.675 rounds down",
                "quantize the Decimal directly with ROUND_HALF_EVEN in Money.__round__",
                "return Money(self.amount.quantize(step, rounding=ROUND_HALF_EVEN))"),
        ),
    ),
)  # fmt: skip

CONSTRAINTS = (
    "keep Python 3.8 compatibility",
    "do not add any new dependencies",
    "do not change the public signature of {api}",
    "leave everything under vendor/ untouched",
    "keep the change under 20 lines",
)

_VERBS = ("load", "parse", "build", "read", "check", "render", "merge", "split", "resolve", "emit", "collect")
_TYPES = ("str", "int", "bytes", "list[str]", "dict[str, int]", "float", "Path", "bool")
_BODY = (
    'if {a} is None:\n        raise ValueError(f"missing {n}: {{{a}!r}}")',
    "{b} = {a}.get({n!r}, {k})",
    "for item in {a}:\n        {b}.append(item)",
    "if len({a}) > {k}:\n        {a} = {a}[:{k}]",
    "{b} = [part.strip() for part in str({a}).split(',')]",
    'logger.debug("{v} %s (%d)", {a}, {k})',
    "{b} = {{key: value for key, value in sorted({b}.items())}}",
    "while {a} and {a}[-1] == 0:\n        {a} = {a}[:-1]",
    "{b} += {k}",
)


def ident(rng: random.Random, project: Project, module: str) -> str:
    """A function name of the module, such as `resolve_table`."""
    return f"{rng.choice(_VERBS)}_{rng.choice(project.modules[module])}"


def code_file(rng: random.Random, project: Project, module: str, functions: int) -> str:
    """A plausible Python module: docstring, imports and a few functions."""
    nouns = project.modules[module]
    lines = [f'"""{module.replace("_", " ").title()} of {project.name}: {", ".join(nouns)} handling."""', ""]
    lines += ["from __future__ import annotations", "", "import logging", "from pathlib import Path", ""]
    lines += ["logger = logging.getLogger(__name__)", ""]
    for _ in range(functions):
        noun = rng.choice(nouns)
        a, b, k = noun, f"{noun}_out", rng.randint(2, 64)
        lines += ["", f"def {ident(rng, project, module)}({a}: {rng.choice(_TYPES)}, limit: int = {k}) -> list:"]
        lines.append(f'    """Return the {noun}s of one {rng.choice(nouns)}, at most `limit` of them."""')
        lines.append(f"    {b}: list = []")
        for template in rng.sample(_BODY, rng.randint(3, 6)):
            lines.append("    " + template.format(a=a, b=b, k=k, n=noun, v=rng.choice(_VERBS)))
        lines.append(f"    return {b}")
    return "\n".join(lines) + "\n"


def grep_hits(rng: random.Random, project: Project, pattern: str) -> str:
    """Output of a code search: `path:line:text` lines."""
    hits = []
    for _ in range(rng.randint(4, 12)):
        module = rng.choice(sorted(project.modules))
        source = code_file(rng, project, module, 1).splitlines()
        line = rng.choice([ln for ln in source if ln.strip()])
        hits.append(f"src/{project.name}/{module}.py:{rng.randint(5, 400)}:{line}")
    return "\n".join(sorted(hits)) if hits else f"no matches for {pattern}"


def listing(rng: random.Random, project: Project) -> str:
    """`ls -la`-like output of the package folder."""
    rows = ["total 96", "drwxr-xr-x  4 agent agent  4096 .", "drwxr-xr-x 12 agent agent  4096 .."]
    for module in sorted(project.modules):
        rows.append(f"-rw-r--r--  1 agent agent {rng.randint(900, 24000):5d} {module}.py")
    rows.append("-rw-r--r--  1 agent agent   412 __init__.py")
    return "\n".join(rows)


def test_file_for(project: Project, module: str) -> str:
    return f"tests/test_{module}.py"


def passing_run(rng: random.Random, path: str) -> str:
    """pytest -q output of a passing test file."""
    count = rng.randint(8, 40)
    return f"{'.' * count}{' ' * max(1, 60 - count)}[100%]\n{count} passed in {rng.uniform(0.1, 2.5):.2f}s"


def failing_run(rng: random.Random, project: Project, bug: Bug) -> str:
    """pytest -q output of the whole suite with the bug's test failing (the only place its node id appears)."""
    files = [test_file_for(project, m) for m in sorted(project.modules)]
    total, lines = 0, ["============================= test session starts =============================="]
    lines += ["platform linux -- Python 3.11.9, pytest-8.3.2, pluggy-1.5.0", f"rootdir: /workspace/{project.name}"]
    for path in files:
        count = rng.randint(6, 30)
        total += count
        dots = "." * count if path not in bug.test_id else "." * (count - 3) + "F..."
        lines.append(f"{path} {dots}")
    name = bug.test_id.split("::")[1]
    lines += ["", "=================================== FAILURES ===================================",
              f"_______________________________ {name} _______________________________", "",
              f"    def {name}():", f"        result = {ident(rng, project, bug.module)}(SAMPLE)",
              ">       assert result == EXPECTED", f"E       {bug.error}", "",
              f"{bug.test_id.split('::')[0]}:{rng.randint(20, 200)}: AssertionError",
              "=========================== short test summary info ============================",
              f"FAILED {bug.test_id} - {bug.error.split(':')[0]}",
              f"=============== 1 failed, {total - 1} passed in {rng.uniform(1, 6):.2f}s ==============="]  # fmt: skip
    return "\n".join(lines)


def reproduction_output(rng: random.Random, bug: Bug) -> str:
    """pytest -x -q -rN output of the single failing test: traceback, no node id."""
    path, name = bug.test_id.split("::")
    return "\n".join(
        [
            "F",
            f"_______________________________ {name} _______________________________",
            f"{path}:{rng.randint(20, 200)}: in {name}",
            "    assert result == EXPECTED",
            f"E   {bug.error}",
            f"1 failed, {rng.randint(20, 60)} deselected in {rng.uniform(0.2, 1.5):.2f}s",
        ]
    )


def git_log(rng: random.Random, project: Project) -> str:
    subjects = ["Merge pull request #{n} from dev/refactor", "Speed up {m} by caching", "Bump version to 0.{n}.0",
                "Document {m} options", "Fix typo in {m} docstring", "Add type hints to {m}"]  # fmt: skip
    rows = []
    for _ in range(rng.randint(4, 8)):
        subject = rng.choice(subjects).format(n=rng.randint(2, 90), m=rng.choice(sorted(project.modules)))
        rows.append(f"{rng.getrandbits(28):07x} {subject}")
    return "\n".join(rows)


def note(rng: random.Random, project: Project) -> str:
    """An assistant prose turn between tool calls that states no planted fact."""
    a, b = rng.sample(sorted(project.modules), 2)
    templates = (
        "The {a} module only builds {n} objects; nothing there touches {b}. Next I will look at how {b} uses them.",
        "So far the {a} code paths look consistent with the tests. I want to see the callers in {b} before "
        "changing anything.",
        "That search shows {a} is called from three places. The one in {b} is the interesting one.",
        "Nothing suspicious in this file. The {n} handling in {a} is straightforward.",
    )
    return rng.choice(templates).format(a=a, b=b, n=rng.choice(project.modules[a]))

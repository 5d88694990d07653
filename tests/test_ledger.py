import json
from typing import Any

import pytest

from compaction import plan
from compaction.history import Message, parse_messages
from compaction.ledger import (
    LEDGER_HEADER,
    SUMMARY_HEADER,
    CommandRun,
    FileTouch,
    Ledger,
    Task,
    derive,
    parse,
    render,
    without_ledger,
)
from jobs.data.traces import coding_trace

Step = tuple[str, Any, str | None] | dict[str, Any]


def session(*steps: Step) -> list[Message]:
    """Messages from steps: a dict is a message; (tool, arguments, result) is one call and its result (none when
    the result is None). Arguments that are not a str are JSON-encoded."""
    raw: list[dict[str, Any]] = []
    for n, step in enumerate(steps):
        if isinstance(step, dict):
            raw.append(step)
            continue
        name, args, result = step
        arguments = args if isinstance(args, str) else json.dumps(args)
        call = {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": arguments}}
        raw.append({"role": "assistant", "content": None, "tool_calls": [call]})
        if result is not None:
            raw.append({"role": "tool", "tool_call_id": f"call_{n}", "content": result})
    return parse_messages(raw)


def words(text: str) -> int:
    return len(text.split())


def files(ledger: Ledger) -> dict[str, str]:
    return {f.path: f"{f.action} ({f.tool})" for f in ledger.files}


def outcomes(ledger: Ledger) -> dict[str, str]:
    return {r.command: r.outcome for r in ledger.commands}


def test_generated_trace_tools() -> None:
    ledger = derive(
        session(
            ("list_dir", {"path": "src/app"}, "cache.py\nstore.py"),
            ("search_code", {"pattern": "ttl", "path": "src"}, "src/app/cache.py:3: ttl = 5"),
            ("read_file", {"path": "src/app/cache.py"}, "ttl = 5"),
            ("read_file", {"path": "src/app/store.py"}, "pass"),
            ("edit_file", {"path": "src/app/cache.py", "old": "5", "new": "6"}, "Applied 1 edit."),
            ("read_file", {"path": "src/app/cache.py"}, "ttl = 6"),
            ("run_command", {"command": "python -m pytest -q"}, "12 passed in 0.3s"),
        )
    )
    assert files(ledger) == {"src/app/store.py": "read (read_file)", "src/app/cache.py": "modified (edit_file)"}
    assert [f.path for f in ledger.files] == ["src/app/store.py", "src/app/cache.py"]  # touched last, listed last
    assert outcomes(ledger) == {"python -m pytest -q": "passed"}


def test_claude_code_tools() -> None:
    todos = [
        {"content": "Reproduce the bug", "status": "completed", "activeForm": "Reproducing"},
        {"content": "Fix the parser", "status": "in_progress", "activeForm": "Fixing"},
    ]
    ledger = derive(
        session(
            ("Read", {"file_path": "/repo/a.py"}, "x = 1"),
            ("Edit", {"file_path": "/repo/b.py", "old_string": "a", "new_string": "b"}, "ok"),
            ("MultiEdit", {"file_path": "/repo/c.py", "edits": []}, "ok"),
            ("Write", {"file_path": "/repo/d.md", "content": "# D"}, "ok"),
            ("NotebookEdit", {"notebook_path": "/repo/e.ipynb", "new_source": "1"}, "ok"),
            ("Bash", {"command": "npm test", "description": "run tests"}, "Exit code 1\nError: 2 tests failed"),
            ("TodoWrite", {"todos": todos}, "Todos have been modified successfully."),
        )
    )
    assert files(ledger) == {
        "/repo/a.py": "read (Read)",
        "/repo/b.py": "modified (Edit)",
        "/repo/c.py": "modified (MultiEdit)",
        "/repo/d.md": "modified (Write)",
        "/repo/e.ipynb": "modified (NotebookEdit)",
    }
    assert ledger.commands == (CommandRun("npm test", "exit 1", "Error: 2 tests failed"),)
    assert ledger.open_errors == ledger.commands
    assert ledger.tasks == (Task("Reproduce the bug", "completed"), Task("Fix the parser", "in_progress"))
    assert "- [in_progress] Fix the parser" in ledger.entries()


PATCH = """*** Begin Patch
*** Update File: src/lib.rs
@@ fn main
-    old();
+    new();
*** Add File: src/new.rs
+pub fn f() {}
*** Delete File: src/old.rs
*** End Patch"""


def test_codex_tools() -> None:
    plan_args = {"explanation": "x", "plan": [{"step": "Read lib.rs", "status": "completed"}, {"step": "Patch it"}]}
    ledger = derive(
        session(
            ("shell", {"command": ["bash", "-lc", "cat src/lib.rs"]}, "fn main() {}"),
            ("shell", {"command": ["cargo", "test"]}, '{"output": "test result: ok", "metadata": {"exit_code": 0}}'),
            ("exec_command", {"cmd": "cargo build"}, "Process exited with code 101\nerror[E0425]: cannot find `x`"),
            ("apply_patch", {"input": PATCH}, "Success. Updated the following files"),
            ("shell", {"command": ["apply_patch", PATCH.replace("src/", "lib/")]}, "Done!"),
            ("update_plan", plan_args, "Plan updated"),
        )
    )
    assert outcomes(ledger) == {"cat src/lib.rs": "ok", "cargo test": "passed", "cargo build": "exit 101"}
    assert ledger.open_errors == (CommandRun("cargo build", "exit 101", "error[E0425]: cannot find `x`"),)
    modified = [p for p, what in files(ledger).items() if what.startswith("modified")]
    assert modified == ["src/lib.rs", "src/new.rs", "src/old.rs", "lib/lib.rs", "lib/new.rs", "lib/old.rs"]
    assert files(ledger)["src/lib.rs"] == "modified (apply_patch)"
    assert ledger.tasks == (Task("Read lib.rs", "completed"), Task("Patch it", "pending"))


def test_a_freeform_patch_is_read_from_the_raw_arguments() -> None:
    ledger = derive(session(("apply_patch", PATCH, "ok")))
    assert [f.path for f in ledger.files] == ["src/lib.rs", "src/new.rs", "src/old.rs"]


def test_opencode_tools() -> None:
    todos = [{"id": "1", "content": "Add a flag", "status": "pending", "priority": "high"}]
    ledger = derive(
        session(
            ("read", {"filePath": "/w/src/cli.ts"}, "export {}"),
            ("edit", {"filePath": "/w/src/cli.ts", "oldString": "a", "newString": "b"}, "ok"),
            ("write", {"filePath": "/w/README.md", "content": "x"}, "ok"),
            ("bash", {"command": "bun test", "description": "tests"}, "3 pass\n1 fail\nFAILED cli.test.ts"),
            ("todowrite", {"todos": todos}, "1 todo"),
        )
    )
    assert files(ledger) == {"/w/src/cli.ts": "modified (edit)", "/w/README.md": "modified (write)"}
    assert ledger.commands == (CommandRun("bun test", "failed", "FAILED cli.test.ts"),)
    assert ledger.tasks == (Task("Add a flag", "pending"),)


def test_other_tools_are_judged_by_name_and_path_argument() -> None:
    ledger = derive(
        session(
            ("str_replace_based_edit_tool", {"command": "view", "path": "a.py"}, "1\tx"),
            ("str_replace_based_edit_tool", {"command": "str_replace", "path": "b.py"}, "ok"),
            ("create_file", {"filename": "c.py"}, "ok"),
            ("cat", {"path": "d.py"}, "x"),
            ("open_file", {"path": "e.py"}, "x"),
            ("create_directory", {"path": "pkg"}, "ok"),
            ("Glob", {"pattern": "*.py", "path": "src"}, "a.py"),
            ("fetch_url", {"url": "https://example.com", "path": "f.py"}, "x"),
        )
    )
    assert files(ledger) == {
        "a.py": "read (str_replace_based_edit_tool)",
        "b.py": "modified (str_replace_based_edit_tool)",
        "c.py": "modified (create_file)",
        "d.py": "read (cat)",
        "e.py": "read (open_file)",
    }


@pytest.mark.parametrize(
    ("command", "written"),
    [
        ("sed -i 's/a/b/' src/x.py", ["src/x.py"]),
        ("sed -i.bak -e 's|a|b|' x.py y.py", ["x.py", "y.py"]),
        ("echo hi > out.txt && cat a >> log.txt", ["out.txt", "log.txt"]),
        ("python gen.py | tee -a gen.txt", ["gen.txt"]),
        ("mv old.py new.py; rm -rf build", ["old.py", "new.py", "build"]),
        ("touch a b 2>/dev/null", ["a", "b"]),
        ("cp src.py dst.py", ["dst.py"]),
        ("sed 's/a/b/' x.py > /dev/null 2>&1", []),
        ("grep -rn 'echo > x' src", []),
        ("python -m pytest -q", []),
    ],
)
def test_shell_commands_that_write_files(command: str, written: list[str]) -> None:
    ledger = derive(session(("run_command", {"command": command}, "")))
    assert [f.path for f in ledger.files] == written
    assert all(f.action == "modified" for f in ledger.files)


@pytest.mark.parametrize(
    ("result", "outcome", "detail"),
    [
        ("exit code: 0\nall good", "passed", "all good"),
        ("Exit code 2\nusage: tool [-h]", "exit 2", "usage: tool [-h]"),
        ("Process exited with code 1\nOutput:\nfatal: not a git repository", "exit 1", "fatal: not a git repository"),
        ("the server exited with 3", "exit 3", ""),
        ('{"output": "", "metadata": {"exit_code": 127, "duration_seconds": 0.1}}', "exit 127", ""),
        (
            "....F\nE   KeyError: 'x'\nFAILED tests/test_a.py::test_b - KeyError\n1 failed, 4 passed in 0.2s",
            "failed",
            "E KeyError: 'x'",
        ),
        ('Traceback (most recent call last):\n  File "a.py", line 1\nValueError: bad', "failed", "ValueError: bad"),
        ("a.py:3: error: Incompatible types\nFound 1 error in 1 file", "failed", "a.py:3: error: Incompatible types"),
        ("Error: Cannot find module 'x'", "failed", "Error: Cannot find module 'x'"),
        ("12 passed in 0.4s", "passed", ""),
        ("Ran 3 tests in 0.001s\n\nOK", "passed", ""),
        ("0 failed, 0 errors", "ok", "0 failed, 0 errors"),
        ("    except ValueError:\n        pass", "ok", "except ValueError:; pass"),
        ("total 8\na.py", "ok", "total 8; a.py"),
        ("version\n-------\nPostgreSQL 15.6\n(1 row)", "ok", "version; PostgreSQL 15.6; (1 row)"),
        ("Exit code: 0\nWall time: 0.2 seconds\nOutput:\nPython 3.11.9", "passed", "Python 3.11.9"),
        ('{"output": "v20.11.1", "metadata": {"exit_code": 0, "duration_seconds": 0.1}}', "passed", "v20.11.1"),
        ("a\nb\nc\nd", "ok", ""),
        ("word " * 60, "ok", ""),
        ('{"output": "' + "x" * 5000 + '", "metadata": {"exit_code": 0}}', "passed", ""),
    ],
)
def test_command_outcomes(result: str, outcome: str, detail: str) -> None:
    """A failure's detail is its first error line; a short output that did not fail is what it found."""
    assert derive(session(("Bash", {"command": "x"}, result))).commands == (CommandRun("x", outcome, detail),)


def test_an_error_line_is_shortened() -> None:
    (run,) = derive(session(("bash", {"command": "x"}, "Error: " + "word " * 100))).commands
    assert len(run.detail) <= 120 and run.detail.endswith("…") and run.detail.startswith("Error: word word")


def test_a_command_that_passes_later_closes_its_error() -> None:
    failing, passing = "1 failed, 3 passed in 0.1s", "4 passed in 0.1s"
    messages = session(
        ("run_command", {"command": "pytest tests/a.py"}, failing),
        ("run_command", {"command": "make lint"}, "Exit code 1\nE501 line too long"),
        ("run_command", {"command": "pytest tests/a.py"}, passing),
        ("run_command", {"command": "ls"}, "a.py"),
    )
    ledger = derive(messages)
    assert outcomes(ledger) == {"make lint": "exit 1", "pytest tests/a.py": "passed", "ls": "ok"}
    assert [r.command for r in ledger.open_errors] == ["make lint"]
    assert [r.command for r in derive(messages[:4]).open_errors] == ["pytest tests/a.py", "make lint"]


def test_a_passing_wider_run_settles_a_narrower_failing_one() -> None:
    ledger = derive(
        session(
            ("run_command", {"command": "python -m pytest tests/a.py -x -k slow"}, "1 failed in 0.1s"),
            ("run_command", {"command": "python -m pytest -q"}, "40 passed in 2s"),
        )
    )
    assert ledger.open_errors == ()
    assert outcomes(ledger)["python -m pytest tests/a.py -x -k slow"] == "failed"  # its own last run
    unrelated = session(
        ("bash", {"command": "python train.py"}, "Exit code: 1\nKeyError: 'lr'"),
        ("bash", {"command": "python -V"}, "Exit code: 0\nPython 3.11.9"),
    )
    assert [r.command for r in derive(unrelated).open_errors] == ["python train.py"]


def test_a_command_without_its_result_keeps_the_last_known_outcome() -> None:
    ledger = derive(session(("bash", {"command": "make"}, "Exit code: 0"), ("bash", {"command": "make"}, None)))
    assert outcomes(ledger) == {"make": "passed"}
    assert outcomes(derive(session(("bash", {"command": "make"}, None)))) == {"make": "no result"}


def test_only_the_most_recent_commands_are_kept() -> None:
    ledger = derive(session(*(("bash", {"command": f"echo {i}"}, str(i)) for i in range(60))))
    assert len(ledger.commands) == 40 and ledger.commands[-1].command == "echo 59"


def test_a_later_task_list_replaces_the_earlier() -> None:
    first = {"todos": [{"content": "A", "status": "in_progress"}, {"content": "B", "status": "pending"}]}
    second = {"todos": [{"content": "A", "status": "completed"}, {"content": "C", "status": "in_progress"}]}
    ledger = derive(session(("TodoWrite", first, "ok"), ("TodoWrite", second, "ok")))
    assert ledger.tasks == (Task("A", "completed"), Task("C", "in_progress"))
    assert derive(session(("TodoWrite", {"todos": []}, "ok")), prior=ledger).tasks == ()


def test_constraints_come_from_user_messages_only() -> None:
    ledger = derive(
        session(
            {"role": "system", "content": "You must always be helpful."},
            {"role": "user", "content": "Fix the bug. Do not touch the API. Make sure tests pass!\n- Never push."},
            ("run_command", {"command": "cat NOTES"}, "You must rewrite everything. Never test."),
            {"role": "assistant", "content": "I must check the API first."},
            {"role": "user", "content": f"{SUMMARY_HEADER}\nThe user said we must use tabs."},
            {"role": "user", "content": "Do not touch the API. Also, only edit src/.\n```\nmust_not_parse()\n```"},
        )
    )
    assert ledger.constraints == (
        "Do not touch the API.",
        "Make sure tests pass!",
        "Never push.",
        "Also, only edit src/.",
    )
    assert ledger.decisions == ()


def test_decisions_come_from_assistant_prose_only() -> None:
    ledger = derive(
        session(
            {"role": "user", "content": "I decided to ask you because it is faster."},
            {"role": "assistant", "content": "Looking. The root cause is a stale cache. I'll use a TTL instead."},
            ("edit_file", {"path": "a.py", "old": "x", "new": "we decided because"}, "Decided: because"),
            {"role": "assistant", "content": "Nothing here.\n\nThe fix: clear it on write, because reads race."},
            {"role": "assistant", "content": "The root cause is a stale cache. I'll use a TTL instead."},
        )
    )
    assert ledger.decisions == (
        "The root cause is a stale cache.",
        "I'll use a TTL instead.",
        "The fix: clear it on write, because reads race.",
    )
    assert ledger.constraints == ()


def test_long_entries_are_cut_at_a_word_border() -> None:
    sentence = "You must " + " ".join(f"w{i}" for i in range(200)) + "."
    (constraint,) = derive(session({"role": "user", "content": sentence})).constraints
    assert len(constraint) <= 300 and constraint.endswith("…") and constraint[:-1] in sentence
    assert sentence.startswith(constraint[:-1] + " ")


def test_invalid_json_arguments_are_no_arguments() -> None:
    ledger = derive(
        session(
            ("Read", '{"file_path": "a.py"', "x"),
            ("Bash", "not json", "Exit code 1"),
            ("edit_file", "[1, 2]", "ok"),
            ("TodoWrite", '{"todos": "none"}', "ok"),
            ("read_file", {"path": "b.py"}, "y"),
        )
    )
    assert ledger == Ledger(files=(FileTouch("b.py", "read", "read_file"),))


def test_derive_updates_a_prior_ledger_across_compactions() -> None:
    first = session(
        {"role": "user", "content": "Never change the public API."},
        ("read_file", {"path": "a.py"}, "x"),
        ("read_file", {"path": "b.py"}, "x"),
        ("run_command", {"command": "pytest"}, "1 failed in 0.1s"),
        ("TodoWrite", {"todos": [{"content": "Fix a", "status": "in_progress"}]}, "ok"),
        {"role": "assistant", "content": "The root cause is in a.py."},
    )
    second = session(
        {"role": "user", "content": "Never change the public API. Keep the diff small."},
        ("edit_file", {"path": "a.py", "old": "x", "new": "y"}, "ok"),
        ("run_command", {"command": "pytest"}, "9 passed in 0.1s"),
        ("TodoWrite", {"todos": [{"content": "Fix a", "status": "completed"}]}, "ok"),
        {"role": "assistant", "content": "The root cause is in a.py. The fix is one line."},
    )
    head = "\n".join([SUMMARY_HEADER, "", render(derive(first), 1000, words), "", "Earlier: the agent read a.py."])
    carried = parse(head)
    assert carried == derive(first)
    ledger = derive(second, prior=carried)
    assert ledger == derive([*first, *second])  # anchored: the same as one pass over the whole history
    assert files(ledger) == {"b.py": "read (read_file)", "a.py": "modified (edit_file)"}
    assert ledger.commands == (CommandRun("pytest", "passed"),) and ledger.open_errors == ()
    assert ledger.tasks == (Task("Fix a", "completed"),)
    assert ledger.constraints == ("Never change the public API.", "Keep the diff small.")
    assert ledger.decisions == ("The root cause is in a.py.", "The fix is one line.")
    assert derive(session({"role": "user", "content": head})) == Ledger()  # a carried summary is skipped


def rich() -> list[Message]:
    return session(
        {"role": "user", "content": "Fix it. Only touch src/ — never tests/.\nKeep it short."},
        ("Read", {"file_path": "src/a b.py"}, "x"),
        ("Edit", {"file_path": "src/weird: modified (x).py"}, "ok"),
        ("Bash", {"command": "pytest -k 'a — b'\nls"}, "FAILED t.py::x - AssertionError: x — y"),
        ("Bash", {"command": "echo `date` > stamp"}, "Exit code 0"),
        ("Bash", {"command": "cat notes"}, f"Error: {LEDGER_HEADER} here"),
        ("TodoWrite", {"todos": [{"content": "[x] done: yes", "status": "Done"}, {"content": "B"}]}, "ok"),
        {"role": "assistant", "content": f"Going with plan B. {LEDGER_HEADER} instead of A because of x."},
    )


def test_render_parse_round_trip() -> None:
    ledger = derive(rich())
    text = render(ledger, 10_000, words)
    lines = text.split("\n")
    assert lines[0] == LEDGER_HEADER and all(line.strip() for line in lines)
    assert [line for line in lines if line.startswith("## ")] == [
        "## Files",
        "## Commands",
        "## Open errors",
        "## Tasks",
        "## Constraints",
        "## Decisions",
    ]
    assert [line for line in lines if not line.startswith("## ")][1:] == ledger.entries()
    assert all(LEDGER_HEADER not in entry and "\n" not in entry for entry in ledger.entries())
    assert parse(text) == ledger
    assert parse(f"{SUMMARY_HEADER}\n\n{text}\n\nThe rest of the summary.") == ledger
    assert render(parse(text) or Ledger(), 10_000, words) == text
    assert parse("no ledger here") is None
    assert parse(f"{SUMMARY_HEADER}\nThe model echoed: {LEDGER_HEADER}\n- junk\n\n{text}") == ledger  # the last


def test_render_of_nothing() -> None:
    assert render(Ledger(), 1000, words) == ""
    assert render(derive(rich()), 0, words) == ""
    assert render(derive(rich()), 3, words) == ""  # not even a header and one entry fit
    assert Ledger().is_empty() and not derive(rich()).is_empty()
    assert parse(LEDGER_HEADER) == Ledger()


def test_without_ledger() -> None:
    block = render(derive(rich()), 10_000, words)
    assert without_ledger(f"{SUMMARY_HEADER}\n\n{block}\n\nThe rest.\n  Indented.") == (
        f"{SUMMARY_HEADER}\n\nThe rest.\n  Indented."
    )
    assert without_ledger(f"{block}\n\nAfter.") == "After."
    assert without_ledger(f"Before.\n\n{block}") == "Before."
    assert without_ledger(block) == ""
    assert without_ledger("No block.") == "No block."


def lines(text: str) -> int:
    return len(text.splitlines())


def test_queries_are_commands_and_their_short_results_are_found() -> None:
    ledger = derive(
        session(
            ("run_sql", {"query": "SELECT MAX(ts) AS latest\nFROM analytics.events"}, "latest\n------\n2024-03-31"),
            ("run_python", {"code": "print(len(df))"}, "2,418,906 rows"),
            ("run_sql", {"query": "SELECT * FROM t LIMIT 9"}, "\n".join(f"row {i}" for i in range(9))),
            ("run_python", {"code": "1/0"}, "Traceback (most recent call last):\nZeroDivisionError: division by zero"),
            ("describe_table", {"table": "events"}, "ts timestamp"),
        )
    )
    assert ledger.commands == (
        CommandRun("SELECT MAX(ts) AS latest FROM analytics.events", "ok", "latest; 2024-03-31"),
        CommandRun("print(len(df))", "ok", "2,418,906 rows"),
        CommandRun("SELECT * FROM t LIMIT 9", "ok"),  # a listing: looked up again, not kept
        CommandRun("1/0", "failed", "ZeroDivisionError: division by zero"),
    )
    assert parse(render(ledger, 1000, len)) == ledger


def test_budget_drops_what_is_easiest_to_redo_first_and_constraints_last() -> None:
    ledger = Ledger(
        files=(*(FileTouch(f"f{i}.py", "read", "Read") for i in range(3)), FileTouch("m0.py", "modified", "Edit")),
        commands=(
            CommandRun("c7", "ok", "port 6543"),
            CommandRun("c0", "ok"),
            CommandRun("c8", "failed", "Error: y"),
            CommandRun("c1", "passed"),
        ),
        open_errors=(CommandRun("c9", "failed", "Error: x"),),
        tasks=(Task("t0", "pending"), Task("t1", "completed"), Task("t2", "in_progress")),
        constraints=("k0 must", "k1 never"),
        decisions=("d0 because",),
    )
    gone: list[str] = []
    for budget in range(lines(render(ledger, 1000, lines)), -1, -1):
        text = render(ledger, budget, lines)
        assert lines(text) <= budget
        gone += [entry for entry in ledger.entries() if entry not in text and entry not in gone]
    assert [entry.split()[1].rstrip(":") for entry in gone] == [
        *("f0.py", "f1.py", "f2.py", "c0", "c1"),  # read, and commands that did not fail
        "[completed]",  # t1
        "c8",
        "c9",
        "c7",  # what a short output found
        "d0",
        *("[in_progress]", "[pending]"),  # t2 then t0
        "m0.py",
        *("k0", "k1"),
    ]


def test_render_is_deterministic_and_budgeted_with_a_real_count() -> None:
    ledger = derive(rich())
    assert derive(rich()) == ledger
    for budget in (5, 20, 40, 80):
        text = render(ledger, budget, len)
        assert len(text) <= budget and text == render(derive(rich()), budget, len)


def test_summary_header_is_the_plans() -> None:
    assert SUMMARY_HEADER == plan.SUMMARY_HEADER


def test_ledger_of_a_generated_trace() -> None:
    trace = coding_trace(seed=0, target_tokens=6000)
    messages = parse_messages(trace.messages)
    ledger = derive(messages)
    edited = next(f for f in ledger.files if f.action == "modified")
    assert edited == FileTouch("src/ledgerly/money.py", "modified", "edit_file")
    assert [f for f in ledger.files if f.action == "modified"] == [edited]
    assert outcomes(ledger)["python -m pytest -q"] == "passed"
    constraint = next(f.text for f in trace.facts if f.kind == "constraint")
    assert any(constraint in c for c in ledger.constraints)
    fix = next(f.text for f in trace.facts if f.kind == "fix")
    assert any(fix in d for d in ledger.decisions)
    assert ledger.open_errors == ()  # the reproduction failed, the full suite passed after the fix
    text = render(ledger, 4000, len)
    assert parse(text) == ledger and derive(parse_messages(trace.messages)) == ledger
    cut = next(f.message_index for f in trace.facts if f.kind == "root_cause")
    assert derive(messages[cut:], prior=parse(render(derive(messages[:cut]), 4000, len))) == ledger


def test_a_rule_with_a_quantifier_is_a_constraint() -> None:
    ledger = derive(
        parse_messages([{"role": "user", "content": "Round every reported figure to two decimals. Go on."}])
    )
    assert ledger.constraints == ("Round every reported figure to two decimals.",)

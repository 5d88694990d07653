"""Salient tokens, the grounding check and pruning (pure)."""

from __future__ import annotations

import pytest

from compaction.checks.grounding import Source, prune, salient_tokens


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # invented names of the trace: camel case, an acronym, a name inside a sentence
        ("The user works on the GolfBridge project funded by the NSF.", ("golfbridge", "nsf")),
        ("They wrote tutorials in JavaScript for Microsoft.", ("javascript", "microsoft")),
        # paths, test ids, commands in backticks, flags, line numbers
        (
            "Run `pytest -x tests/` with --maxfail=1; the bug is in src/dates.py at line 42.",
            ("pytest -x tests/", "--maxfail", "src/dates.py", "42"),
        ),
        ("It fails in tests/test_dates.py::test_parse_iso.", ("tests/test_dates.py::test_parse_iso",)),
        # identifiers: snake case, dotted, letters with digits; ordinals become numbers
        ("Call parse_date via os.path.join, code C0042, on the 22nd.", ("parse_date", "os.path.join", "c0042", "22")),
        ('She said "it was great" on 8 May 2023.', ("it was great", "may", "2023")),
        ('Not "what" but "GolfBridge"; run `pytest` on "retry_out".', ("golfbridge", "pytest", "retry_out")),
        ("See https://example.com/a?b=1 now.", ("https://example.com/a?b=1",)),
    ],
)
def test_salient_tokens(text: str, expected: tuple[str, ...]) -> None:
    assert salient_tokens(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "The user asked for help. They fixed it. Overall it went well.",  # sentence-initial capitals are not names
        "I went there at 3 and came back.",  # single digits and the pronoun I
        "e.g. this and/or that, i.e. nothing well-known.",  # abbreviations, a slash between words, hyphens
        "It passed, But then We saw **What** it did and Why.",  # function words capitalised mid-sentence
    ],
)
def test_ordinary_prose_states_nothing(text: str) -> None:
    assert salient_tokens(text) == ()


def test_check_is_case_insensitive_with_word_boundaries() -> None:
    source = Source("user: the build of golfbridge fails in src/dates.py", "code C0042 at 10:30")
    grounded = source.check("GolfBridge fails in src/dates.py at 10:30.")
    assert grounded.ungrounded == () and grounded.score == 1.0
    partial = source.check("The NSF funds GolfBridge; see code 0042 and file dates.py.")
    # "0042" is inside C0042, not a number of its own; dates.py is a file named in the source
    assert partial.salient == ("nsf", "golfbridge", "0042", "dates.py")
    assert partial.ungrounded == ("nsf", "0042")
    assert partial.score == 0.5


def test_an_ordinal_in_the_source_grounds_its_number_and_no_other() -> None:
    source = Source("A friend made it for my 18th birthday.")
    assert source.check("It was for her 18th birthday.").ungrounded == ()  # a line copied word for word
    assert source.check("She turned 18.").ungrounded == ()
    assert source.check("It was her 18x model.").ungrounded == ("18x",)
    assert source.check("She turned 1.").salient == () and Source("the 180th run").check("18 runs").ungrounded == (
        "18",
    )


def test_a_text_stating_nothing_is_grounded() -> None:
    assert Source("anything").check("A short summary.").score == 1.0


def test_prune_drops_only_sentences_with_invented_tokens() -> None:
    text = "Caroline met Melanie. They talked about the NSF grant.\nMelanie paints on Sundays. They met Bob."
    check = Source("caroline and melanie talked; melanie paints on sundays").check(text)
    assert check.ungrounded == ("nsf", "bob")
    kept, dropped = prune(text, check.ungrounded)
    assert kept == "Caroline met Melanie.\nMelanie paints on Sundays."
    assert dropped == 2
    assert Source("caroline and melanie talked; melanie paints on sundays").check(kept).ungrounded == ()


def test_prune_drops_an_invented_quotation_that_spans_a_sentence_end() -> None:
    text = "The run said `19 passed in 1.89s. 19 failed tests` at the end. Then it went on.\nThe fix is in src/a.py."
    bad = tuple(t for t in salient_tokens(text) if t.startswith("19 passed"))
    pruned, dropped = prune(text, bad)
    assert pruned == "The fix is in src/a.py." and dropped >= 1
    assert not set(bad) & set(salient_tokens(pruned))

from compaction.checks.quality import collapse_repeats, drop_instructions, judge, repetition_ratio


def test_loop_that_hits_the_limit_is_runaway() -> None:
    loop = "Caroline went to the support group. " * 20
    assert repetition_ratio(loop) > 0.8
    assert judge(loop, "length") == "runaway"
    assert judge(loop, "stop") == "runaway"  # a repeated sentence is a loop even when it ended on its own


def test_varied_text_at_the_limit_is_ok() -> None:
    text = " ".join(f"fact {i} about topic {i * 7} happened on day {i * 3}" for i in range(30))
    assert judge(text, "length") == "ok"


def test_empty_and_blank() -> None:
    assert judge("", "stop") == "empty"
    assert judge(" \n\t", "length") == "empty"


def test_collapse_keeps_first_occurrences_in_order() -> None:
    text = "A went home. B stayed. A went home. B stayed.\nA went home."
    assert collapse_repeats(text) == "A went home. B stayed."


def test_sentences_restating_the_instructions_are_dropped_and_content_is_kept() -> None:
    tail = (
        "Summarise the conversation. Use at most 20 words. This part is a conversation: keep who said what, "
        "names, dates, places, plans and decisions. Write only the summary."
    )
    text = (
        "This is a conversation: keep who said what,\nCaroline moved from Sweden 4 years ago. Write only the summary."
    )
    assert drop_instructions(text, tail) == ("Caroline moved from Sweden 4 years ago.", 2)
    for content in ("This is a conversation between Caroline and Melanie.", "They talked about plans and decisions."):
        assert drop_instructions(content, tail) == (content, 0)


def test_a_summary_that_is_nothing_but_its_instructions_is_an_echo() -> None:
    tail = (
        "Summarise the conversation. Use at most 20 words. This part is a conversation: keep who said what, "
        "names, dates, places, plans and decisions. Write only the summary."
    )
    echo = "This part is a conversation: keep who said what,\nWrite only the summary."
    assert judge(echo, "stop", instructions=tail) == "echo"
    assert judge(echo, "stop") == "ok"  # without the prompt's instructions nothing is an echo
    assert judge(f"{echo} Caroline moved from Sweden 4 years ago.", "stop", instructions=tail) == "ok"
    assert judge("They talked about plans and decisions.", "stop", instructions=tail) == "ok"


def test_the_chunk_opening_a_tail_quotes_is_content_not_instructions() -> None:
    tail = (
        "Summarise part 2 of the conversation above: only the last part, which begins with “we walked up to the "
        "castle with my sister” and runs to the end. Write only the summary."
    )
    said = "We walked up to the castle with my sister."
    assert drop_instructions(said, tail) == (said, 0)
    assert judge(said, "stop", instructions=tail) == "ok"
    assert judge("Summarise only the last part of the conversation.", "stop", instructions=tail) == "echo"

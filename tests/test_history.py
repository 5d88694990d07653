import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compaction.errors import InvalidInput
from compaction.history import chat_view, parse_messages, template_view
from compaction.render import content_spans, encode_rendering, render_history
from compaction.tokenizer import HFChatTokenizer


def test_message_starts_split_the_rendering(tokenizer: HFChatTokenizer) -> None:
    messages = parse_messages(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Where is Paris?"},
            {"role": "assistant", "content": "In France."},
        ]
    )
    rendered = render_history(messages, tokenizer)
    ids = rendered.token_ids
    assert rendered.message_starts[0] == 0
    for i, start in enumerate(rendered.message_starts):
        end = (*rendered.message_starts[1:], len(ids))[i]
        piece = tokenizer.decode(ids[start:end])
        assert messages[i].text() in piece
    assert list(ids) == tokenizer.encode(tokenizer.render([template_view(m) for m in messages]))


def test_tool_traffic_has_an_explicit_rendering() -> None:
    call = parse_messages(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "function": {"name": "ls", "arguments": "{}"}}],
            }
        ]
    )[0]
    result = parse_messages([{"role": "tool", "tool_call_id": "c1", "content": "a.txt"}])[0]
    assert template_view(call) == {"role": "assistant", "content": "[tool call c1] ls({})"}
    assert template_view(result) == {"role": "user", "content": "[tool result c1] a.txt"}


def test_a_chat_view_renders_as_the_chat_endpoint_does(tokenizer: HFChatTokenizer) -> None:
    """What a chat completion of the messages prefills: the model's template over the OpenAI messages, null
    content as "", arguments parsed. A compacted prompt warmed this way is what the agent's next turn reads."""
    call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
    raw = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix a.py."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "def f(): pass"},
    ]
    views = [chat_view(m) for m in parse_messages(raw)]
    assert views[2]["content"] == "" and views[2]["tool_calls"][0]["function"]["arguments"] == {"path": "a.py"}
    assert views[3]["tool_call_id"] == "call_1"
    expected = tokenizer._tok.apply_chat_template([{**m, "content": m["content"] or ""} for m in raw], tokenize=False)
    assert tokenizer.render(views) == expected
    assert tokenizer.render(views) != tokenizer.render([template_view(m) for m in parse_messages(raw)])


def test_text_parts_are_joined() -> None:
    message = parse_messages(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert message[0].text() == "ab"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user"}], "messages[0].content"),
    ],
)
def test_bad_messages_name_the_field(raw: list, field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_messages(raw)
    assert err.value.field.startswith(field)


tricky = st.sampled_from(["", "user", "assistant", "\n", " padded ", "<|im_end|>", "Paris", "a\nb", "system"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    turns=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), st.lists(tricky, min_size=1, max_size=4)),
        min_size=1,
        max_size=12,
    )
)
def test_located_borders_equal_exact_prefix_rendering(tokenizer: HFChatTokenizer, turns) -> None:
    messages = parse_messages([{"role": r, "content": "".join(parts)} for r, parts in turns])
    rendered = render_history(messages, tokenizer)
    views = [template_view(m) for m in messages]
    text = tokenizer.render(views)
    _, offsets = encode_rendering(text, content_spans(views, text, tokenizer), tokenizer)
    for i, start in enumerate(rendered.message_starts):
        prefix = len(tokenizer.render(views[:i]) if i else tokenizer.preamble(views[0]["role"]))
        assert start == sum(1 for o in offsets if o < prefix)


def test_counting_beside_a_thread_that_encodes_special_tokens_as_text_counts_the_same(tokenizer) -> None:
    """transformers keeps split_special_tokens as shared state of the Rust tokenizer: without a lock, a count made
    while another thread encodes `as_text` splits the role markers into characters (a longer prompt)."""
    text = tokenizer.render([{"role": "user", "content": "hi"}] * 50, add_generation_prompt=True)
    expected = len(tokenizer.encode(text))
    stop = threading.Event()

    def as_text() -> None:
        while not stop.is_set():
            tokenizer.encode_with_offsets(text, as_text=True)

    other = threading.Thread(target=as_text)
    other.start()
    try:
        counts = {len(tokenizer.encode(text)) for _ in range(300)}
    finally:
        stop.set()
        other.join()
    assert counts == {expected}


def test_the_tokenizer_loads_without_torch_and_as_autotokenizer_would(tokenizer: HFChatTokenizer, model_path) -> None:
    """A coordinator loads the tokenizer and runs no model: loading it imports no torch. What it renders, counts and
    decodes is AutoTokenizer's (the model's own tokenizer class)."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    load = f"from compaction.tokenizer import HFChatTokenizer as T; T.from_path({str(model_path)!r}); import sys; "
    code = load + "print('torch' in sys.modules)"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert probe.stdout.strip() == "False", probe.stderr[-2000:]
    auto = HFChatTokenizer(AutoTokenizer.from_pretrained(str(model_path)))
    tools = [{"type": "function", "function": {"name": "shell", "parameters": {"type": "object", "properties": {}}}}]
    views = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List the files <|im_end|> in /tmp, then say «fini»."},
        {"role": "assistant", "content": "Done: a.txt, b.txt"},
    ]
    rendered = tokenizer.render(views, True, tools)
    assert rendered == auto.render(views, True, tools)
    assert tokenizer.encode(rendered) == auto.encode(rendered)
    assert tokenizer.decode(tokenizer.encode(rendered)) == auto.decode(auto.encode(rendered))
    assert tokenizer.special_tokens == auto.special_tokens
    assert tokenizer.control_token_ids == auto.control_token_ids


def test_a_model_folder_without_a_fast_tokenizer_is_refused_saying_what_to_do(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(InvalidInput, match=r"no tokenizer\.json.*convert it first"):
        HFChatTokenizer.from_path(tmp_path)

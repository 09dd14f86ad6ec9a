"""Chat encoding (SPEC §14). Expected prompts are written out by hand from SPEC's rules, with the special strings
spelled literally here (not imported), so a wrong constant or a wrong rule fails."""
from __future__ import annotations

import json

import pytest
from conftest import fixture_dir

from functional_dsv41 import encoding as enc
from functional_dsv41.encoding import encode_messages, parse_assistant

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A, S, R = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<｜latest_reminder｜>"
IMG = "<｜deepseek_image｜>"
EFF = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
TASKS = ["<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>"]


def sysm(c, **kw):
    return {"role": "system", "content": c, **kw}


def user(c, **kw):
    return {"role": "user", "content": c, **kw}


def asst(c, r=None, calls=None):
    m = {"role": "assistant", "content": c}
    if r is not None:
        m["reasoning_content"] = r
    if calls is not None:
        m["tool_calls"] = calls
    return m


def tool(c, tid=None):
    return {"role": "tool", "content": c, **({"tool_call_id": tid} if tid else {})}


# ----------------------------------------------------------------------------- items 1, 2, 4, 6: basic turns
def test_single_user_chat_and_thinking():
    assert encode_messages([user("Hello")], "chat") == B + U + "Hello" + A + "</think>"
    assert encode_messages([user("Hello")], "thinking") == B + S + EFF.format(75) + U + "Hello" + A + "<think>"
    assert encode_messages([user("Hello")], "chat", add_default_bos_token=False) == U + "Hello" + A + "</think>"


@pytest.mark.parametrize("effort,budget", [(None, 75), ("low", 50), ("high", 75), ("max", 100),
                                           (1, 1), (37, 37), (100, 100)])
def test_reasoning_effort(effort, budget):
    got = encode_messages([sysm("Sys"), user("Q")], "thinking", reasoning_effort=effort)
    assert got == B + S + EFF.format(budget) + "Sys" + U + "Q" + A + "<think>"
    # chat mode: no effort line, the first system message still gets <｜System｜>
    assert encode_messages([sysm("Sys"), user("Q")], "chat", reasoning_effort=effort) == B + S + "Sys" + U + "Q" + A + "</think>"


@pytest.mark.parametrize("effort", [0, 101, -5, "medium", "xhigh", "HIGH", True, 50.0, "50"])
def test_bad_reasoning_effort(effort):
    for mode in ("thinking", "chat"):
        with pytest.raises(ValueError, match=r"reasoning_effort=.*not valid.*1-100.*'low' \(50\).*'max' \(100\)") as ei:
            encode_messages([user("Q")], mode, reasoning_effort=effort)
        assert repr(effort) in str(ei.value)


# ----------------------------------------------------------------------------- item 5: assistant turns, drop_thinking
CONV = [sysm("You are terse."), user("Q1"), asst("A1", "R1"), user("Q2"), asst("A2", "R2")]


def test_multi_turn_thinking_drop():
    assert encode_messages(CONV, "thinking") == (
        B + S + EFF.format(75) + "You are terse." + U + "Q1" + A + "</think>" + "A1" + E
        + U + "Q2" + A + "<think>" + "R2</think>A2" + E)


def test_multi_turn_thinking_keep():
    assert encode_messages(CONV, "thinking", drop_thinking=False) == (
        B + S + EFF.format(75) + "You are terse." + U + "Q1" + A + "<think>" + "R1</think>A1" + E
        + U + "Q2" + A + "<think>" + "R2</think>A2" + E)


def test_multi_turn_chat_never_shows_reasoning():
    want = B + S + "You are terse." + U + "Q1" + A + "</think>A1" + E + U + "Q2" + A + "</think>A2" + E
    assert encode_messages(CONV, "chat") == want
    assert encode_messages(CONV, "chat", drop_thinking=False) == want


def test_open_prompt_after_history_and_reasoning_alias():
    msgs = [user("Q1"), {"role": "assistant", "content": "A1", "reasoning": "R1"}, user("Q2")]
    assert encode_messages(msgs, "thinking", reasoning_effort="max") == (
        B + S + EFF.format(100) + U + "Q1" + A + "</think>A1" + E + U + "Q2" + A + "<think>")
    assert encode_messages(msgs, "thinking", drop_thinking=False, reasoning_effort=20) == (
        B + S + EFF.format(20) + U + "Q1" + A + "<think>R1</think>A1" + E + U + "Q2" + A + "<think>")
    # an assistant without reasoning still closes the (empty) thought in thinking mode
    assert encode_messages([user("Q"), asst("A")], "thinking") == B + S + EFF.format(75) + U + "Q" + A + "<think></think>A" + E


# ----------------------------------------------------------------------------- tool calls and tool results
CALLS_TEXT = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get">\n'
              '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
              '<｜DSML｜ invoke name="get">\n<｜DSML｜ parameter name="city" string="true">Rome</｜DSML｜ parameter>\n'
              '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
CALLS = [{"id": "c1", "name": "get", "arguments": {"city": "Paris"}},
         {"id": "c2", "name": "get", "arguments": {"city": "Rome", "days": 3}}]
OPENAI_CALLS = [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get", "arguments": '{"city": "Rome", "days": 3}'}}]


@pytest.mark.parametrize("calls", [CALLS, OPENAI_CALLS], ids=["plain", "openai"])
def test_tool_results_merge_in_call_order(calls):
    # results arrive c2, c1; they are rendered in the assistant's call order c1, c2, then the user's text
    msgs = [user("Weather?"), asst("", "need data", calls), tool("R-Rome", "c2"), tool("R-Paris", "c1"), user("Thanks")]
    merged = U + "<tool_result>R-Paris</tool_result>\n\n<tool_result>R-Rome</tool_result>\n\nThanks"
    assert encode_messages(msgs, "chat") == B + U + "Weather?" + A + "</think>" + CALLS_TEXT + E + merged + A + "</think>"
    # thinking + drop: the calling turn precedes the last user turn (the merged results), so no reasoning
    assert encode_messages(msgs, "thinking") == (
        B + S + EFF.format(75) + U + "Weather?" + A + "</think>" + CALLS_TEXT + E + merged + A + "<think>")
    assert encode_messages(msgs, "thinking", drop_thinking=False) == (
        B + S + EFF.format(75) + U + "Weather?" + A + "<think>need data</think>" + CALLS_TEXT + E + merged + A + "<think>")


def test_tool_call_with_content_and_block_results():
    msgs = [user("Q"), asst("Let me look.", calls=[{"name": "f", "arguments": {}}]),
            {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert encode_messages(msgs, "chat") == (
        B + U + "Q" + A + "</think>Let me look.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n\n</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls>" + E + U + "<tool_result>a\n\nb</tool_result>" + A + "</think>")


def test_non_string_arguments_are_json():
    calls = [{"name": "g", "arguments": {"s": "3", "n": 3, "b": True, "z": None, "o": {"k": ["é", 1.5]}}}]
    got = encode_messages([user("Q"), asst("", calls=calls)], "chat")
    assert got.endswith('<｜DSML｜ invoke name="g">\n'
                        '<｜DSML｜ parameter name="s" string="true">3</｜DSML｜ parameter>\n'
                        '<｜DSML｜ parameter name="n" string="false">3</｜DSML｜ parameter>\n'
                        '<｜DSML｜ parameter name="b" string="false">true</｜DSML｜ parameter>\n'
                        '<｜DSML｜ parameter name="z" string="false">null</｜DSML｜ parameter>\n'
                        '<｜DSML｜ parameter name="o" string="false">{"k": ["é", 1.5]}</｜DSML｜ parameter>\n'
                        '</｜DSML｜ invoke>\n</｜DSML｜ calls>' + E)


def test_tools_force_drop_thinking_off_and_tools_block_not_implemented():
    tools = [{"type": "function", "function": {"name": "get", "parameters": {}}}]
    msgs = [user("Q1"), asst("A1", "R1"), user("Q2")]
    # the context (already encoded elsewhere) carries the tools: drop_thinking is forced off
    got = encode_messages(msgs, "thinking", context=[sysm("S", tools=tools)])
    assert got == U + "Q1" + A + "<think>R1</think>A1" + E + U + "Q2" + A + "<think>"
    assert encode_messages(msgs, "thinking", context=[sysm("S")]) == U + "Q1" + A + "</think>A1" + E + U + "Q2" + A + "<think>"
    with pytest.raises(NotImplementedError, match=r"messages\[0\].*## Tools.*SPEC §14"):
        encode_messages([sysm("S", tools=tools), user("Q")], "chat")


# ----------------------------------------------------------------------------- system turns, reminders, response format
def test_mid_conversation_system_acts_like_user():
    msgs = [sysm("S0"), user("Q"), asst("A", "R"), sysm("S1")]
    assert encode_messages(msgs, "chat") == B + S + "S0" + U + "Q" + A + "</think>A" + E + S + "S1" + A + "</think>"
    assert encode_messages(msgs, "thinking") == (
        B + S + EFF.format(75) + "S0" + U + "Q" + A + "</think>A" + E + S + "S1" + A + "<think>")
    assert encode_messages([sysm("S")], "chat") == B + S + "S" + A + "</think>"


def test_context_shifts_indices():
    ctx = [sysm("S0"), user("Q"), asst("A")]
    # no BOS, no effort line; a system message of `messages` is a later system message
    assert encode_messages([sysm("S1"), user("Q2")], "thinking", context=ctx) == S + "S1" + U + "Q2" + A + "<think>"


def test_latest_reminder_and_response_format():
    assert encode_messages([user("Q"), {"role": "latest_reminder", "content": "Be brief."}], "chat") == (
        B + U + "Q" + A + "</think>" + R + "Be brief.")
    got = encode_messages([sysm("S", response_format={"type": "object"}), user("Q")], "chat")
    assert got == (B + S + "S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                   '{"type": "object"}' + U + "Q" + A + "</think>")


def test_package_exports():
    import functional_dsv41 as fd
    assert fd.encode_messages is encode_messages and fd.parse_assistant is parse_assistant


def test_consecutive_user_messages_form_one_turn():
    assert encode_messages([user("a"), user("b")], "chat") == B + U + "a\n\nb" + A + "</think>"


# ----------------------------------------------------------------------------- images
def test_images_in_prompt_order():
    msgs = [user([{"type": "text", "text": "Look:"}, {"type": "image", "image": "img-A"},
                  {"type": "text", "text": "and"}, {"type": "image_url", "image_url": {"url": "u"}}]),
            asst("ok", calls=[{"id": "x", "name": "f", "arguments": {}}, {"id": "y", "name": "f", "arguments": {}}]),
            tool([{"type": "image", "image": "img-Y"}], "y"), tool([{"type": "image", "image": "img-X"}], "x")]
    prompt, media = encode_messages(msgs, "chat", return_multi_modal_data=True)
    assert prompt.startswith(B + U + "Look:\n\n" + IMG + "\n\nand\n\n" + IMG + A + "</think>ok")
    assert prompt.endswith(E + U + f"<tool_result>{IMG}</tool_result>\n\n<tool_result>{IMG}</tool_result>" + A + "</think>")
    assert media == {"images": ["img-A", {"url": "u"}, "img-X", "img-Y"]}
    _, media = encode_messages([user("next")], "chat", context=msgs, return_multi_modal_data=True)
    assert media == {"images": []}     # context images were returned when the context was encoded


# ----------------------------------------------------------------------------- tasks
def test_tasks():
    assert encode_messages([user("Do it", task="action")], "thinking") == (
        B + S + EFF.format(75) + U + "Do it" + A + "<think><｜action｜>")
    assert encode_messages([user("Do it", task="action")], "chat") == B + U + "Do it" + A + "</think><｜action｜>"
    for name, tok in zip(["query", "authority", "domain", "title", "read_url"], TASKS[1:]):
        assert encode_messages([user("x", task=name)], "chat") == B + U + "x" + tok
    # the answer to a task has no reasoning part, even in thinking mode
    assert encode_messages([user("q", task="query"), asst("paris weather")], "thinking") == (
        B + S + EFF.format(75) + U + "q<｜query｜>paris weather" + E)
    with pytest.raises(ValueError, match=r"messages\[0\].*task.*user message follows"):
        encode_messages([user("q", task="title"), user("more")], "chat")
    with pytest.raises(ValueError, match=r"messages\[3\] \(user\).*task.*user message follows"):
        encode_messages([user("q"), asst("", calls=CALLS[:1]), tool("r"), user("q", task="title"), user("x")], "chat")
    with pytest.raises(ValueError, match=r"messages\[0\].*task 'summarize'"):
        encode_messages([user("q", task="summarize")], "chat")
    with pytest.raises(ValueError, match=r"messages\[1\] \(assistant\).*task"):
        encode_messages([user("q"), {"role": "assistant", "content": "a", "task": "query"}], "chat")


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("msgs,exc,pattern", [
    ([user("Q"), {"role": "robot", "content": "x"}], ValueError, r"messages\[1\]: unknown role 'robot'"),
    ([{"content": "x"}], ValueError, r"messages\[0\]: unknown role None"),
    (["hello"], TypeError, r"messages\[0\]: a message must be a dict"),
    ([user("Q"), tool("r")], ValueError, r"messages\[1\] \(tool\): tool message with no preceding assistant tool call"),
    ([user("Q"), asst("A"), tool("r")], ValueError, r"messages\[2\] \(tool\): tool message with no preceding"),
    ([user("Q"), asst("", calls=CALLS), tool("a", "c1"), tool("b", "c2"), tool("c")], ValueError,
     r"messages\[4\] \(tool\): more tool results than the assistant's 2 tool calls"),
    ([user("Q"), asst("", calls=CALLS), tool("a", "c9")], ValueError, r"messages\[2\].*tool_call_id 'c9' matches none"),
    ([user(5)], TypeError, r"messages\[0\] \(user\): content must be a string or a list of content blocks, got int"),
    ([user(None)], ValueError, r"messages\[0\] \(user\): missing content"),
    ([user("Q"), asst(["A"])], TypeError, r"messages\[1\] \(assistant\): content must be a string, got list"),
    ([user("Q"), asst("A", r=3)], TypeError, r"messages\[1\] \(assistant\) reasoning: content must be a string"),
    ([user([{"type": "audio"}])], ValueError, r"messages\[0\] \(user\): content block 0 must be a dict with type"),
    ([user([{"type": "text", "text": 1}])], TypeError, r"messages\[0\] \(user\): content block 0 \(text\) needs a string"),
    ([user("Q"), asst("", calls=[{"name": "f", "arguments": "{oops"}])], ValueError,
     r"messages\[1\] \(assistant\) tool_calls\[0\]: tool call 'f' arguments are not valid JSON"),
    ([user("Q"), asst("", calls=[{"name": "f", "arguments": [1]}])], TypeError, r"tool_calls\[0\].*must be a dict"),
    ([user("Q"), asst("", calls=[{"arguments": {}}])], ValueError, r"tool_calls\[0\]: tool call name must be"),
    ([user("Q", tools=[{}])], ValueError, r"messages\[0\] \(user\): 'tools' belongs on a system message"),
    ([user("Q", tool_calls=CALLS)], ValueError, r"messages\[0\] \(user\): only assistant messages carry tool_calls"),
])
def test_bad_messages(msgs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        encode_messages(msgs, "chat")


def test_bad_arguments():
    with pytest.raises(ValueError, match="thinking_mode must be 'thinking' or 'chat', got 'think'"):
        encode_messages([user("Q")], "think")
    with pytest.raises(ValueError, match="non-empty list"):
        encode_messages([], "chat")
    with pytest.raises(TypeError, match="context must be a list"):
        encode_messages([user("Q")], "chat", context="earlier")
    with pytest.raises(ValueError, match=r"context\[0\]: unknown role 'bot'"):
        encode_messages([user("Q")], "chat", context=[{"role": "bot"}])


# ----------------------------------------------------------------------------- parse_assistant
ROUND_TRIP = [
    {"reasoning": "think hard", "content": "The answer is 4.", "tool_calls": []},
    {"reasoning": "", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]},
    {"reasoning": "multi\nline </thinking", "content": "Calling.\n\n",
     "tool_calls": [{"name": "search", "arguments": {"q": "a \"quoted\"\nline", "n": 3, "s": "3", "flag": False,
                                                     "opt": None, "obj": {"k": ["é", 1.5]}}},
                    {"name": "get_time", "arguments": {"tz": "UTC"}}]},
    {"reasoning": "r", "content": "ünïcode ✓ <think> text", "tool_calls": []},
]


@pytest.mark.parametrize("mode", ["thinking", "chat"])
@pytest.mark.parametrize("msg", ROUND_TRIP)
def test_parse_round_trip(msg, mode):
    """prompt + generation == the rendered conversation, and parsing the generation gives the message back."""
    am = {"role": "assistant", "content": msg["content"], "reasoning_content": msg["reasoning"],
          "tool_calls": msg["tool_calls"]}
    prompt = encode_messages([user("Q")], mode)
    full = encode_messages([user("Q"), am], mode)
    assert full.startswith(prompt)
    want = dict(msg, reasoning=msg["reasoning"] if mode == "thinking" else None)
    assert parse_assistant(full[len(prompt):], mode) == want
    assert parse_assistant(full[len(prompt):-len(E)], mode) == want       # EOS optional


def test_parse_hand_written():
    text = ('plan</think>Sure.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="add">\n'
            '<｜DSML｜ parameter name="a" string="false">1</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="b" string="true">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>' + E)
    assert parse_assistant(text) == {"reasoning": "plan", "content": "Sure.",
                                     "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": "2"}}]}
    assert parse_assistant("still thinking") == {"reasoning": "still thinking", "content": "", "tool_calls": []}
    assert parse_assistant("a</think>b", "chat") == {"reasoning": None, "content": "a</think>b", "tool_calls": []}


@pytest.mark.parametrize("block,pattern", [
    ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n\n</｜DSML｜ invoke>\n', r"expected '</｜DSML｜ calls>'|expected an invoke"),
    ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="maybe">1</｜DSML｜ parameter>\n'
     '</｜DSML｜ invoke>\n</｜DSML｜ calls>', r"expected a parameter of 'f'"),
    ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="false">nope</｜DSML｜ parameter>\n'
     '</｜DSML｜ invoke>\n</｜DSML｜ calls>', r"parameter 'a' has string=\"false\" but its value 'nope'"),
    ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls> trailing', r"text after the DSML"),
    ('<｜DSML｜ calls><｜DSML｜ invoke name="f">', r"offset 0: expected"),
])
def test_parse_malformed(block, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_assistant("r</think>x\n\n" + block)


# ----------------------------------------------------------------------------- the release tokenizer
def test_special_strings_are_single_tokens():
    tok_json = fixture_dir("release-engram") / "tokenizer.json"
    literal = [B, E, U, A, S, R, "<think>", "</think>", "｜DSML｜", IMG, *TASKS]
    assert sorted(enc.SPECIAL_STRINGS) == sorted(literal)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        pytest.skip("the tokenizers package is not installed")
    tk = Tokenizer.from_file(str(tok_json))
    added = {t["content"]: t["id"] for t in json.loads(tok_json.read_text(encoding="utf-8"))["added_tokens"]}
    for s in literal:
        assert added.get(s) is not None, s
        assert tk.encode(s, add_special_tokens=False).ids == [added[s]], s
    assert (added[B], added[E], added[IMG]) == (0, 1, 129264)       # SPEC §14 / HF config
    ids = tk.encode(encode_messages([user([{"type": "image", "image": 0}, {"type": "text", "text": "hi"}])],
                                    "thinking"), add_special_tokens=False).ids
    assert ids[:2] == [0, added[S]] and ids[-2:] == [added[A], added["<think>"]]
    assert ids.count(129264) == 1 and added[U] in ids
    dsml = tk.encode(CALLS_TEXT, add_special_tokens=False).ids
    assert dsml.count(added["｜DSML｜"]) == CALLS_TEXT.count("｜DSML｜")


def test_template_markers_inside_assistant_text_are_refused():
    """Inside an assistant turn's text, the template's own markers would end the reasoning or open a tool-call
    block early: the prompt would not parse back. NaN arguments are not JSON."""
    import pytest

    from functional_dsv41 import encoding as E
    for msg, match in [({"role": "assistant", "content": "b", "reasoning_content": "a</think>b"}, "reasoning contains"),
                       ({"role": "assistant", "content": f"use the {E.CALLS_OPEN} tag"}, "content contains"),
                       ({"role": "assistant", "content": "x", "tool_calls": [{"name": "f", "arguments": {"a": float("nan")}}]},
                        "not JSON-serialisable")]:
        with pytest.raises((ValueError, TypeError), match=match):
            E.encode_messages([{"role": "user", "content": "hi"}, msg, {"role": "user", "content": "ok"}], "thinking")


def test_malformed_assistant_and_tool_messages_are_refused():
    """Input the template cannot render faithfully is refused, naming the message: an argument holding the
    parameter's closing tag (the DSML block would end early and not parse back), reasoning_content and its alias
    reasoning that disagree (which one renders?), and a task on a tool message (tasks belong on system, user or
    latest_reminder messages, SPEC §14 item 6)."""
    close = "</｜DSML｜ parameter>"
    with pytest.raises(ValueError, match=r"messages\[1\] \(assistant\) tool_calls\[0\].*'a' contains"):
        encode_messages([user("Q"), asst("", calls=[{"name": "f", "arguments": {"a": f"x{close}y"}}])], "chat")
    with pytest.raises(ValueError, match=r"messages\[1\] \(assistant\).*'reasoning_content' and 'reasoning' disagree"):
        encode_messages([user("Q"), {"role": "assistant", "content": "A", "reasoning_content": "R1",
                                     "reasoning": "R2"}], "thinking")
    with pytest.raises(ValueError, match=r"messages\[2\] \(tool\): task 'query' is not allowed"):
        encode_messages([user("Q"), asst("", calls=CALLS[:1]), {"role": "tool", "content": "r", "task": "query"}],
                        "chat")


def test_parse_refuses_a_parameter_given_twice():
    """A generated call naming one parameter twice is malformed: keeping either value silently would change the
    call."""
    block = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
             '<｜DSML｜ parameter name="a" string="true">1</｜DSML｜ parameter>\n'
             '<｜DSML｜ parameter name="a" string="true">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    with pytest.raises(ValueError, match=r"DSML tool call 'f': parameter 'a' given twice"):
        parse_assistant("r</think>x\n\n" + block)

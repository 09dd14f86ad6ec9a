"""Chat encoding (SPEC §14): messages -> prompt string, and generated assistant text -> message.

A message is a dict with a ``role`` in ``ROLES`` and, by role:
  system          content (str | blocks | None), response_format (JSON-able), tools (see below), task
  user            content (str | blocks), task
  latest_reminder content (str | blocks), task
  assistant       content (str | None), reasoning_content (or reasoning; str | None),
                  tool_calls [{name, arguments: dict | JSON str, id?}] or OpenAI's [{id, function: {name, arguments}}]
  tool            content (str | blocks), tool_call_id (optional)
Content blocks are ``{"type": "text", "text": str}`` or ``{"type": "image" | "image_url", <type>: payload}``; the
payload (or the block, if it has no such key) is what ``media["images"]`` returns.

Not implemented: the ``## Tools`` block that a system message's ``tools`` adds (SPEC §14 item 3). SPEC names
the template in the release's encoding/README.md but does not reproduce its text, and a guessed text would be
a silently wrong prompt; rendering a system message that carries tools raises NotImplementedError. Tool CALLS
in assistant turns and tool RESULTS are fully specified and implemented.

Where SPEC is silent the behaviour follows the adapted code SPEC cites, and is marked [code]: consecutive
user/tool messages form one user turn; a ``latest_reminder`` right after a user turn comes after its
``<｜Assistant｜>`` header; in thinking mode with drop_thinking the headers of earlier turns end in ``</think>``;
the assistant answer to a task message has no reasoning part.
"""
from __future__ import annotations

import json
import re
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"       # id 0
EOS = "<｜end▁of▁sentence｜>"         # id 1
USER, ASSISTANT, SYSTEM = "<｜User｜>", "<｜Assistant｜>", "<｜System｜>"
REMINDER = "<｜latest_reminder｜>"
THINK, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
IMAGE = "<｜deepseek_image｜>"        # id 129264
TASK_TOKENS = {t: f"<｜{t}｜>" for t in ("action", "query", "authority", "domain", "title", "read_url")}
SPECIAL_STRINGS = (BOS, EOS, USER, ASSISTANT, SYSTEM, REMINDER, THINK, THINK_END, DSML, IMAGE,
                   *TASK_TOKENS.values())

ROLES = ("system", "user", "latest_reminder", "assistant", "tool")
REASONING_EFFORT = {"low": 50, "high": 75, "max": 100}   # SPEC §14 item 2
DEFAULT_REASONING_EFFORT = "high"
EFFORT_LINE = ("Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n")
RESPONSE_FORMAT = "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{}"
TOOLS_TEMPLATE_MISSING = ("the '## Tools' system-prompt template (SPEC §14 item 3, the release's encoding/README.md) "
                          "is not reproduced in SPEC, so functional_dsv41.encoding cannot render a system message's "
                          "'tools'; pass tools=None")

CALLS_OPEN, CALLS_CLOSE = f"<{DSML} calls>", f"</{DSML} calls>"
INVOKE_CLOSE, PARAM_CLOSE = f"</{DSML} invoke>", f"</{DSML} parameter>"
_INVOKE_RE = re.compile(f'<{DSML} invoke name="([^"\n]*)">\n')
_PARAM_RE = re.compile(f'<{DSML} parameter name="([^"\n]*)" string="(true|false)">(.*?){PARAM_CLOSE}', re.S)
_IMAGE_TYPES = ("image", "image_url")


def _json(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, allow_nan=False)     # NaN / Infinity are not JSON


def effort_budget(reasoning_effort: int | str | None) -> int:
    """The ``Reasoning Effort`` budget (SPEC §14 item 2): an int 1-100, or low=50 / high=75 (None) / max=100."""
    e = DEFAULT_REASONING_EFFORT if reasoning_effort is None else reasoning_effort
    if type(e) is int and 1 <= e <= 100:
        return e
    if isinstance(e, str) and e in REASONING_EFFORT:
        return REASONING_EFFORT[e]
    raise ValueError(f"reasoning_effort={reasoning_effort!r} is not valid: use an int in the range 1-100 or one of "
                     + ", ".join(f"{k!r} ({v})" for k, v in REASONING_EFFORT.items()))


def _content(content: Any, where: str, blocks: bool = True) -> tuple[str, list]:
    """Render content (SPEC §14 item 1): a string as is; blocks joined with "\\n\\n", an image block becoming
    ``IMAGE`` (its payload collected in order). Returns (text, images)."""
    if isinstance(content, str):
        return content, []
    if not blocks or not isinstance(content, (list, tuple)):
        need = "a string" + ("" if not blocks else " or a list of content blocks")
        raise TypeError(f"{where}: content must be {need}, got {type(content).__name__}")
    parts, images = [], []
    for j, b in enumerate(content):
        t = b.get("type") if isinstance(b, dict) else None
        if t == "text":
            if not isinstance(b.get("text"), str):
                raise TypeError(f"{where}: content block {j} (text) needs a string 'text', got "
                                f"{type(b.get('text')).__name__}")
            parts.append(b["text"])
        elif t in _IMAGE_TYPES:
            parts.append(IMAGE)
            images.append(b.get(t, b))
        else:
            raise ValueError(f"{where}: content block {j} must be a dict with type 'text', 'image' or 'image_url', "
                             f"got {b!r:.80}")
    return "\n\n".join(parts), images


def _tool_call(tc: Any, where: str) -> dict:
    """One assistant tool call as {name, arguments: dict, id}; accepts the plain and the OpenAI form."""
    if not isinstance(tc, dict):
        raise TypeError(f"{where}: a tool call must be a dict, got {type(tc).__name__}")
    fn = tc["function"] if isinstance(tc.get("function"), dict) else tc
    name, args = fn.get("name"), fn.get("arguments", {})
    if not isinstance(name, str) or not name or '"' in name or "\n" in name:
        raise ValueError(f"{where}: tool call name must be a non-empty string without '\"' or newline, got {name!r}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: tool call {name!r} arguments are not valid JSON ({e})") from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise TypeError(f"{where}: tool call {name!r} arguments must be a dict (or a JSON object string), "
                        f"got {type(args).__name__}")
    for k, v in args.items():
        if not isinstance(k, str) or not k or '"' in k or "\n" in k:
            raise ValueError(f"{where}: tool call {name!r} has a bad argument name {k!r}")
        try:
            rendered = v if isinstance(v, str) else _json(v)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{where}: tool call {name!r} argument {k!r} is not JSON-serialisable ({e})") from None
        if PARAM_CLOSE in rendered:   # would end the DSML parameter early: the block could not be parsed back
            raise ValueError(f"{where}: tool call {name!r} argument {k!r} contains {PARAM_CLOSE!r}")
    return {"name": name, "arguments": args, "id": tc.get("id") or fn.get("id")}


def _normalize(msgs: Any, label: str, st: dict) -> list[dict]:
    """Validate ``msgs`` and turn them into render turns. A run of consecutive tool/user messages becomes one
    user turn (SPEC §14 item 1 [code]): tool results as ``<tool_result>..</tool_result>`` pieces sorted into the
    calling assistant's tool_call order, user content pieces in place, all joined with "\\n\\n". A message with a
    task ends the run. ``st`` carries the last assistant's calls across context -> messages."""
    if not isinstance(msgs, (list, tuple)):
        raise TypeError(f"{label} must be a list of message dicts, got {type(msgs).__name__}")
    turns: list[dict] = []
    run: list | None = None                       # pieces of the open user turn

    def close():
        if run is None:
            return
        slots = [k for k, p in enumerate(run) if p["tool"]]
        ids = st["ids"] or []
        tools = sorted((run[k] for k in slots), key=lambda p: ids.index(p["id"]) if p["id"] in ids else 0)
        for k, p in zip(slots, tools):
            run[k] = p
        turns[-1]["text"] = "\n\n".join(p["text"] for p in run)
        turns[-1]["images"] = [im for p in run for im in p["images"]]

    for i, m in enumerate(msgs):
        where = f"{label}[{i}]"
        if not isinstance(m, dict):
            raise TypeError(f"{where}: a message must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r} (allowed: {', '.join(ROLES)})")
        where = f"{where} ({role})"
        task = m.get("task")
        if task is not None and (task not in TASK_TOKENS or role in ("assistant", "tool")):
            raise ValueError(f"{where}: task {task!r} is not allowed: tasks are {', '.join(TASK_TOKENS)}, "
                             "on system, user or latest_reminder messages")
        for key in ("tools", "response_format"):
            if m.get(key) is not None and role != "system":
                raise ValueError(f"{where}: {key!r} belongs on a system message")
        if role == "assistant" and ("reasoning_content" in m and "reasoning" in m
                                    and m["reasoning_content"] != m["reasoning"]):
            raise ValueError(f"{where}: 'reasoning_content' and 'reasoning' disagree")
        if m.get("tool_calls") and role != "assistant":
            raise ValueError(f"{where}: only assistant messages carry tool_calls")
        if role in ("user", "tool"):
            if "content" not in m or m["content"] is None:
                raise ValueError(f"{where}: missing content")
            text, images = _content(m["content"], where)
            if role == "tool":
                if st["ids"] is None:
                    raise ValueError(f"{where}: tool message with no preceding assistant tool call")
                st["results"] += 1
                if st["results"] > len(st["ids"]):
                    raise ValueError(f"{where}: more tool results than the assistant's {len(st['ids'])} tool calls")
                tid = m.get("tool_call_id")
                if tid is not None and all(st["ids"]) and tid not in st["ids"]:
                    raise ValueError(f"{where}: tool_call_id {tid!r} matches none of the preceding assistant's "
                                     f"tool calls {st['ids']}")
                piece = {"tool": True, "id": tid, "text": f"<tool_result>{text}</tool_result>", "images": images}
            else:
                piece = {"tool": False, "id": None, "text": text, "images": images}
            if run is None:
                run = []
                turns.append({"role": "user", "src": where})
            run.append(piece)
            turns[-1]["task"] = task
            if task is not None:
                turns[-1]["src"] = where          # errors about the task name this message
                close()
                run = None
            continue
        close()
        run = None
        t = {"role": role, "src": where, "task": task, "images": []}
        if role == "assistant":
            content, rc = m.get("content"), m.get("reasoning_content", m.get("reasoning"))
            t["content"] = _content("" if content is None else content, where, blocks=False)[0]
            t["reasoning"] = _content("" if rc is None else rc, where + " reasoning", blocks=False)[0]
            # markers the template itself places: inside the text they would end the reasoning or open a
            # tool-call block early, and the prompt would no longer parse back (parse_assistant)
            for text, what, bad in ((t["reasoning"], "reasoning", (THINK_END,)), (t["content"], "content",
                                                                                 (CALLS_OPEN,))):
                hit = [b for b in bad if b in text]
                if hit:
                    raise ValueError(f"{where}: the {what} contains {hit[0]!r}, a marker of the chat template")
            calls = m.get("tool_calls") or []
            if not isinstance(calls, (list, tuple)):
                raise TypeError(f"{where}: tool_calls must be a list, got {type(calls).__name__}")
            t["calls"] = [_tool_call(tc, f"{where} tool_calls[{j}]") for j, tc in enumerate(calls)]
            st["ids"] = [c["id"] for c in t["calls"]] if t["calls"] else None
            st["results"] = 0
        else:
            content = m.get("content")
            if content is None and role == "latest_reminder":
                raise ValueError(f"{where}: missing content")
            t["text"], t["images"] = _content("" if content is None else content, where)
            t["tools"], t["response_format"] = m.get("tools"), m.get("response_format")
        turns.append(t)
    close()
    return turns


def _render_turn(full: list[dict], i: int, thinking: bool, drop: bool, last_user: int, budget: int) -> str:
    """One turn (SPEC §14 items 2-6) including the suffix that follows it."""
    t, role = full[i], full[i]["role"]
    out = ""
    if i == 0 and thinking:                       # item 2: <｜System｜> + effort line leads the prompt
        out += SYSTEM + EFFORT_LINE.format(budget)
    elif role == "system":                        # item 2 (index 0) and item 3 (index > 0)
        out += SYSTEM
    if role == "system":                          # item 3
        if t["tools"]:
            raise NotImplementedError(f"{t['src']}: {TOOLS_TEMPLATE_MISSING}")
        out += t["text"]
        if t["response_format"] is not None:
            out += RESPONSE_FORMAT.format(_json(t["response_format"]))
    elif role == "user":                          # item 4
        out += USER + t["text"]
    elif role == "latest_reminder":               # item 4
        out += REMINDER + t["text"]
    else:                                         # item 5
        prev_task = i > 0 and full[i - 1]["task"] is not None
        if thinking and not prev_task and (not drop or i > last_user):
            out += t["reasoning"] + THINK_END
        return out + t["content"] + render_tool_calls(t["calls"]) + EOS
    # item 6: the generation header after a user/system turn whose next message is absent or an assistant
    # (or a latest_reminder [code]); a task replaces it.
    nxt = full[i + 1]["role"] if i + 1 < len(full) else None
    if nxt not in (None, "assistant", "latest_reminder"):
        if t["task"] is not None:
            raise ValueError(f"{t['src']}: a message with a task must be the last one or be followed by the "
                             f"assistant's answer, but a {nxt} message follows")
        return out
    if t["task"] == "action":
        out += ASSISTANT + (THINK if thinking else THINK_END) + TASK_TOKENS["action"]
    elif t["task"] is not None:
        out += TASK_TOKENS[t["task"]]
    elif role in ("user", "system"):
        out += ASSISTANT + (THINK if thinking and (not drop or i >= last_user) else THINK_END)
    return out


def render_tool_calls(calls: list[dict]) -> str:
    """The DSML block of an assistant turn (SPEC §14 item 5), "" without calls: a str argument verbatim with
    string="true", anything else as JSON with string="false"."""
    if not calls:
        return ""
    invokes = []
    for c in calls:
        params = "\n".join(f'<{DSML} parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                           f"{v if isinstance(v, str) else _json(v)}{PARAM_CLOSE}" for k, v in c["arguments"].items())
        invokes.append(f'<{DSML} invoke name="{c["name"]}">\n{params}\n{INVOKE_CLOSE}')
    return f"\n\n{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


def encode_messages(messages: list[dict], thinking_mode: str, context: list[dict] | None = None,
                    drop_thinking: bool = True, add_default_bos_token: bool = True,
                    reasoning_effort: int | str | None = None, return_multi_modal_data: bool = False):
    """Render ``messages`` to the prompt string (SPEC §14).

    thinking_mode: "thinking" or "chat". context: earlier messages, already encoded elsewhere: they are not
    rendered, but they shift message indices (no BOS, no effort line, a first system message of ``messages``
    gets ``<｜System｜>`` as a later one) and count for drop_thinking, tool-result order and validation.
    drop_thinking (thinking mode): the reasoning of assistant turns before the last user/system turn is left out;
    forced False when any message (context included) has tools. Returns the prompt, or with
    return_multi_modal_data ``(prompt, {"images": [payloads in prompt order]})``. Raises ValueError / TypeError
    naming the message index for malformed input, NotImplementedError for a system message with tools.
    """
    if thinking_mode not in ("thinking", "chat"):
        raise ValueError(f"thinking_mode must be 'thinking' or 'chat', got {thinking_mode!r}")
    budget = effort_budget(reasoning_effort)
    if context is not None and not isinstance(context, (list, tuple)):
        raise TypeError(f"context must be a list of message dicts or None, got {type(context).__name__}")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of message dicts")
    st = {"ids": None, "results": 0}
    ctx = _normalize(context or [], "context", st)
    full = ctx + _normalize(messages, "messages", st)
    thinking = thinking_mode == "thinking"
    drop = drop_thinking and not any(t.get("tools") for t in full)       # item 5: forced False with tools
    last_user = max((i for i, t in enumerate(full) if t["role"] == "user" or (t["role"] == "system" and i > 0)),
                    default=-1)
    prompt = BOS if add_default_bos_token and not ctx else ""            # item 1
    prompt += "".join(_render_turn(full, i, thinking, drop, last_user, budget) for i in range(len(ctx), len(full)))
    if return_multi_modal_data:
        return prompt, {"images": [im for t in full[len(ctx):] for im in t["images"]]}
    return prompt


def _parse_calls(s: str) -> list[dict]:
    """Inverse of render_tool_calls for a block starting at ``CALLS_OPEN``; strict, errors name the offset."""
    def expect(lit: str, pos: int) -> int:
        if not s.startswith(lit, pos):
            raise ValueError(f"malformed DSML tool-call block at offset {pos}: expected {lit!r}, got {s[pos:pos + 40]!r}")
        return pos + len(lit)

    pos, calls = expect(CALLS_OPEN + "\n", 0), []
    while True:
        m = _INVOKE_RE.match(s, pos)
        if m is None:
            raise ValueError(f"malformed DSML tool-call block at offset {pos}: expected an invoke tag, "
                             f"got {s[pos:pos + 40]!r}")
        name, pos, args = m.group(1), m.end(), {}
        while not s.startswith("\n" + INVOKE_CLOSE, pos):
            p = _PARAM_RE.match(s, pos)
            if p is None:
                raise ValueError(f"malformed DSML tool-call block at offset {pos}: expected a parameter of "
                                 f"{name!r}, got {s[pos:pos + 40]!r}")
            key, is_str, raw = p.groups()
            if key in args:
                raise ValueError(f"DSML tool call {name!r}: parameter {key!r} given twice")
            try:
                args[key] = raw if is_str == "true" else json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"DSML tool call {name!r}: parameter {key!r} has string=\"false\" but its value "
                                 f"{raw!r:.60} is not JSON ({e})") from None
            pos = p.end()
            if not s.startswith("\n" + INVOKE_CLOSE, pos):
                pos = expect("\n", pos)
        calls.append({"name": name, "arguments": args})
        pos = expect("\n" + INVOKE_CLOSE + "\n", pos)
        if s.startswith(CALLS_CLOSE, pos):
            pos += len(CALLS_CLOSE)
            if pos != len(s):
                raise ValueError(f"text after the DSML tool-call block at offset {pos}: {s[pos:pos + 40]!r}")
            return calls


def parse_assistant(text: str, thinking_mode: str = "thinking") -> dict:
    """Split generated assistant text (what follows the prompt's ``<｜Assistant｜><think>`` or ``</think>``) into
    {"reasoning", "content", "tool_calls": [{name, arguments}]}; the exact inverse of an assistant turn's
    rendering (SPEC §14 item 5). A trailing EOS is optional. Thinking mode: reasoning is the text before the
    first ``</think>`` (all of it, content "", when generation stopped before one); chat mode: reasoning None.
    A malformed DSML block raises ValueError."""
    if not isinstance(text, str):
        raise TypeError(f"parse_assistant needs a string, got {type(text).__name__}")
    if thinking_mode not in ("thinking", "chat"):
        raise ValueError(f"thinking_mode must be 'thinking' or 'chat', got {thinking_mode!r}")
    if text.endswith(EOS):
        text = text[:-len(EOS)]
    reasoning = None
    if thinking_mode == "thinking":
        reasoning, sep, rest = text.partition(THINK_END)
        if not sep:
            return {"reasoning": reasoning, "content": "", "tool_calls": []}
        text = rest
    k = text.find(CALLS_OPEN)
    if k < 0:
        return {"reasoning": reasoning, "content": text, "tool_calls": []}
    content = text[:k - 2] if text[:k].endswith("\n\n") else text[:k]
    return {"reasoning": reasoning, "content": content, "tool_calls": _parse_calls(text[k:])}

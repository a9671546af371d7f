"""/v1/chat/completions' `messages` -> one prompt text (consumer.api.openai_api tokenizes it).

Owns: checking the messages (a role this server answers, text content, no tool calls; any other
key is 400 naming it) and rendering them: the tokenizer's chat template with the generation prompt
(a template that refuses them, e.g. Llama-2's "roles must alternate", is 400 naming `messages`),
else "role: content" lines and "assistant:". No aiohttp, no compute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from consumer.api.openai_schema import BadField, show
from shared.errors import InvalidArgument

ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name of system (rendered as system)
TOOL_ROLES = ("tool", "function")
KEYS = ("role", "content", "name")
ASSISTANT_EMPTY = ("refusal", "tool_calls", "function_call", "audio")  # on an assistant message: null or empty only
MAX_NAME_CHARS = 64


def read_messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    """The messages as [{role, content[, name]}] of plain text; InvalidArgument naming the message and key."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages: required, a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidArgument(f"messages[{i}]: must be an object with a string role")
        role = m["role"]
        if role in TOOL_ROLES:
            raise InvalidArgument(f"messages[{i}].role: {role!r} not served (no tool calling here)")
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role: {show(role)} not one of {', '.join(ROLES)}")
        for key, value in m.items():
            if key in KEYS or (role == "assistant" and key in ASSISTANT_EMPTY and value in (None, [], "")):
                continue
            why = "not served (no tool calling or audio here)" if key in ASSISTANT_EMPTY else "unrecognized"
            raise BadField(f"messages[{i}].{key}", why)
        content = m.get("content")
        text = "" if content is None and role == "assistant" else _content(content, i)
        message = {"role": "system" if role == "developer" else role, "content": text}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
                raise InvalidArgument(f"messages[{i}].name: must be a string of 1..{MAX_NAME_CHARS} characters")
            message["name"] = name
        out.append(message)
    return out


def _content(content: Any, i: int) -> str:
    """A message's text; a list of text parts is joined by newlines, as vLLM's server joins them
    (concatenated, "a" and "b" would read as one word "ab")."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(f"messages[{i}].content[{j}]: only text parts ({{type: text, text: ...}}) are served")
            if len(part) > 2:
                extra = next(k for k in part if k not in ("type", "text"))
                raise BadField(f"messages[{i}].content[{j}].{extra}", "unrecognized")
            parts.append(part["text"])
        return "\n".join(parts)
    raise InvalidArgument(f"messages[{i}].content: must be a string or a list of text parts")


def render_chat(body: Mapping[str, Any], tokenizer: Any) -> tuple[str, bool]:
    """The messages as one text: the tokenizer's chat template with the generation prompt when it
    has one, else "role: content" lines and "assistant:". Returns (text, add special tokens):
    a template writes its own BOS."""
    plain = read_messages(body)
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # the template's own check (jinja's raise_exception) or its failure on these messages
            raise InvalidArgument(f"messages: the model's chat template refused them: {str(exc)[:300]}") from None
        if not isinstance(text, str):
            raise InvalidArgument("messages: the model's chat template did not render one text")
        return text, False
    lines = (f"{m['role']}{' (' + m['name'] + ')' if 'name' in m else ''}: {m['content']}\n" for m in plain)
    return "".join(lines) + "assistant:", True

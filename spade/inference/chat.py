"""Chat formatting with the model's own tokenizer: messages (and tools) to prompt token ids.

The chat template is applied on the client side, so the token ids a sample is built from are
exactly the ids the server saw and the learner trains on: no second tokenisation anywhere.

Tools: when the model's chat template renders ``tools`` itself (Qwen, Llama 3.x…), it is used as is.
When it does not (SmolLM2's template ignores them), the tools are described in the system message in
the Hermes/Qwen form the agent's replies are parsed in (``<tools>…</tools>``, answer with
``<tool_call>{"name": …, "arguments": …}</tool_call>``), so tools are never silently dropped.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Message = Mapping[str, Any]

_TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class ChatFormatError(ValueError):
    """Messages or tools that cannot be rendered."""


def _tools_system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = [json.dumps(dict(tool), ensure_ascii=False) for tool in tools]
    return _TOOLS_PREAMBLE + "\n".join(lines) + _TOOLS_POSTAMBLE


def _message_text(message: Message) -> str:
    """Render one message's content for templates that only know plain ``content``."""
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise ChatFormatError(f"message content must be text, got {type(content).__name__}")
    calls = message.get("tool_calls") or []
    parts = [content] if content else []
    for call in calls:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):  # else keep the text as written
                args = json.loads(args)
        body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
        parts.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(parts)


class ChatFormatter:
    """Applies a model's chat template, returning token ids.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
    """

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatFormatError("the tokenizer has no chat template; use an instruction-tuned checkpoint")
        self.tokenizer = tokenizer
        self.template_renders_tools = "tools" in str(tokenizer.chat_template)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatFormatter:
        """Load the tokenizer saved in a local checkpoint directory (never from a hub)."""
        os.environ["HF_HUB_OFFLINE"] = "1"
        from transformers import AutoTokenizer

        path = Path(path).expanduser()
        if not path.is_dir():
            raise ChatFormatError(f"tokenizer path {path} is not a directory; pass the model checkpoint dir")
        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))

    def _prepare(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        if not messages:
            raise ChatFormatError("messages must not be empty")
        for i, m in enumerate(messages):
            if "role" not in m:
                raise ChatFormatError(f"message {i} has no 'role'; expected {{'role': ..., 'content': ...}}")
        tool_list = [dict(t) for t in tools] if tools else None
        if self.template_renders_tools:
            return [dict(m) for m in messages], tool_list
        # The template knows only role + content: fold tool calls and tool results into text.
        out: list[dict[str, Any]] = []
        for m in messages:
            role = m["role"]
            text = _message_text(m)
            if role == "tool":
                role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
            out.append({"role": role, "content": text})
        if tool_list:
            tools_text = _tools_system_text(tool_list)
            if out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools_text}
            else:
                out.insert(0, {"role": "system", "content": tools_text})
        return out, None

    def apply(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template.

        Args:
            messages: OpenAI-style messages (``role``, ``content``, optional ``tool_calls``).
            tools: OpenAI function schemas (``{"type": "function", "function": {...}}``).
            add_generation_prompt: end with the assistant header, ready for generation.
        """
        msgs, tool_list = self._prepare(messages, tools)
        kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "tokenize": True}
        if tool_list is not None:
            kwargs["tools"] = tool_list
        ids = self.tokenizer.apply_chat_template(msgs, return_dict=False, **kwargs)
        return [int(t) for t in ids]

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The same prompt as text (for logs and inspection)."""
        msgs, tool_list = self._prepare(messages, tools)
        kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "tokenize": False}
        if tool_list is not None:
            kwargs["tools"] = tool_list
        return str(self.tokenizer.apply_chat_template(msgs, **kwargs))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Detokenise ``ids``."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

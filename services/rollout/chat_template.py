"""The policy's own chat template and tokenizer (Hugging Face), as the core's ``ChatTemplate``.

Templates that ignore ``tools`` (SmolLM2's does) would hide a tool env's tools from the agent, so
for those the tool schemas go into a system message in the Hermes/Qwen form that
``spade.envs.parse_tool_calls`` reads back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOOLS_SYSTEM_PROMPT = (
    "You can call functions to act. The available functions are listed as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, write <tool_call>{{\"name\": <function name>, \"arguments\": <JSON object>}}</tool_call>. "
    "You may make several calls in one reply. Reply in plain text when no call is needed."
)


class HFChatTemplate:
    """A Hugging Face tokenizer as the rollout's ``ChatTemplate``.

    Args:
        tokenizer: The policy's tokenizer (the one its inference server uses).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; the rollout needs the policy's own template")
        self._tok = tokenizer
        probe = [{"role": "user", "content": "x"}]
        tool = {"type": "function", "function": {"name": "spade_probe_tool", "description": "", "parameters": {}}}
        self.native_tools = "spade_probe_tool" in self._apply(probe, [tool], True)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> HFChatTemplate:
        """Load the tokenizer of a local checkpoint directory (nothing is downloaded)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))

    def _apply(self, messages: Sequence[Mapping[str, Any]], tools: Any, generation_prompt: bool) -> str:
        text = self._tok.apply_chat_template(
            [dict(m) for m in messages], tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert isinstance(text, str)
        return text

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None,
        generation_prompt: bool,
    ) -> str:
        """Render with the model's template (tools in a system message if the template ignores them)."""
        if tools and not self.native_tools:
            listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
            system = {"role": "system", "content": TOOLS_SYSTEM_PROMPT.format(tools=listing)}
            return self._apply([system, *messages], None, generation_prompt)
        return self._apply(messages, list(tools) if tools else None, generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text; special-token markers in it become their single ids."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text including special tokens."""
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def decode_reply(self, ids: Sequence[int]) -> str:
        """Text without special tokens: what the model said."""
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a turn."""
        eos = self._tok.eos_token_id
        return [] if eos is None else [int(eos)]

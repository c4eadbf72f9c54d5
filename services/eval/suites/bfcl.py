"""The ``bfcl-multi-turn`` suite: BFCL v4 multi-turn, driven by our client and parser, scored by BFCL.

The ``bfcl-eval`` package (installed with ``--no-deps``; see ``scripts/setup.sh``) supplies the test
entries, the ground truth, the simulated backends (file system, trading bot, travel booking, ...),
their executor and the multi-turn checker. Only the conversation is driven here, the way BFCL's own
function-calling handler drives it:

- the entry's function docs go to the model as OpenAI tools (BFCL's ``convert_to_tool``), through
  the model's chat template (templates that ignore tools get them in the Hermes system form);
- each user turn is added in order; in a turn the model is asked again after every reply that holds
  tool calls, up to BFCL's ``MAXIMUM_STEP_LIMIT`` steps (past it the entry is force-terminated and
  fails, as in BFCL); a reply without a call ends the turn; a held-out function (``miss_func``)
  arrives with BFCL's own "I have updated some more functions" user turn;
- calls are read by ``spade.envs.actions.parse_tool_calls`` and turned into BFCL's call strings by
  BFCL's ``convert_to_function_call``, executed by BFCL's ``execute_multi_turn_func_call`` and their
  results returned as ``tool`` messages;
- the entry is scored by BFCL's ``multi_turn_checker`` (state and response checks after each turn).

**Safety.** BFCL executes a call string with ``eval``. A call is therefore executed (and shown to
the checker) only when its name is one of the tools offered in that turn and every argument name is
a Python identifier; values are JSON values, whose ``repr`` is a plain literal. Any other call gets
an error result without being run. BFCL itself would fail such a call (unknown name, syntax error),
so this changes no honest score and keeps model output from running as code.

Executor instances live in BFCL's module globals, keyed by model name and entry id: every suite
instance uses a unique model name and removes its instances when an entry is scored.
"""

from __future__ import annotations

import copy
import keyword
import os
import random
import re
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from services.eval.core.ports import ChatModel, PromptRejected
from services.eval.core.records import ItemResult, prompt_hash
from services.eval.core.runner import EvalItem
from spade.envs.actions import ToolCall

NAME = "bfcl-multi-turn"

Category = Literal["multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"]
"""A BFCL v4 multi-turn category."""

CATEGORIES: tuple[Category, ...] = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)
"""BFCL v4's multi-turn categories (200 entries each)."""


class BfclSetupError(RuntimeError):
    """``bfcl-eval`` is missing or cannot be imported offline."""


def import_bfcl(project_root: Path) -> Any:
    """Import the BFCL modules this suite uses, keeping BFCL's scratch directories in ``project_root``.

    BFCL creates ``result/``, ``score/`` and ``.file_locks/`` under ``BFCL_PROJECT_ROOT`` when first
    imported (by default beside its own installed files, which may be read-only).

    Raises:
        BfclSetupError: The package or one of its small dependencies is missing.
    """
    if "bfcl_eval" not in sys.modules:
        project_root.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("BFCL_PROJECT_ROOT", str(project_root))
    try:
        from bfcl_eval import utils
        from bfcl_eval.constants import default_prompts, enums, type_mappings
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils
        from bfcl_eval.model_handler import utils as handler_utils
    except ImportError as exc:
        raise BfclSetupError(
            f"the bfcl-multi-turn suite needs the bfcl-eval package ({exc}); install it as scripts/setup.sh "
            "does: pip install --no-deps bfcl-eval==2026.3.23 tree-sitter==0.21.3 tree-sitter-java==0.21.0 "
            "tree-sitter-javascript==0.21.4"
        ) from None
    return _Bfcl(
        utils=utils,
        prompts=default_prompts,
        enums=enums,
        type_mappings=type_mappings,
        checker=multi_turn_checker,
        executor=multi_turn_utils,
        handler_utils=handler_utils,
    )


@dataclass(frozen=True)
class _Bfcl:
    utils: Any
    prompts: Any
    enums: Any
    type_mappings: Any
    checker: Any
    executor: Any
    handler_utils: Any


def safe_call_problem(call: ToolCall, offered: set[str]) -> str | None:
    """Why ``call`` must not be executed (None: it is safe to turn into a BFCL call string).

    >>> safe_call_problem(ToolCall("ls", {"a": True}), {"ls"}) is None
    True
    >>> print(safe_call_problem(ToolCall("ls", {"a=__import__('os')": 1}), {"ls"}))
    argument name "a=__import__('os')" is not an identifier
    """
    if call.name not in offered:
        return f"unknown function {call.name!r}; call one of the tools offered"
    for name in call.arguments:
        if not name.isidentifier() or keyword.iskeyword(name):
            return f"argument name {name!r} is not an identifier"
    return None


@dataclass
class Conversation:
    """What one entry's conversation produced.

    Attributes:
        replies: Every model reply, in order.
        decoded: Per user turn, per step with calls, BFCL call strings (the checker's input).
        forced_quit: The step limit ended the conversation (BFCL fails the entry).
        error: Why the conversation stopped early ("" if it did not).
    """

    replies: list[str] = field(default_factory=list)
    decoded: list[list[list[str]]] = field(default_factory=list)
    forced_quit: bool = False
    error: str = ""


class BfclMultiTurnSuite:
    """BFCL v4 multi-turn entries.

    Args:
        model: The model to evaluate (None: list and score only).
        seed: Seed of the item order (a ``--limit`` prefix is a seeded sample of each category).
        workdir: Where BFCL may write its scratch directories.
        categories: BFCL multi-turn categories to run.
        items_per_category: Entries per category (None: all).
        max_steps: Model steps per user turn before BFCL's force-quit (BFCL: ``MAXIMUM_STEP_LIMIT``).
    """

    name = NAME

    def __init__(
        self,
        model: ChatModel | None,
        seed: int,
        workdir: Path,
        categories: Sequence[str] = CATEGORIES,
        items_per_category: int | None = None,
        max_steps: int | None = None,
    ) -> None:
        unknown = [c for c in categories if c not in CATEGORIES]
        if unknown or not categories:
            raise ValueError(f"unknown BFCL multi-turn categories {unknown}; choose from {', '.join(CATEGORIES)}")
        if items_per_category is not None and items_per_category < 1:
            raise ValueError(f"items_per_category must be >= 1 or unset (all), got {items_per_category}")
        self.bfcl = import_bfcl(workdir)
        self.model = model
        self.seed = seed
        self.categories = tuple(dict.fromkeys(categories))
        self.items_per_category = items_per_category
        self.max_steps = max_steps if max_steps is not None else int(self.bfcl.prompts.MAXIMUM_STEP_LIMIT)
        # BFCL keys executor instances by model name: unique per suite, so runs never share state.
        self.model_name = f"spade_eval_{uuid.uuid4().hex[:12]}"
        self._entries: dict[str, dict[str, Any]] = {}
        self._truth: dict[str, list[list[str]]] = {}
        per_category: list[list[EvalItem]] = []
        for category in self.categories:
            entries = self.bfcl.utils.load_dataset_entry(category)
            truth = {row["id"]: row["ground_truth"] for row in self.bfcl.utils.load_ground_truth_entry(category)}
            ids = [entry["id"] for entry in entries]
            random.Random(f"{seed}:{category}").shuffle(ids)
            if items_per_category is not None:
                ids = ids[:items_per_category]
            for entry in entries:
                self._entries[entry["id"]] = entry
                self._truth[entry["id"]] = truth[entry["id"]]
            per_category.append([EvalItem(i, category, i) for i in ids])
        longest = max(len(row) for row in per_category)
        self._items = [row[k] for k in range(longest) for row in per_category if k < len(row)]

    def config(self) -> dict[str, Any]:
        """Categories, entries per category, the step limit and the package version."""
        from importlib.metadata import version

        return {
            "package": f"bfcl-eval=={version('bfcl-eval')}",
            "categories": list(self.categories),
            "items_per_category": self.items_per_category,
            "max_steps": self.max_steps,
        }

    def items(self) -> list[EvalItem]:
        """Every entry, categories interleaved."""
        return list(self._items)

    def entry(self, entry_id: str) -> dict[str, Any]:
        """A private copy of BFCL's test entry."""
        return copy.deepcopy(self._entries[entry_id])

    def ground_truth(self, entry_id: str) -> list[list[str]]:
        """BFCL's ground-truth call strings, per turn."""
        return copy.deepcopy(self._truth[entry_id])

    def tools(self, functions: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """BFCL's function docs as OpenAI tools (BFCL's own conversion)."""
        b = self.bfcl
        return list(
            b.handler_utils.convert_to_tool(
                list(functions), b.type_mappings.GORILLA_TO_OPENAPI, b.enums.ModelStyle.OPENAI_COMPLETIONS
            )
        )

    def _execute(self, call_strings: list[str], entry: dict[str, Any], category: str) -> list[str]:
        results, _ = self.bfcl.executor.execute_multi_turn_func_call(
            call_strings,
            entry.get("initial_config", {}),
            entry["involved_classes"],
            self.model_name,
            entry["id"],
            long_context="long_context" in category or "composite" in category,
            is_evaL_run=False,
        )
        return [str(r) for r in results]

    async def converse(self, entry: dict[str, Any], category: str, model: ChatModel) -> Conversation:
        """Drive one entry's conversation (BFCL's function-calling loop) and collect the calls."""
        b = self.bfcl
        functions = list(entry["function"])
        holdout: dict[str, list[dict[str, Any]]] = entry.get("missed_function", {})
        messages: list[dict[str, Any]] = []
        out = Conversation()
        step_number = 0
        self._execute([], entry, category)  # create the backends at their initial state
        for turn_index, question in enumerate(entry["question"]):
            said = question
            if str(turn_index) in holdout:  # BFCL's miss_func turn: new functions, BFCL's own user turn
                functions.extend(holdout[str(turn_index)])
                said = [{"role": "user", "content": b.prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC}]
            messages.extend(dict(m) for m in said)
            tools = self.tools(functions)
            offered = {str(f["name"]) for f in functions}
            turn_decoded: list[list[str]] = []
            steps = 0
            while True:
                try:
                    reply = await model.reply(messages, tools=tools, key=entry["id"], turn=step_number)
                except PromptRejected as exc:
                    out.decoded.append(turn_decoded)
                    out.error = str(exc)
                    return out
                step_number += 1
                out.replies.append(reply.text)
                messages.append({"role": "assistant", "content": reply.text})
                calls = reply.tool_calls.calls
                if not calls:
                    break
                step_strings: list[str] = []
                for call in calls:
                    problem = safe_call_problem(call, offered)
                    if problem is None:
                        text = b.handler_utils.convert_to_function_call([{call.name: dict(call.arguments)}])[0]
                        result = self._execute([text], entry, category)[0]
                        step_strings.append(text)
                    else:
                        result = f"Error during execution: {problem}"
                    messages.append({"role": "tool", "name": call.name, "content": result})
                if step_strings:
                    turn_decoded.append(step_strings)
                steps += 1
                if steps > self.max_steps:
                    out.decoded.append(turn_decoded)
                    out.forced_quit = True
                    out.error = f"force-terminated after {self.max_steps} steps in turn {turn_index} (BFCL fails it)"
                    return out
            out.decoded.append(turn_decoded)
        return out

    def score(self, entry_id: str, decoded: list[list[list[str]]], *, forced_quit: bool = False) -> tuple[float, str]:
        """Score decoded calls with BFCL's multi-turn checker; ``(1.0, "")`` when it passes.

        A conversation that did not reach every turn (force-terminated, or cut short) fails, as in
        BFCL's evaluation runner.
        """
        truth = self.ground_truth(entry_id)
        if forced_quit or len(decoded) != len(truth):
            return 0.0, f"the conversation ended after {len(decoded)} of {len(truth)} turns (BFCL fails it)"
        entry = self.entry(entry_id)
        category = entry_id.rsplit("_", 1)[0]
        try:
            verdict = self.bfcl.checker.multi_turn_checker(decoded, truth, entry, category, self.model_name)
        except Exception as exc:  # the package's checker failed: the item counts 0, logged in the record
            return 0.0, f"BFCL's checker raised {type(exc).__name__}: {exc}"
        finally:
            self._forget(entry_id)
        if verdict.get("valid"):
            return 1.0, ""
        return 0.0, f"{verdict.get('error_type', 'invalid')}: {verdict.get('error_message', '')}"

    def _forget(self, entry_id: str) -> None:
        """Drop this entry's executor instances (inference, eval and ground truth) from BFCL's globals."""
        namespace = vars(self.bfcl.executor)
        for prefix in (self.model_name, f"{self.model_name}_eval", f"{self.model_name}_ground_truth_eval"):
            for class_name in self._entries[entry_id]["involved_classes"]:
                # BFCL's own instance naming (multi_turn_utils.execute_multi_turn_func_call).
                namespace.pop(re.sub(r"[-./:]", "_", f"{prefix}_{entry_id}_{class_name}_instance"), None)

    async def run(self, item: EvalItem) -> ItemResult:
        """Converse, then score with BFCL's checker."""
        if self.model is None:
            raise RuntimeError("this BfclMultiTurnSuite was built without a model; it can only list and score")
        entry = self.entry(item.id)
        first = [dict(m) for m in entry["question"][0]]
        shown = prompt_hash({"messages": first, "functions": entry["function"]})
        try:
            talk = await self.converse(entry, item.category, self.model)
        finally:
            self._forget(item.id)
        score, verdict = self.score(item.id, talk.decoded, forced_quit=talk.forced_quit or bool(talk.error))
        detail = {
            "decoded": talk.decoded,
            "verdict": verdict,
            "steps": len(talk.replies),
        }
        return ItemResult(item.id, item.category, shown, tuple(talk.replies), score, talk.error, detail)

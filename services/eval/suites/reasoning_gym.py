"""The ``reasoning-gym`` suite: the paper's four Reasoning-Gym categories at hard difficulty.

Items come from the ``reasoning-gym`` package, which generates and scores offline. The paper's GEM
eval used reasoning-gym's ``-hard`` task configurations; those YAML files are not in the wheel, so
each dataset is configured by its own curriculum with **every attribute at its hardest level, and
only that level** (``set_global_level`` past the top, ``RangeAttributeMode.LAST_K`` with ``k=1``).
The resulting configuration of every dataset is part of the run header (``suite_config``), and
``docs/eval.md`` lists them.

- **Categories**: the package's own category of each dataset (its module folder), rolled up as the
  paper does: algebra, arithmetic, geometry and probability are *math*; algorithmic, cognition and
  logic are themselves.
- **Items**: ``items_per_category`` per category, spread round-robin over the category's datasets,
  and listed category by category in turn so that a ``--limit`` prefix covers every category.
  Item ``dataset/i`` is entry ``i`` of the dataset built with a seed derived from the eval's seed
  and the dataset's name: the same seed gives the same items for every checkpoint.
- **Prompt and answer**: the package's ``default`` system prompt and the entry's question; the
  answer is read with the package's ``extract_answer`` (the last ``<answer>...</answer>``) and
  scored by the dataset's own ``score_answer``. A scorer that raises scores 0 and is logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
from collections.abc import Sequence
from importlib.metadata import version
from typing import Any

from services.eval.core.ports import ChatModel, PromptRejected
from services.eval.core.records import ItemResult, prompt_hash
from services.eval.core.runner import EvalItem
from spade.serving.logs import get_logger

log = get_logger(__name__)

NAME = "reasoning-gym"

PAPER_CATEGORIES: dict[str, str] = {
    "algebra": "math",
    "arithmetic": "math",
    "geometry": "math",
    "probability": "math",
    "algorithmic": "algorithmic",
    "cognition": "cognition",
    "logic": "logic",
}
"""Reasoning-Gym's own categories (module folders) rolled up into the paper's four."""

DEFAULT_DATASETS: tuple[str, ...] = (
    # math
    "basic_arithmetic",
    "chain_sum",
    "decimal_arithmetic",
    "fraction_simplification",
    "gcd",
    "lcm",
    "prime_factorization",
    "power_function",
    "complex_arithmetic",
    "simple_equations",
    "polynomial_equations",
    "simple_geometry",
    "advanced_geometry",
    "coin_flip",
    # algorithmic
    "base_conversion",
    "count_primes",
    "cryptarithm",
    "letter_counting",
    "isomorphic_strings",
    "palindrome_partitioning",
    "ransom_note",
    "sentence_reordering",
    "string_synthesis",
    "word_ladder",
    "word_sorting",
    # cognition
    "color_cube_rotation",
    "figlet_font",
    "rectangle_count",
    "modulo_grid",
    # logic
    "aiw",
    "knights_knaves",
    "propositional_logic",
    "self_reference",
    "syllogism",
)
"""Datasets of the four categories that generate at their hardest level in well under a second.

Left out at this package version: ``game_of_life_halting`` (its scorer gives 1.0 to any non-empty
answer: ``bool("False") == bool("True")``), ``caesar_cipher``, ``letter_jumble``, ``spell_backward`` and
``rubiks_cube`` (their hardest configuration fails the package's own validation), ``jugs``,
``zebra_puzzles``, ``number_sequence`` and ``polynomial_multiplication`` (tens of seconds per item
at the hardest level), and the grid datasets whose hardest questions run past 20 000 characters
(far beyond a small model's context: ``binary_matrix``, ``game_of_life``, ``manipulate_matrix``,
``number_sorting``, ``pool_matrix``, ``rotate_matrix``, ``rotten_oranges``, ``spiral_matrix``,
``needle_haystack``, ``circuit_logic``). Any of them can be chosen in the settings.
"""


class SuiteConfigError(ValueError):
    """The suite's settings name something the package does not have."""


def _dataset_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"spade-eval-rg\x00{seed}\x00{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def hardest_config(name: str, seed: int, size: int) -> Any:
    """The dataset's configuration with every curriculum attribute at its hardest level only.

    Raises:
        SuiteConfigError: Unknown dataset, or one without a curriculum.
    """
    from reasoning_gym.coaching.base_curriculum import DefaultCurriculumContext, RangeAttributeMode
    from reasoning_gym.factory import CURRICULA, DATASETS, create_curriculum

    if name not in DATASETS:
        raise SuiteConfigError(f"reasoning-gym has no dataset {name!r}; known: {', '.join(sorted(DATASETS))}")
    if name not in CURRICULA:
        raise SuiteConfigError(
            f"reasoning-gym dataset {name!r} has no curriculum, so it has no hardest level to set; choose another"
        )
    curriculum = create_curriculum(name)
    top = max(len(attr.levels) for attr in curriculum.attributes.values())
    curriculum.set_global_level(top)  # each attribute is capped at its own last level
    context = DefaultCurriculumContext(mode=RangeAttributeMode.LAST_K, k=1)
    return curriculum.generate_configuration({"seed": seed, "size": size}, context=context)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return str(value)


class ReasoningGymSuite:
    """Reasoning-Gym items, generated and scored by the package.

    Args:
        model: The model to evaluate.
        seed: Seed of the item set.
        datasets: Dataset names (each must have a curriculum).
        items_per_category: Items per category (spread round-robin over its datasets).
    """

    name = NAME

    def __init__(
        self,
        model: ChatModel | None,
        seed: int,
        datasets: Sequence[str] = DEFAULT_DATASETS,
        items_per_category: int = 25,
    ) -> None:
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if items_per_category < 1:
            raise SuiteConfigError(f"items_per_category must be >= 1, got {items_per_category}")
        if not datasets:
            raise SuiteConfigError("the reasoning-gym suite needs at least one dataset")
        self.model = model
        self.seed = seed
        self.items_per_category = items_per_category
        self.system_prompt = SYSTEM_PROMPTS["default"]
        # Generation and scoring run in worker threads (off the event loop); the package is not
        # written for threads (shared caches in sympy and some generators), so one at a time.
        self._package_lock = threading.Lock()
        self._datasets: dict[str, Any] = {}
        self._configs: dict[str, dict[str, Any]] = {}
        self._category: dict[str, str] = {}
        by_category: dict[str, list[str]] = {}
        for name in dict.fromkeys(datasets):
            config = hardest_config(name, _dataset_seed(seed, name), items_per_category)
            cls = DATASETS[name][0]
            package_category = cls.__module__.split(".")[1]
            category = PAPER_CATEGORIES.get(package_category, package_category)
            self._category[name] = category
            self._configs[name] = _jsonable(dataclasses.asdict(config))
            self._datasets[name] = cls(config=config)
            by_category.setdefault(category, []).append(name)
        self._items = self._interleave(by_category)

    def _interleave(self, by_category: dict[str, list[str]]) -> list[EvalItem]:
        per_category: list[list[EvalItem]] = []
        for category in sorted(by_category):
            names = by_category[category]
            listed = []
            for k in range(self.items_per_category):
                name = names[k % len(names)]
                index = k // len(names)
                listed.append(EvalItem(f"{name}/{index}", category, (name, index)))
            per_category.append(listed)
        # Category by category in turn, so a --limit prefix samples every category.
        return [item for row in zip(*per_category, strict=True) for item in row]

    def config(self) -> dict[str, Any]:
        """Datasets, their hardest configurations, items per category and the package version."""
        return {
            "package": f"reasoning-gym=={version('reasoning-gym')}",
            "items_per_category": self.items_per_category,
            "system_prompt": "default",
            "datasets": {name: {"category": self._category[name], **self._configs[name]} for name in self._configs},
        }

    def items(self) -> list[EvalItem]:
        """Every item, categories interleaved."""
        return list(self._items)

    def entry(self, item: EvalItem) -> dict[str, Any]:
        """The package's entry (question, answer, metadata) for ``item``."""
        name, index = item.payload
        with self._package_lock:
            return dict(self._datasets[name][index])

    def score(self, item: EvalItem, entry: dict[str, Any], response: str) -> tuple[float, str | None, str]:
        """Score ``response`` with the dataset's own scorer.

        Returns:
            ``(score, extracted answer, error)``; a scorer that raises gives ``(0.0, answer, why)``.
        """
        from reasoning_gym.utils import extract_answer

        name, _ = item.payload
        answer = extract_answer(response)
        try:
            with self._package_lock:
                value = float(self._datasets[name].score_answer(answer, entry))
        except Exception as exc:  # the package's scorer failed: the item counts 0, logged
            log.warning("reasoning-gym scorer of %s raised on item %s: %r", name, item.id, exc)
            return 0.0, answer, f"scorer raised {type(exc).__name__}: {exc}"
        if not 0.0 <= value <= 1.0:
            return 0.0, answer, f"scorer returned {value}, outside [0, 1]"
        return value, answer, ""

    def messages(self, entry: dict[str, Any]) -> list[dict[str, str]]:
        """The prompt: the package's default system prompt and the question."""
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": str(entry["question"])}]

    async def run(self, item: EvalItem) -> ItemResult:
        """Ask the model and score its answer."""
        if self.model is None:
            raise RuntimeError("this ReasoningGymSuite was built without a model; it can only list and score")
        entry = await asyncio.to_thread(self.entry, item)
        messages = self.messages(entry)
        detail: dict[str, Any] = {"gold": _jsonable(entry.get("answer"))}
        try:
            reply = await self.model.reply(messages, key=item.id)
        except PromptRejected as exc:
            return ItemResult(item.id, item.category, prompt_hash(messages), (), 0.0, str(exc), detail)
        score, answer, error = await asyncio.to_thread(self.score, item, entry, reply.text)
        detail.update(answer=answer, finish_reason=reply.finish_reason, output_tokens=reply.output_tokens)
        return ItemResult(item.id, item.category, prompt_hash(messages), (reply.text,), score, error, detail)

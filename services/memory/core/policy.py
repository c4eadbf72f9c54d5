"""Which earlier environments the designer sees: the memory policy (pure, deterministic per seed).

Per setting and skill the store hands over the ``window`` most recent *scored* environments (those
with a windowed win rate) as ``Candidate``s, without their code. ``choose`` picks from them;
``with_code`` then attaches excerpts of the few chosen (so a window never loads 200 programs):

- **positives** are learnable — ``spade.signal.learnable``, the paper's band [0.2, 0.8] of the window
  win rate, the one definition the learner's reward and the metrics use — ranked by regret (highest
  first; unmeasured regret last). The top ``max(pool_factor · n, pool_min)`` form a pool and ``n``
  are drawn from it with ``random.Random(seed)``, then shown best first;
- **negatives** are the rest: too easy (win rate above the band) or too hard (below it); ``n`` are
  drawn with the same generator, alternating easy and hard while both remain so one failure mode does
  not crowd out the other.

Every example carries a short code excerpt (starting at the environment class) and its reason with the
numbers — the reference showed negatives by class name only, which teaches the designer nothing.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spade.memory.records import Candidate, Example, Examples, Pick, Picks
from spade.signal import LEARNABLE_BAND, learnable


@dataclass(frozen=True)
class PolicyConfig:
    """Counts and sizes of the memory policy (the bands are ``spade.signal``'s).

    Attributes:
        window: Most recent scored environments considered per setting and skill.
        pool_factor: The positive pool is ``max(pool_factor * n, pool_min)`` top-regret candidates.
        pool_min: See ``pool_factor``.
        excerpt_chars: Longest code excerpt, cut at a line boundary.
    """

    window: int = 200
    pool_factor: int = 3
    pool_min: int = 10
    excerpt_chars: int = 1200

    def __post_init__(self) -> None:
        if self.window < 1 or self.excerpt_chars < 80:
            raise ValueError(f"window ({self.window}) must be >= 1 and excerpt_chars ({self.excerpt_chars}) >= 80")


def excerpt(code: str, limit: int) -> str:
    """Cut ``code`` to at most ``limit`` characters, starting at its first class, at a line boundary.

    >>> excerpt("import random\\n\\nclass AEnv:\\n    x = 1\\n", 100)
    'class AEnv:\\n    x = 1'
    """
    lines = code.strip("\n").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("class ")), 0)
    text = "\n".join(lines[start:]).rstrip()
    if len(text) <= limit:
        return text
    marker = "\n    # ... (truncated)"
    cut = text[: limit - len(marker)]
    if "\n" in cut:
        cut = cut[: cut.rindex("\n")]
    return cut.rstrip() + marker


def _fmt(x: float | None) -> str:
    return "unmeasured" if x is None else f"{x:.2f}"


def choose(window: Sequence[Candidate], n_positive: int, n_negative: int, seed: int, config: PolicyConfig) -> Picks:
    """Choose the designer's positive and negative examples from a window of scored environments.

    Args:
        window: Candidates of one setting and skill (any order; unscored ones are ignored).
        n_positive: Positives wanted (fewer when fewer qualify).
        n_negative: Negatives wanted.
        seed: Seeds the draw: the same window and seed give the same picks.
        config: Bands and sizes.

    Returns:
        The picks with their reasons, positives best regret first.
    """
    if n_positive < 0 or n_negative < 0:
        raise ValueError(f"example counts must be >= 0, got {n_positive} positive, {n_negative} negative")
    rng = random.Random(seed)
    scored = sorted((c for c in window if c.win_rate is not None), key=lambda c: -c.seq)[: config.window]
    lo, hi = LEARNABLE_BAND

    def regret_key(c: Candidate) -> tuple[bool, float, int]:
        return (c.regret is None, -(c.regret or 0.0), -c.seq)

    positive = sorted((c for c in scored if learnable(c.win_rate or 0.0)), key=regret_key)
    pool = positive[: max(config.pool_factor * n_positive, config.pool_min)]
    chosen = sorted(rng.sample(pool, min(n_positive, len(pool))), key=regret_key)
    positives = tuple(Pick(c, f"learnable: win rate {_fmt(c.win_rate)}, regret {_fmt(c.regret)}") for c in chosen)

    easy = [c for c in scored if (c.win_rate or 0.0) > hi]
    hard = [c for c in scored if (c.win_rate or 0.0) < lo]
    rng.shuffle(easy)
    rng.shuffle(hard)
    negatives: list[Pick] = []
    while len(negatives) < n_negative and (easy or hard):
        for bucket, label in ((easy, "too easy"), (hard, "too hard")):
            if bucket and len(negatives) < n_negative:
                c = bucket.pop()
                reason = (
                    f"{label}: win rate {_fmt(c.win_rate)} over {c.window_plays} plays "
                    f"without the hint, regret {_fmt(c.regret)}"
                )
                negatives.append(Pick(c, reason))
    return Picks(positives=positives, negatives=tuple(negatives))


def with_code(picks: Picks, code: Mapping[str, str], config: PolicyConfig) -> Examples:
    """Attach a code excerpt to every pick.

    Args:
        picks: From ``choose``.
        code: Full code by environment id, for at least ``picks.env_ids()``.
        config: Gives the excerpt length.
    """

    def example(p: Pick) -> Example:
        c = p.candidate
        return Example(
            env_id=c.env_id,
            skill=c.skill,
            code=excerpt(code[c.env_id], config.excerpt_chars),
            reason=p.reason,
            win_rate=c.win_rate if c.win_rate is not None else 0.0,
            regret=c.regret,
        )

    return Examples(
        positives=tuple(example(p) for p in picks.positives), negatives=tuple(example(p) for p in picks.negatives)
    )

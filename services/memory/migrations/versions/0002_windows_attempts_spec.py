"""The env's own window, designer attempts, the run spec, process metrics and web sessions.

- ``environments``: the env's window (``window_start``, ``window_versions``; WAVE2 §3) and its
  program length;
- ``plays``: ``window_start``, ``window_index`` and ``spec_id``. Plays recorded before this revision
  get the slot the old scoring gave them (``weight_version`` minus the env's designing version);
- ``env_stats``: ``solved_fraction``, ``regret_note`` (why no regret is stored), ``reward_levels``
  and ``turns_mean``; every env is rescored with ``spade.signal``'s definitions (win rate = mean
  return, strict regret, learnable band [0.2, 0.8]);
- new tables ``designer_attempts``, ``run_spec``, ``env_probes``, ``env_embeddings``, ``web_sessions``.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _add_columns() -> None:
    with op.batch_alter_table("environments") as t:
        t.add_column(sa.Column("window_start", sa.BigInteger(), nullable=True))
        t.add_column(sa.Column("window_versions", sa.Integer(), nullable=False, server_default="0"))
        t.add_column(sa.Column("program_lines", sa.Integer(), nullable=False, server_default="0"))
        t.add_column(sa.Column("program_chars", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("env_stats") as t:
        t.add_column(sa.Column("solved_fraction", sa.Float(), nullable=True))
        t.add_column(sa.Column("regret_note", sa.Text(), nullable=False, server_default=""))
        t.add_column(sa.Column("reward_levels", sa.Integer(), nullable=False, server_default="0"))
        t.add_column(sa.Column("turns_mean", sa.Float(), nullable=True))
    op.create_index("ix_env_stats_updated_at", "env_stats", ["updated_at"])
    with op.batch_alter_table("plays") as t:
        t.add_column(sa.Column("window_start", sa.BigInteger(), nullable=False, server_default="0"))
        t.add_column(sa.Column("window_index", sa.Integer(), nullable=False, server_default="0"))
        t.add_column(sa.Column("spec_id", sa.String(64), nullable=False, server_default=""))


def _create_tables() -> None:
    op.create_table(
        "designer_attempts",
        sa.Column("seq", SEQ, primary_key=True, autoincrement=True),
        sa.Column("sample_id", sa.String(200), nullable=False),
        sa.Column("setting", sa.String(16), nullable=False),
        sa.Column("skill", sa.String(100), nullable=False),
        sa.Column("batch_id", sa.String(200), nullable=False),
        sa.Column("weight_version", sa.BigInteger(), nullable=False),
        sa.Column("outcome", sa.String(100), nullable=False),
        sa.Column("env_id", sa.String(64), nullable=False),
        sa.Column("spec_id", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("seq", name="pk_designer_attempts"),
        sa.UniqueConstraint("sample_id", name="uq_designer_attempts_sample_id"),
    )
    op.create_index("ix_designer_attempts_batch_id_seq", "designer_attempts", ["batch_id", "seq"])
    op.create_table(
        "run_spec",
        sa.Column("slot", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("spec_id", sa.String(64), nullable=False),
        sa.Column("spec_json", sa.Text(), nullable=False),
        sa.Column("set_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("slot", name="pk_run_spec"),
    )
    op.create_table(
        "env_probes",
        sa.Column("env_id", sa.String(64), nullable=False),
        sa.Column("first_observation", sa.Text(), nullable=False),
        sa.Column("hidden_attributes", sa.JSON(), nullable=False),
        sa.Column("solution", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("hidden_state_size", sa.Integer(), nullable=False),
        sa.Column("hidden_state_bytes", sa.BigInteger(), nullable=False),
        sa.Column("leaked", sa.Boolean(), nullable=True),
        sa.Column("leak_rule", sa.String(32), nullable=False),
        sa.Column("probed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("env_id", name="pk_env_probes"),
        sa.ForeignKeyConstraint(
            ["env_id"], ["environments.id"], name="fk_env_probes_env_id_environments", ondelete="CASCADE"
        ),
    )
    op.create_table(
        "env_embeddings",
        sa.Column("env_id", sa.String(64), nullable=False),
        sa.Column("description_sha256", sa.String(64), nullable=False),
        sa.Column("model", sa.String(100), nullable=False),
        sa.Column("dim", sa.Integer(), nullable=False),
        sa.Column("vector", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("env_id", name="pk_env_embeddings"),
        sa.ForeignKeyConstraint(
            ["env_id"], ["environments.id"], name="fk_env_embeddings_env_id_environments", ondelete="CASCADE"
        ),
    )
    op.create_table(
        "web_sessions",
        sa.Column("id_sha256", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id_sha256", name="pk_web_sessions"),
    )


def _backfill() -> None:
    """Slots for old plays, program lengths, and every env rescored with spade.signal's definitions."""
    from services.memory.core.scoring import score, shape
    from spade.envs.types import FinishReason
    from spade.memory.records import EnvStats, Play
    from spade.pool_metrics import program_length

    conn = op.get_bind()
    conn.execute(
        sa.text(
            "UPDATE plays SET window_start = (SELECT e.weight_version FROM environments e WHERE e.id = plays.env_id)"
        )
    )
    conn.execute(
        sa.text("UPDATE plays SET window_index = CASE WHEN weight_version > window_start THEN weight_version - window_start ELSE 0 END")
    )
    for env_id, code in conn.execute(sa.text("SELECT id, code FROM environments")).all():
        length = program_length(code)
        conn.execute(
            sa.text("UPDATE environments SET program_lines = :l, program_chars = :c WHERE id = :i"),
            {"l": length.lines, "c": length.chars, "i": env_id},
        )
    now = datetime.now(UTC)
    stats = conn.execute(sa.text("SELECT env_id, reward_components FROM env_stats")).all()
    for env_id, components in stats:
        rows = conn.execute(
            sa.text(
                "SELECT seed, hinted, episode_return, turns, weight_version, trajectory_id, finish_reason, "
                "window_start, window_index FROM plays WHERE env_id = :i"
            ),
            {"i": env_id},
        ).all()
        plays = [
            Play(env_id, r[0], bool(r[1]), min(max(float(r[2]), 0.0), 1.0), r[3], r[4], r[5], FinishReason.stored(r[6] or ""), None, r[7], r[8])
            for r in rows
        ]
        if isinstance(components, str):  # SQLite hands JSON back as text through a plain text() query
            components = json.loads(components)
        st = score(plays, None, EnvStats(reward_components=dict(components or {})))
        sh = shape(plays)
        conn.execute(
            sa.text(
                "UPDATE env_stats SET plays = :plays, window_plays = :wp, win_rate = :wr, regret = :rg, "
                "learnable = :ln, solved_fraction = :sf, regret_note = :note, reward_levels = :rl, "
                "turns_mean = :tm, updated_at = :now WHERE env_id = :i"
            ),
            {
                "plays": st.plays,
                "wp": st.window_plays,
                "wr": st.win_rate,
                "rg": st.regret,
                "ln": st.learnable,
                "sf": st.solved_fraction,
                "note": st.regret_note,
                "rl": sh.reward_levels,
                "tm": sh.turns_mean,
                "now": now,
                "i": env_id,
            },
        )


def upgrade() -> None:
    _add_columns()
    _create_tables()
    _backfill()


def downgrade() -> None:
    op.drop_table("web_sessions")
    op.drop_table("env_embeddings")
    op.drop_table("env_probes")
    op.drop_table("run_spec")
    op.drop_index("ix_designer_attempts_batch_id_seq", table_name="designer_attempts")
    op.drop_table("designer_attempts")
    with op.batch_alter_table("plays") as t:
        t.drop_column("spec_id")
        t.drop_column("window_index")
        t.drop_column("window_start")
    op.drop_index("ix_env_stats_updated_at", table_name="env_stats")
    with op.batch_alter_table("env_stats") as t:
        t.drop_column("turns_mean")
        t.drop_column("reward_levels")
        t.drop_column("regret_note")
        t.drop_column("solved_fraction")
    with op.batch_alter_table("environments") as t:
        t.drop_column("program_chars")
        t.drop_column("program_lines")
        t.drop_column("window_versions")
        t.drop_column("window_start")

"""initial schema: policy versions, rounds, groups, attempts

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "policy_version",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("base_model", sa.String(length=500), nullable=False),
        sa.Column("parent", sa.String(length=200), nullable=True),
        sa.Column("adapter_path", sa.Text(), nullable=True),
        sa.Column("round_index", sa.Integer(), nullable=False),
        sa.Column("promoted", sa.Boolean(), nullable=False),
        sa.Column("eval_pass_at_1", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "rollout_group",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("round_index", sa.Integer(), nullable=False),
        sa.Column("purpose", sa.String(length=20), nullable=False),
        sa.Column("task_id", sa.String(length=200), nullable=False),
        sa.Column("taskset", sa.String(length=100), nullable=False),
        sa.Column("question", sa.Text(), nullable=False),
        sa.Column("policy_version", sa.String(length=200), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("complete", sa.Boolean(), nullable=False),
        sa.Column("reward_mean", sa.Float(), nullable=True),
        sa.Column("reward_std", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("round_index", "purpose", "task_id", "policy_version"),
    )
    with op.batch_alter_table("rollout_group", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_rollout_group_round_index"), ["round_index"], unique=False
        )

    op.create_table(
        "training_round",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("round_index", sa.Integer(), nullable=False),
        sa.Column("method", sa.String(length=50), nullable=False),
        sa.Column("policy_in", sa.String(length=200), nullable=False),
        sa.Column("policy_out", sa.String(length=200), nullable=True),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("hyperparameters", sa.JSON(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("round_index"),
    )
    op.create_table(
        "attempt",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("group_id", sa.Integer(), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=30), nullable=False),
        sa.Column("policy_version", sa.String(length=200), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("sampling", sa.JSON(), nullable=False),
        sa.Column("completion", sa.Text(), nullable=True),
        sa.Column("prompt_token_ids", sa.JSON(), nullable=True),
        sa.Column("completion_token_ids", sa.JSON(), nullable=True),
        sa.Column("logprobs", sa.JSON(), nullable=True),
        sa.Column("finish_reason", sa.String(length=30), nullable=True),
        sa.Column("reward", sa.Float(), nullable=False),
        sa.Column("correct", sa.Boolean(), nullable=False),
        sa.Column("format_ok", sa.Boolean(), nullable=False),
        sa.Column("answer", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["group_id"], ["rollout_group.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("group_id", "sample_index", "kind"),
    )


def downgrade() -> None:
    op.drop_table("attempt")
    op.drop_table("training_round")
    with op.batch_alter_table("rollout_group", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rollout_group_round_index"))

    op.drop_table("rollout_group")
    op.drop_table("policy_version")

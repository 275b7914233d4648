"""outcome counts per (task, answer key); on attempts, shaped rewards with their terms, the
strategy, the spans the policy did not sample, and the tokens generated

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outcome_count",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.String(length=200), nullable=False),
        sa.Column("answer_key", sa.String(length=200), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("task_id", "answer_key"),
    )
    with op.batch_alter_table("attempt") as batch:
        batch.add_column(sa.Column("shaped_reward", sa.Float(), nullable=True))
        batch.add_column(sa.Column("shaping", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("strategy", sa.Text(), nullable=True))
        batch.add_column(sa.Column("forced_spans", sa.JSON(), nullable=True))
        batch.add_column(
            sa.Column("generated_tokens", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("attempt") as batch:
        batch.drop_column("generated_tokens")
        batch.drop_column("forced_spans")
        batch.drop_column("strategy")
        batch.drop_column("shaping")
        batch.drop_column("shaped_reward")
    op.drop_table("outcome_count")

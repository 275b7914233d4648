"""attempt context (guidance, bare prompt ids, retry pivot) and the round's data cursor

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempt") as batch:
        batch.add_column(
            sa.Column("context", sa.String(length=50), nullable=False, server_default="bare")
        )
        batch.add_column(sa.Column("guidance", sa.Text(), nullable=True))
        batch.add_column(sa.Column("bare_prompt_token_ids", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("parent_index", sa.Integer(), nullable=True))
        batch.add_column(
            sa.Column("pivot_tokens", sa.Integer(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("improved", sa.Boolean(), nullable=True))
    with op.batch_alter_table("training_round") as batch:
        batch.add_column(sa.Column("group_ids", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("training_round") as batch:
        batch.drop_column("group_ids")
    with op.batch_alter_table("attempt") as batch:
        for column in (
            "improved",
            "pivot_tokens",
            "parent_index",
            "bare_prompt_token_ids",
            "guidance",
            "context",
        ):
            batch.drop_column(column)

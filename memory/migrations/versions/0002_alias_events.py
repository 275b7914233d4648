"""alias events, and when each policy version was promoted

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alias_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("alias", sa.String(length=100), nullable=False),
        sa.Column("action", sa.String(length=20), nullable=False),
        sa.Column("from_version", sa.String(length=200), nullable=True),
        sa.Column("to_version", sa.String(length=200), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_alias_event_alias", "alias_event", ["alias"])
    with op.batch_alter_table("policy_version") as batch:
        batch.add_column(sa.Column("promoted_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policy_version") as batch:
        batch.drop_column("promoted_at")
    op.drop_index("ix_alias_event_alias", table_name="alias_event")
    op.drop_table("alias_event")

"""the experience library: entries by scope and zone, where each was used, and every change

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "experience_entry",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("scope", sa.String(length=20), nullable=False),
        sa.Column("scope_key", sa.String(length=200), nullable=False),
        sa.Column("zone", sa.String(length=10), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("fingerprint", sa.String(length=32), nullable=False),
        sa.Column("embedding", sa.LargeBinary(), nullable=True),
        sa.Column("evidence", sa.Integer(), nullable=False),
        sa.Column("utility", sa.Float(), nullable=False),
        sa.Column("exposures", sa.Integer(), nullable=False),
        sa.Column("negative_windows", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=10), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("scope", "scope_key", "zone", "fingerprint"),
    )
    op.create_index("ix_experience_entry_status", "experience_entry", ["status"])
    op.create_table(
        "experience_use",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("entry_id", sa.Integer(), sa.ForeignKey("experience_entry.id"), nullable=False),
        sa.Column("group_id", sa.Integer(), sa.ForeignKey("rollout_group.id"), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("similarity", sa.Float(), nullable=True),
        sa.Column("gain", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("entry_id", "group_id"),
    )
    op.create_table(
        "library_event",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("entry_id", sa.Integer(), sa.ForeignKey("experience_entry.id"), nullable=False),
        sa.Column("action", sa.String(length=20), nullable=False),
        sa.Column("before", sa.JSON(), nullable=False),
        sa.Column("after", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_library_event_entry_id", "library_event", ["entry_id"])


def downgrade() -> None:
    op.drop_index("ix_library_event_entry_id", table_name="library_event")
    op.drop_table("library_event")
    op.drop_table("experience_use")
    op.drop_index("ix_experience_entry_status", table_name="experience_entry")
    op.drop_table("experience_entry")

"""work items remember why they failed: failures counted while the server answered, the last
error, and the time before which a given-back item is not claimed again

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("work_item") as batch:
        batch.add_column(sa.Column("failures", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("not_before", sa.Float(), nullable=True))
        batch.add_column(sa.Column("error", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("work_item") as batch:
        batch.drop_column("error")
        batch.drop_column("not_before")
        batch.drop_column("failures")

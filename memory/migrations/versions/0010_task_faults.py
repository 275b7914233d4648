"""work items say whose failure ended them (the task's own, or the server's), and count the
claims that ended with their worker gone

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("work_item") as batch:
        batch.add_column(sa.Column("fault", sa.String(10), nullable=True))
        batch.add_column(sa.Column("abandoned", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("work_item") as batch:
        batch.drop_column("abandoned")
        batch.drop_column("fault")

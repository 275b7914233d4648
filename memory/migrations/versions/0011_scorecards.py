"""policy versions record which evaluations judged them, each with its figure, n and 95%
interval (the gate's evidence)

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("policy_version") as batch:
        batch.add_column(sa.Column("scorecards", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policy_version") as batch:
        batch.drop_column("scorecards")

"""policy versions may have merged weights: a full model folder beside the adapter

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("policy_version") as batch:
        batch.add_column(sa.Column("weights_path", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("policy_version") as batch:
        batch.drop_column("weights_path")

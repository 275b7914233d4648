"""Alembic environment: runs on the connection the store hands over in `config.attributes`."""

from alembic import context

from memory.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()

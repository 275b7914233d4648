"""memory: typed records and everything the flywheel keeps, in SQL.

Public surface:
- `memory.records`: the frozen records that cross packages (`Attempt`, `Group`, `Sample`,
  `PolicyVersion`, `TrainingRound`, `WorkItem`, `Segment`, `Step`, ...), `FULL_REWARD`,
  `describe` (a validation error in one line).
- `memory.store`: open a database and read and write records in the caller's transaction (a
  facade over `database`, `ingest`, `groups`, `versions`, `rounds`, `outcomes`, `stats`).
- `memory.workqueue`: the collection queue, with leases and backoff.
- `memory.library`, `memory.retrieval`, `memory.embedding`: the experience library.
- `memory.trajectory`: a completion cut into token segments by loss type, and steps.
- `memory.sessions`: captured conversations stitched into episodes, grouped by task.
- `memory.actions`: what people did from the page (rate, hold out, forget, promote, roll back).
- `memory.models` (the tables; the migrations in `migrations/`) and `memory.rows` (records to
  rows and back), under the store.
- `memory.folders`: folders published atomically. `memory.errors`: `StoreError`, `NotFound`.
"""

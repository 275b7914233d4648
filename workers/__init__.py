"""workers: the collection runtime, without Prefect. `workers.worker.work` claims queued tasks
from the store, collects their groups and stores them; any number of workers in any process on
any machine share one queue. `workers.readiness.Readiness` waits until a model server generates
with the version a lot needs. Flows run a worker for their own batches; `flywheel worker` runs
one on its own."""

"""flows: the command line, the Prefect flows and the collection workers; the only package that
imports Prefect. Imports are deliberately not re-exported here, so `flywheel --help` stays fast.

Public surface:
- `flows.cli.main`: the `flywheel` command (parser and error boundary); the commands live in
  `flows.launch` (run, serve, worker), `flows.inspection`, `flows.admin` and `flows.export`.
- `flows.settings.RunSettings`, `load_run_settings`: what one run does; `flows.flags` makes the
  run flags from its fields.
- `flows.flywheel`: `flywheel_run`, `collect_batch`, `train_when_ready`, `serve_rounds`.
- `flows.rounds` (`RoundContext`, `run_round`), `flows.stages` (the Prefect tasks),
  `flows.evaluation` (held-out figures, the baseline).
- `flows.worker.work`, `WorkerSettings`: a collection worker on the store's queue;
  `flows.readiness.Readiness`: waits until the server generates with a version.
- `flows.summary.RunSummary`, `flows.report`: what a run printed, plots from the store.
- `flows.errors.FlowError`.
"""

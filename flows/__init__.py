"""flows: the Prefect flows and their stages; the only package that imports Prefect. Imports are
deliberately not re-exported here.

Public surface:
- `flows.settings.RunSettings`, `load_run_settings`: what one run does.
- `flows.flywheel`: `flywheel_run`, `collect_batch`, `train_when_ready`, `serve_rounds`.
- `flows.rounds` (`RoundContext`, `run_round`), `flows.stages` (the Prefect tasks),
  `flows.evaluation` (held-out figures, the baseline), `flows.artifacts` (tables for the UI).
- `flows.scorecards` (versions trained on captured traffic judged on the agent's own work),
  `flows.siblings` (groups for sessions whose task was met once).
- `flows.pools` (work-pool deployments), `flows.orchestrator` (a local Prefect server).
- `flows.errors.FlowError`.

The command line is `cli/`, the collection workers `workers/`, the summary and report
`reports/`.
"""

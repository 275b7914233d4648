"""verifiers: tasks, their held-out splits and the verifiers that score attempts.

Public surface:
- `verifiers.catalog`: every task set by name (`eval_tasks`, `train_tasks`, `worked_example`,
  `system_prompt`, `verify`, `averify`, `check`).
- `verifiers.task.Task`, `verifiers.verdict.Verdict`.
- `verifiers.sandbox`: `Sandbox`, `best_isolation`, `Limits` for model-written code.
- `verifiers.episode.Environment` and the multi-turn environments (`guessing`, `ledger`).
- `verifiers.errors.VerifierError`.
"""

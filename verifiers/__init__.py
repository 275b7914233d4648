"""verifiers: tasks, their held-out splits and the verifiers that score attempts.

Public surface:
- `verifiers.catalog`: every task set by name (`eval_tasks`, `train_tasks`, `worked_example`,
  `system_prompt`, `verify`, `averify`, `check`); `verifiers.taskset.TaskSet`, what each is,
  and `verifiers.plugin`, a user's own (`module:attribute` or an entry point).
- The built-in task sets: `verifiers.reasoning` (reasoning-gym's arithmetic and two_digit_sums,
  with `verifiers.answer`'s extraction), `verifiers.coding` and `verifiers.humaneval` (code, run
  in the sandbox; `verifiers.problems`, their problems).
- `verifiers.guard`: a task set's own code under a deadline (its failure is the task's).
- `verifiers.task.Task`, `verifiers.verdict.Verdict`.
- `verifiers.sandbox`: `Sandbox`, `best_isolation`, `Limits` for model-written code.
- `verifiers.episode.Environment` and the multi-turn environments (`guessing`, `ledger`).
- `verifiers.errors.VerifierError`.
"""

"""trainer: TRL training rounds on stored groups (imports torch: load it only to train).

Public surface:
- `trainer.round.train_round`, `RoundResult`: one round, resumable, published atomically.
- `trainer.distributed.train(RoundRequest)`: a round here, or in one process per GPU (torchrun).
- `trainer.settings.TrainSettings`: a round's hyperparameters (no torch needed).
- `trainer.dataset`: rows on the sampled token ids (`build_rows`, `member_advantages`).
- `trainer.advantages`: GRPO, R3L and mean-only (filtered, RLTLDR) advantages; `trainer.steps`:
  SLEA-RL's step credit in episodes. `trainer.errors.TrainerError`.
- `trainer.merge`: a version's merged weights, for serving at the base model's speed.
"""

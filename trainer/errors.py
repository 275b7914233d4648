"""The one exception trainer/ raises."""


class TrainerError(RuntimeError):
    """A training round could not produce a valid checkpoint. One line, actionable."""

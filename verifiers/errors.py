"""The one exception verifiers/ raises."""


class VerifierError(ValueError):
    """A task set or verifier was asked for something that does not exist or cannot work."""


class TaskFault(VerifierError):
    """A task set's own code failed or passed its deadline on one task: that task's fault,
    recorded against it, never a reason to stop other tasks."""

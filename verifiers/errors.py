"""The one exception verifiers/ raises."""


class VerifierError(ValueError):
    """A task set or verifier was asked for something that does not exist or cannot work."""

"""The exceptions memory/ raises."""


class StoreError(RuntimeError):
    """The store could not be opened, or a record does not fit it. One line, actionable."""


class NotFound(StoreError):
    """A named record (a policy version, a capture id, a library lesson) is not in the store."""

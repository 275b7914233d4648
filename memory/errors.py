"""The one exception memory/ raises."""


class StoreError(RuntimeError):
    """The store could not be opened, or a record does not fit it. One line, actionable."""

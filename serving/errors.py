"""The one exception serving/ raises: its message is a single line a user can act on."""


class ServingError(RuntimeError):
    """The model server or an adapter could not be prepared, started, loaded or checked."""

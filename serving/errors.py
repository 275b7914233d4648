"""The exceptions serving/ raises: each message is a single line a user can act on."""


class ServingError(RuntimeError):
    """The model server or an adapter could not be prepared, started, loaded or checked."""


class UpstreamError(ServingError):
    """An upstream model server failed to answer (the gateway answers 502 or 503)."""

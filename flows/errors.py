"""The exception flows/ raises: a problem with how the command was asked or set up (a setting, a
flag, a path, a missing key), one line a user can act on."""


class FlowError(RuntimeError):
    """The command cannot run as asked."""

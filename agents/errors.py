"""The one exception agents/ raises."""


class AgentError(RuntimeError):
    """An agent could not complete a step."""


class PolicyError(AgentError):
    """A call to the policy server failed; the message is one line for the attempt record."""

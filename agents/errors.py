"""The exceptions agents/ raises.

A call can fail two ways, and they are kept apart because they mean different things:

- `PolicyError`: the server answered, but this attempt cannot go on (a request it refused as
  bad, a chat template that does not extend a transcript). It is the attempt's own failure:
  recorded on the attempt, whose group is then never trained on.
- `ServerUnavailable`: the server could not answer at all (connection refused or lost, a
  timeout, a stall, a 5xx, a model it does not serve, a server that is not vLLM). It says
  nothing about the task, so it is never recorded as an attempt: it propagates, the group is
  abandoned, and whoever claimed the task gives it back to the queue.
- `ServerBusy`, a kind of `ServerUnavailable`: a deadline the client's ceiling cut short, because
  the queue of requests it shared needed longer. That load says nothing about this task either,
  so a work queue gives the task back without counting it as the task's failure.
"""


class AgentError(RuntimeError):
    """An agent could not complete a step."""


class PolicyError(AgentError):
    """A call to the policy server failed; the message is one line for the attempt record."""


class ServerUnavailable(AgentError):
    """The model server could not answer; the message names the server and says why."""


class ServerBusy(ServerUnavailable):
    """A deadline the ceiling cut short under a long queue: load, not the task's failure.
    `in_flight` is how many requests this client had on the server then."""

    def __init__(self, message: str, in_flight: int) -> None:
        super().__init__(message)
        self.in_flight = in_flight

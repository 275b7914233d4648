"""agents: async agents that sample from an OpenAI-compatible server, verify and record attempts.

Public surface:
- `agents.policy`: `PolicyClient` (token ids and logprobs, retries, the watchdog), `Endpoint`.
- `agents.collector`: `collect_groups`, `collect_group`, `first_failure`.
- `agents.settings.CollectSettings`: how a batch is sampled.
- The methods, a module each: `agents.slots` (guided slots and their `Conditioning`),
  `agents.strategy` (SGE), `agents.reflection` (R3L), `agents.insight` (RLTLDR),
  `agents.outcome` (outcome-based exploration), `agents.episode` (multi-turn episodes).
- `agents.watchdog`: deadlines and the stall watch; `agents.errors`: `AgentError`,
  `PolicyError` (an attempt's own failure), `ServerUnavailable` (never an answer).
"""

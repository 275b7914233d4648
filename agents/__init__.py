"""agents: async agents that sample from an OpenAI-compatible server, verify and record attempts.

Public surface:
- `agents.policy`: `PolicyClient` (token ids and logprobs, retries, the watchdog), `Endpoint`.
- `agents.collector`: `collect_groups`, `collect_group` (a `GroupSpec`, `Hooks`), `first_failure`.
- `agents.settings.CollectSettings`: how a batch is sampled.
- `agents.attempt`: one attempt (`attempt_task`) and its `Conditioning`; `agents.context`: the
  prompts' messages.
- The methods, a module each: `agents.slots` (guided slots), `agents.strategy` (SGE),
  `agents.reflection` (R3L; `agents.pivot`, its retry inside a one-step answer),
  `agents.insight` (RLTLDR), `agents.revision` (HeRL),
  `agents.nudge` (NudgeRL), `agents.annealing` (EAD), `agents.outcome` (outcome-based
  exploration), `agents.ruler` (RULER's ranking of captured episodes), `agents.pairwise`
  (the gate's blind comparison of two versions' replies), `agents.episode` (multi-turn
  episodes; `agents.lessons`, SLEA-RL's library lessons at their steps).
- `agents.watchdog`: deadlines and the stall watch; `agents.errors`: `AgentError`,
  `PolicyError` (an attempt's own failure), `ServerUnavailable` (never an answer).
"""

"""reports: what a run and the store say, for people: `reports.summary` (the `flywheel run`
summary, the README's contract, and its before/after table), `reports.report` (`flywheel
report`: a table per round and an HTML page of plots, from the store), `reports.table`
(terminal tables) and `reports.intervals` (95% intervals). Reads `memory/`; imports nothing
above it."""

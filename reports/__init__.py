"""reports: what a run and the store say, for people: `reports.summary` (the `flywheel run`
summary, the README's contract, and its before/after table), `reports.report` (`flywheel
report`: a table per round and an HTML page of plots, from the store) and `reports.table`
(terminal tables). Reads `memory/`; imports nothing above it."""

"""reports: what a run and the store say, for people: `reports.summary` (the `flywheel run`
summary, the README's contract, and its before/after table), `reports.report` (`flywheel
report`: a table per round and an HTML page of plots, from the store), `reports.table`
(terminal tables), `reports.intervals` (95% intervals) and `reports.views` (what the page
shows, one typed view per page). Reads `memory/`; imports nothing
above it."""

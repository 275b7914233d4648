"""The benchmarks: each a module run from the checkout's root, `.venv/bin/python -m bench.NAME`
(`--help` says what it measures), printing a table and, with `--json PATH`, writing its figures
with their provenance (`bench.common`). `python -m bench.results` builds `bench/README.md` from
`bench/results/*.json`. Nothing outside bench/ imports it but the tests of its own figures."""

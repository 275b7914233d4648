"""The benchmarks: each a module run from the checkout's root, `.venv/bin/python bench/NAME.py`
or `-m bench.NAME` (`--help` says what it measures), printing a table and, with `--json PATH`,
writing its figures with their provenance (`bench.common`; `bench.smollm2_server` starts the
model servers they share, `bench.faults` the faulty proxy). `python -m bench.results` builds
`bench/README.md` from `bench/results/*.json`. Nothing outside bench/ imports it but the tests
of its own figures."""

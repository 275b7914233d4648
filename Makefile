# The two commands: `make run` (the main job) and `make test` (the default suite, about 25
# minutes on 2 cores; .ci/run calls it, then `make test-slow`: the tests marked slow).
# Both install what is missing first: the application's environment (.venv), the model server's
# environment (.venv-serving, vLLM for CPU), and the SmolLM2 model folder (.flywheel/models);
# `flywheel run --reviewer` builds the reviewer's model folder there too, once.

PYTHON ?= python3
VENV := .venv
SERVING := .venv-serving
ARGS ?=
PYTEST_ARGS ?=
# The default run serves a reviewer beside the policy, each on a core of its own, and distills the
# reviewer's answers to the groups the policy failed into the bare prompt (examples/reviewer.toml;
# the evidence: docs/experiments.md). `make run REVIEWER=` runs the policy alone.
REVIEWER ?= qwen2.5-coder-0.5b
RUN_DEFAULTS := $(if $(REVIEWER),--reviewer $(REVIEWER) --config examples/reviewer.toml)

.PHONY: run test test-slow setup model lint results clean

run: model
	$(VENV)/bin/flywheel run --summary-json .flywheel/summary.json $(RUN_DEFAULTS) $(ARGS)

test: model
	$(VENV)/bin/flywheel prepare-model --model tiny
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(call pytest,not slow)

test-slow: model
	$(VENV)/bin/flywheel prepare-model --model tiny
	$(call pytest,slow)

# pytest on a marker expression, naming its slowest tests; exit code 5 (no test selected) is not
# a failure.
define pytest
	$(VENV)/bin/pytest -m "$(1)" --durations=12 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc
endef

setup: $(VENV)/.installed $(SERVING)/.installed

model: setup
	$(VENV)/bin/flywheel prepare-model

# The results page, bench/README.md, from bench/results/*.json (a test checks it is current).
results: $(VENV)/.installed
	$(VENV)/bin/python -m bench.results

# Ruff everywhere; mypy --strict on every package (pyproject.toml).
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $@

# vLLM pins versions that conflict with Prefect's, so the server has an environment of its own.
# PyPI's torchvision does not import next to the CPU torch, and text models do not need it.
$(SERVING)/.installed: serving/requirements-cpu.txt
	$(PYTHON) -m venv $(SERVING)
	$(SERVING)/bin/pip install --quiet --upgrade pip
	$(SERVING)/bin/pip install --quiet -r serving/requirements-cpu.txt
	$(SERVING)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

clean:
	rm -rf $(VENV) $(SERVING) .flywheel

# Targets create .venv, install torch==2.13.0 FIRST (so pip never resolves a CUDA build), then the project.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-slow check-terraform bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,pyg]'
	touch $(STAMP)

venv: $(STAMP)

## demo: local training on the generated synthetic-small graph; prints accuracy, time (and cost)
demo: $(STAMP)
	$(BIN)/dorylus train --dataset synthetic-small

## test: the default test suite
test: $(STAMP)
	$(BIN)/pytest -q

## test-slow: the slow tier: a sample of the distributed-exactness matrix and the long runs (docs/testing.md)
test-slow: $(STAMP)
	$(BIN)/pytest -q -m slow

## check-terraform: `terraform fmt -check` and checkov, on-demand and spot (its own venv: it pins an old boto3)
CHECKOV_VENV := .venv-checkov
check-terraform:
	terraform fmt -check -recursive terraform/
	test -x $(CHECKOV_VENV)/bin/checkov || ($(PYTHON) -m venv $(CHECKOV_VENV) && \
		$(CHECKOV_VENV)/bin/pip install --quiet checkov==3.3.30)
	$(CHECKOV_VENV)/bin/checkov --quiet --compact --skip-download --framework terraform -d terraform/
	$(CHECKOV_VENV)/bin/checkov --quiet --compact --skip-download --framework terraform -d terraform/ \
		--var-file terraform/examples/spot.tfvars

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) build *.egg-info

# The two set-up commands (README): `make demo` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow test-all setup

demo:
	@bash scripts/setup.sh
	$(BIN)/qurl-prepare-demo
	$(BIN)/qurl-async --config configs/demo-cpu.yaml

test:
	@bash scripts/setup.sh test
	$(BIN)/python -m pytest -q

test-slow:
	@bash scripts/setup.sh test
	$(BIN)/python -m pytest -q -m slow

test-all:
	@bash scripts/setup.sh test
	$(BIN)/python -m pytest -q -m "slow or not slow"

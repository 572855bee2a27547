# The two set-up commands (README): `make demo` and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo real real-gsm lint test test-slow test-all test-sglang

demo:
	@bash scripts/setup.sh
	$(BIN)/qurl-prepare-demo
	$(BIN)/qurl-async --config configs/demo-cpu.yaml run.name=demo-cpu-$$(date +%Y%m%d-%H%M%S)

real:  # the real track: SmolLM2-135M-Instruct, warm-started on reasoning-gym arithmetic, then RL with INT8 rollout (README)
	@bash scripts/setup.sh real
	$(BIN)/qurl-prepare-real --gym configs/tasks/gym-arith.yaml
	$(BIN)/qurl-async --config configs/smollm2-gym-cpu.yaml run.name=smollm2-gym-cpu-$$(date +%Y%m%d-%H%M%S)

real-gsm:  # the hard track: the same model on GSM-Symbolic word problems (README: where it stands)
	@bash scripts/setup.sh real
	$(BIN)/qurl-prepare-real
	$(BIN)/qurl-async --config configs/smollm2-gsm-cpu.yaml run.name=smollm2-gsm-cpu-$$(date +%Y%m%d-%H%M%S)

lint:  # ruff, configured in pyproject.toml: the linter, then the formatter's check (`ruff format .` fixes it)
	@bash scripts/setup.sh test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m qurl.cpu_kernels --check-cpu-kinds  # the CPU kernels compile for each x86 kind

test:
	@bash scripts/setup.sh test
	$(BIN)/python -m pytest -q

test-slow:
	@bash scripts/setup.sh test
	$(BIN)/python -m pytest -q -m slow

test-all:
	@bash scripts/setup.sh test
	$(BIN)/python -m pytest -q -m "slow or not slow"

# The real sglang 0.5.23 on this CPU (.venv-sglang): SGLang's own pieces, then its Engine run for real through our
# adapter with the CPU stand-ins of tests/sglang_cpu (sgl_kernel, the quantized matmuls) on PYTHONPATH.
test-sglang:
	bash scripts/setup_sglang_cpu.sh
	.venv-sglang/bin/python -m pytest -q -p no:cacheprovider tests/test_sglang.py
	SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=tests/sglang_cpu .venv-sglang/bin/python -m pytest -q -p no:cacheprovider \
	  -W ignore::UserWarning -W ignore::DeprecationWarning tests/test_sglang_engine.py

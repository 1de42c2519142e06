# Two commands (see README): `make run` sets up and runs the main job; `make test` sets up and runs the tests.
PY := .venv/bin/python

.PHONY: setup run example test test-fast test-all lint bench

setup:
	./scripts/setup.sh

run: setup
	$(PY) -m vllm_ir bench --quick --plot bench.png

example: setup
	$(PY) examples/eager_dispatch.py

# The tiers (markers in tests/conftest.py): test-fast every contract test without the kit's
# grid or a costly kind; test (CI) all but `slow`, the kit's numerics grid sampled; test-all everything.
FAST := not (slow or grid or compile or subprocess or build or triton_interp)

test: setup
	$(PY) -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder

test-fast: setup
	$(PY) -m pytest -q -n 2 --dist load -m "$(FAST)"

test-all: setup
	$(PY) -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder -m "" --vllm-ir-full-grid

lint:
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

bench: setup
	$(PY) benchmarks/dispatch_overhead.py

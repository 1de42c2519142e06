# Two commands (see README): `make run` sets up and runs the main job; `make test` sets up and runs the tests.
PY := .venv/bin/python

.PHONY: setup run example test lint bench

setup:
	./scripts/setup.sh

run: setup
	$(PY) -m vllm_ir bench --quick --plot bench.png

example: setup
	$(PY) examples/eager_dispatch.py

test: setup
	$(PY) -m pytest -q -n 2 --dist loadscope

lint:
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

bench: setup
	$(PY) benchmarks/dispatch_overhead.py

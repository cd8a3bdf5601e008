# Set-up in two commands: `make demo` and `make test`. Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
# On a GPU machine, set TORCH_SPEC to the CUDA build you want (e.g. TORCH_SPEC=torch==2.13.0).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test test-oldest test-oldest-torch lint format clean slurm browser vllm gpu-check gpu-wheels

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,demo]"
	touch $@

demo: install
	@test -f demo/model/config.json || $(VENV)/bin/batchvl make-tiny-model demo/model --size tiny
	@test -d demo/data || $(VENV)/bin/batchvl make-sample-data demo/data
	$(VENV)/bin/batchvl run jobs/demo.yaml

# A local Slurm (Debian packages, root) for the tests that run array jobs on a real cluster.
slurm:
	bash scripts/install-slurm.sh

# vLLM's CPU build in a virtualenv of its own, for the tests of the openai backend against a real server
# (built once; VLLM_VENV moves it).
VLLM_VENV ?= $(HOME)/.cache/batchvl/vllm-venv
vllm:
	@$(VLLM_VENV)/bin/python -c "import vllm" 2>/dev/null || bash benchmarks/vllm_env.sh $(VLLM_VENV)

# Debian's Chromium and chromium-driver (root) for the test that opens `batchvl report`'s page.
browser:
	bash scripts/install-browser.sh

# The GPU check (scripts/gpu_check.py): the engine on a GPU in at most 9 minutes, one JSON, kept in
# benchmarks/results/ as gpu-check-<GPU>-<UTC time>.json with the benchmarks' own reports beside it
# (GPU_CHECK_JSON names another file). On a machine without network whose image has torch but not all of
# batchvl's requirements, `make gpu-wheels` (here, with network) saves the missing ones to .whl for Python
# 3.12; gpu-check installs them from there. The GPU images lent so far have torch 2.11 and transformers
# 5.17, both in batchvl's ranges: they are used. DEVICE=cpu runs the same stages on a CPU (a trial: its
# reports, gpu-check-cpu-*.json, are git-ignored); GPU_CHECK_STAGES=parity,host_step (names,
# comma-separated) runs only those stages. Correctness and the 2B runs without and with the fast paths come
# first; where the 9 minutes run short the rest is skipped, and a GPU window's second call names it
# (GPU_CHECK_STAGES=sampled_job,constrained_job,two_processes,vit_dp,host_step,fused_elementwise).
DEVICE ?= cuda
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_WHEELS := xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 \
	pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 \
	google-re2==1.1.20251105 pytest-xdist==3.8.0 execnet==2.1.2 \
	datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

gpu-check:
	@if [ -d .whl ] && $(GPU_PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then \
		$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --upgrade --target .whl/site .whl/*.whl; fi
	PYTHONPATH=$(CURDIR)/.whl/site:$(CURDIR) DEVICE=$(DEVICE) $(GPU_PY) scripts/gpu_check.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q

# The other end of the supported range (batchvl/utils/versions.py): the oldest transformers, and the huggingface_hub
# it needs, installed into OLDEST_DIR and put first on the import path beside the environment's torch; there
# the parity tests (engine, families, video) and one `batchvl run`, whose rows must equal the newest's
# (scripts/test-oldest.sh).
OLDEST_DIR ?= .oldest
OLDEST := transformers==5.17.0 huggingface_hub==1.33.0
test-oldest: install
	bash scripts/test-oldest.sh $(PY) $(OLDEST_DIR) $(OLDEST)

# The oldest supported torch as well: an environment of its own (OLDEST_TORCH_VENV) with torch 2.6 and the
# oldest transformers, where the same checks run; the `batchvl run` rows must equal those of $(VENV), the
# newest torch and transformers. PyPI has only the CUDA build of torch 2.6 for Linux (it runs on a CPU): about
# 3 GB of wheels, 6 GB installed, 2-3 minutes to install on two cores.
OLDEST_TORCH_VENV ?= .oldest-torch
OLDEST_TORCH := torch==2.6.0
$(OLDEST_TORCH_VENV)/.installed: pyproject.toml
	python3 -m venv $(OLDEST_TORCH_VENV)
	$(OLDEST_TORCH_VENV)/bin/python -m pip install -q -e . pytest $(OLDEST_TORCH) $(OLDEST)
	touch $@

test-oldest-torch: install $(OLDEST_TORCH_VENV)/.installed
	NEWEST=$(PY) bash scripts/test-oldest.sh $(OLDEST_TORCH_VENV)/bin/python $(OLDEST_TORCH_VENV)/oldest $(OLDEST)

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf demo .pytest_cache .ruff_cache

# Set-up in two commands: `make demo` and `make test`. Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
# On a GPU machine, set TORCH_SPEC to the CUDA build you want (e.g. TORCH_SPEC=torch==2.13.0).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test lint format clean slurm browser vllm

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

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf demo .pytest_cache .ruff_cache

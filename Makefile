# The two commands of the README. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

# The versions `make run`, `make test` and the Dockerfile install are pinned: LOCK for the
# virtual environment (every Python from 3.10, markers where versions differ; CI runs 3.11),
# requirements/image-cuda1x.txt for the image. pyproject.toml keeps the ranges users get.
# PIP_CONSTRAINT, not -c: pip's isolated build environments (setuptools, to build gemmd)
# and the tests' own pip runs (tests/test_packaging.py) read it too. `make lock` moves the
# pins to the newest releases.
LOCK := requirements/test.txt
PIN := PIP_CONSTRAINT=$(CURDIR)/$(LOCK)

.PHONY: run test test-loaded lock setup image image-base

# `make run` needs gemmd only; `make test` also the test tools and the real CuPy,
# nvidia-ml-py and cuBLAS wheels the GPU contract tests run against (~0.7 GB).
$(VENV)/.run-deps: pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(PIN) $(BIN)/pip install -q --upgrade pip
	$(PIN) $(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-deps: pyproject.toml $(LOCK) $(VENV)/.run-deps
	$(PIN) $(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.test-deps

# Run the daemon on its defaults (backend auto: CPU when no GPU). State goes where the
# CLI looks by default ($XDG_STATE_HOME/gemmd, else ~/.local/state/gemmd), so that
# `.venv/bin/gemmd status` and the model commands find it.
# `make run PORT=9500` serves on another port (the config's listen.port otherwise).
PORT ?=
run: $(VENV)/.run-deps
	$(BIN)/gemmd run --config gemmd.yaml $(if $(PORT),--port $(PORT))

# Lint, then the whole test suite (unit, end-to-end, integration). install-test-deps.sh
# installs Prometheus and Alertmanager system-wide (apt, as root) when they are missing.
test: $(VENV)/.test-deps
	$(BIN)/ruff check gemmd tests bench
	$(BIN)/mypy
	bash scripts/install-test-deps.sh
	$(PIN) $(BIN)/python -m pytest -q

# `make test` while two CPU burners per core keep the machine busy (BURNERS=n per core):
# no test may depend on the machine's speed.
test-loaded: $(VENV)/.test-deps
	bash scripts/with-burners.sh $(MAKE) test

# Deliberately move the pins to the newest releases within pyproject.toml's ranges, then
# run the whole suite on them: review the diff of requirements/ and commit it.
# `make lock UPGRADE=` keeps every pin it can and only follows a change of pyproject.toml
# (a dependency added, removed or its range moved).
UPGRADE ?= 1
COMPILE = $(BIN)/uv pip compile --quiet $(if $(UPGRADE),--upgrade) --universal \
	--python-version 3.10 --custom-compile-command 'make lock' \
	pyproject.toml requirements/build.in
lock: $(VENV)/.run-deps
	$(BIN)/pip install -q --upgrade uv
	$(COMPILE) --extra test -o $(LOCK)
	$(COMPILE) --extra cuda12 -o requirements/image-cuda12.txt
	$(COMPILE) --extra cuda13 -o requirements/image-cuda13.txt
	$(MAKE) test

# The container image (Dockerfile): needs a Docker daemon and access to the python base image.
VERSION = $(shell $(PY) -c "import re; print(re.search(r'__version__ = \"(.+)\"', open('gemmd/__init__.py').read()).group(1))")
REVISION = $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
image:
	docker build --build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) -t gemmd:$(VERSION) .

# The base image's current digest, to move the Dockerfile's pin on purpose.
image-base:
	docker buildx imagetools inspect python:3.12-slim --format '{{json .Manifest.Digest}}'

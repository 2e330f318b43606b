# meshserve — the two README commands are `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 50051
QUESTION ?= What is the capital of France?

.PHONY: venv demo test test-fast lint protos serve clean

$(BIN)/meshserve: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,hf,bench]'
	touch $@

venv: $(BIN)/meshserve

# Start the server on the default model, stream a real answer, stop the server.
demo: venv
	$(BIN)/meshserve fetch
	@$(BIN)/meshserve serve --port $(PORT) --metrics-port 0 > $(VENV)/demo-server.log 2>&1 & pid=$$!; \
	  trap 'kill $$pid 2>/dev/null; wait $$pid 2>/dev/null' EXIT; \
	  { $(BIN)/meshserve health --address 127.0.0.1:$(PORT) --pid $$pid --wait 600 \
	    && $(BIN)/meshserve generate --address 127.0.0.1:$(PORT) --temperature 0 --max-tokens 128 "$(QUESTION)"; } \
	  || { echo "--- server log ---"; cat $(VENV)/demo-server.log; exit 1; }

test: venv
	$(BIN)/python -m pytest -q

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow"

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy model sharding service

# Regenerate the committed Python stubs from protos/meshserve/v1/*.proto.
protos: venv
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. protos/meshserve/v1/meshserve.proto protos/meshserve/v1/admin.proto

serve: venv
	$(BIN)/meshserve serve --port $(PORT)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache

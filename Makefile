# Two commands for a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU wheel of this pinned torch lies on the development machines' disk; a
# looser requirement with no torch installed would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: venv demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(BIN)/loom train

test: venv
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV) runs

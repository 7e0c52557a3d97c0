# `make demo`: set up and run the main job on the demo dataset. `make test`: set up and run the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= configs/demo.toml

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

demo: setup
	$(BIN)/python -m pipeline generate --config $(CONFIG)
	$(BIN)/python -m pipeline train --config $(CONFIG)

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python -m pipeline bench --out bench.json --plot bench.png

clean:
	rm -rf runs data/demo .pytest_cache

# rollwave — every target is documented in README.md.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PIP     := $(BIN)/pip -q --disable-pip-version-check
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt

.PHONY: install demo test test-fast lint proto bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: install
	$(BIN)/python -m services.demo

test: install
	$(BIN)/python -m pytest -x -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

proto: install
	$(BIN)/python -m proto.generate

bench: install
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo clean

install: $(STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Re-run the install when the pins or the package metadata change.
# pip byte-compiles what it installs: keep it so, as with PYTHONDONTWRITEBYTECODE set
# (as on the CI machines) every process would otherwise compile torch again at import.
$(STAMP): $(VENV)/bin/python setup.py constraints.txt
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0 -e ".[test,hf]"
	touch $(STAMP)

# Tests run in TEST_WORKERS pytest-xdist workers, a test file per worker at a time (module
# fixtures are built once); the session's training runs are shared (tests/conftest.py).
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

demo: install
	$(PY) -m metaseq.scripts.demo

clean:
	rm -rf $(VENV) demo_out

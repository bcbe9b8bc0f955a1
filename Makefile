PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo clean

install: $(STAMP)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Re-run the install when the pins or the package metadata change.
$(STAMP): $(VENV)/bin/python setup.py constraints.txt
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test,hf]"
	touch $(STAMP)

test: install
	$(PY) -m pytest -q tests

demo: install
	$(PY) -m metaseq.scripts.demo

clean:
	rm -rf $(VENV) demo_out

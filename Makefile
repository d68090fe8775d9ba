# Two entry points, each working on a fresh machine:
#   make demo   validate the DeepSeek model on our backend against transformers (tiny embedded config)
#   make test   the test suite (GPU-marked tests skip cleanly without CUDA sm90 + sgl_kernel)
PYTHON ?= python3
STAMP := .venv-stamp

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	# torch first, pinned to the CPU build available locally, so no multi-GB CUDA build is pulled.
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "torch==2.13.0"
	$(PYTHON) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m mla_fa3.cli validate

test: $(STAMP)
	$(PYTHON) -m pytest -q tests

clean:
	rm -f $(STAMP)

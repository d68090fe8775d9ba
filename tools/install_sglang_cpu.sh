#!/usr/bin/env bash
# Install SGLang 0.5.17 for the tests of our SGLang plugin, on a CPU-torch machine, into a folder of its own:
#   bash tools/install_sglang_cpu.sh [PYTHON] [TARGET]      (defaults: python3, .sglang-cpu in the checkout)
# sglang 0.5.17 pins torch 2.11 and a multi-GB CUDA closure (flashinfer, sglang-kernel, deep-gemm...).
# None of that is needed to import the modules our plugin uses (tools/check_sglang_cpu.py lists them),
# so sglang goes in with --no-deps, plus only what those imports load, each --no-deps too: then pip
# never touches torch (torchvision, triton, xgrammar, compressed-tensors would all pull a CUDA torch).
# Everything goes into TARGET, not into the environment: the only torchvision for a CPU torch 2.13 is a
# CUDA build that does not import without the tests' shim, and transformers imports torchvision whenever it
# is installed (installed in the environment, it broke `make demo`). The tests (tests/sglang_world.py) put
# TARGET on sys.path after the environment's own paths and apply tests/sglang_cpu_shim.py first.
# A requirement the environment already has, at any version, is not installed again (numpy, pydantic,
# transformers... stay the environment's); sglang itself must be 0.5.17.
set -euo pipefail
PY="${1:-python3}"
TARGET="${2:-$(cd "$(dirname "$0")/.." && pwd)/.sglang-cpu}"

# Exact versions that were verified together on torch 2.13.0+cpu / transformers 5.25.0 / Python 3.11.
REQS=(
    sglang==0.5.17
    # sglang-specific, imported by the modules we use
    torchvision==0.28.0          # torch 2.13's pair (a CUDA build: the shim lets it import)
    xgrammar==0.2.1              # sglang's pin
    apache-tvm-ffi==0.1.11       # sglang's pin (xgrammar's runtime)
    compressed-tensors==0.20.1
    gguf==0.19.0
    openai==3.63.0
    orjson==3.13.0
    msgspec==0.23.0
    pybase64==1.5.1
    psutil==7.2.2
    pyzmq==27.3.0
    dill==0.4.1
    einops==0.8.2
    loguru==0.7.3
    sentencepiece==0.2.3
    partial-json-parser==0.2.1.1.post7
    starlette==1.10.0
    ipython==9.19.1
    traitlets==5.16.1
    aiohttp==3.14.5
    aiohappyeyeballs==2.7.1
    aiosignal==1.4.0
    attrs==26.1.0
    frozenlist==1.8.0
    multidict==7.2.1
    propcache==0.5.4
    yarl==1.25.1
    requests==2.34.2
    urllib3==2.8.0
    certifi==2026.10.19.post1
    charset-normalizer==3.5.3
    sniffio==1.3.1
    # normally already there through the project's own dependencies (transformers, dev extra)
    triton==3.9.0
    numpy==2.4.6
    packaging==26.4
    pillow==13.0.0
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    anyio==4.16.0
    idna==3.21
    tqdm==4.70.1
    pygments==2.21.0
    PyYAML==6.0.4
)

# Prints the requirements still to install: absent distributions, or sglang at another version.
missing() {
    "$PY" - "$TARGET" "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

sys.path.append(sys.argv[1])  # the environment first, then TARGET: what the tests see
for req in sys.argv[2:]:
    name, want = req.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        print(req)
        continue
    if name == "sglang" and have != want:
        print(req)
EOF
}

# pip, its output shown only on failure, so that a success prints one line
pip_quiet() {
    local log
    log=$(mktemp)
    if ! "$PY" -m pip install -q "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        echo "install_sglang_cpu: pip install $* failed for $PY" >&2
        exit 1
    fi
    rm -f "$log"
}

torch_version() { "$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null; }

t0=$(date +%s)
"$PY" -c 'import sys' 2>/dev/null || { echo "install_sglang_cpu: $PY does not run" >&2; exit 1; }
mapfile -t TODO < <(missing "${REQS[@]}")
if [ "${#TODO[@]}" -eq 0 ] && "$PY" -c 'import importlib.metadata as m; m.version("transformers")' 2>/dev/null; then
    echo "install_sglang_cpu: sglang 0.5.17 and its CPU import set already in $TARGET for $PY; nothing done"
    exit 0
fi

TORCH_BEFORE=$(torch_version) || { echo "install_sglang_cpu: torch does not import for $PY: install torch first" >&2; exit 1; }

# transformers is the project's dependency; install it (it pulls no torch) only if it is absent.
if ! "$PY" -c 'import importlib.metadata as m; m.version("transformers")' 2>/dev/null; then
    pip_quiet "transformers==5.25.0"
fi

if [ "${#TODO[@]}" -gt 0 ]; then
    mkdir -p "$TARGET"
    pip_quiet --no-deps --target "$TARGET" "${TODO[@]}"
fi

TORCH_AFTER=$(torch_version)
if [ "$TORCH_AFTER" != "$TORCH_BEFORE" ]; then
    echo "install_sglang_cpu: torch changed from $TORCH_BEFORE to $TORCH_AFTER: this must not happen" >&2
    exit 1
fi
echo "install_sglang_cpu: installed ${#TODO[@]} packages (sglang 0.5.17 and its CPU import set, all --no-deps) into $TARGET for $PY in $(( $(date +%s) - t0 ))s; torch $TORCH_AFTER untouched"

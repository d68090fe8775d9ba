#!/usr/bin/env bash
# On the GPU machine, from the checkout root, after .kit1-3 (sgl-kernel) were set up in /tmp/site:
# installs the SGLang wheels carried in .whl (and .whl2), makes the plugin's entry point visible, then runs
#   $1 = tests | bench | engine | all  (results under $OUT)
set -uo pipefail
export PYTHONPATH=$PWD:/tmp/site
for d in .whl .whl2; do
  [ -d "$d" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $d/*.whl 2>&1 | grep -v "^WARNING" | tail -2
done
# the entry point SGLang's plugin loader looks up (an installed distribution's metadata; the code is on PYTHONPATH)
mkdir -p /tmp/site/mla_fa3_plugin-0.dist-info
printf 'Metadata-Version: 2.1\nName: mla-fa3-plugin\nVersion: 0\n' > /tmp/site/mla_fa3_plugin-0.dist-info/METADATA
printf '[sglang.srt.plugins]\nmla_fa3 = mla_fa3.integrations.sglang.plugin:register\n' > /tmp/site/mla_fa3_plugin-0.dist-info/entry_points.txt
# this image's transformers is newer than SGLang's pin: the shim (tests/sglang_cpu_shim.py) in every process
# and flashinfer, not carried (its closure is GBs), answered by a placeholder whose functions raise if called
rm -rf /tmp/site/flashinfer
printf 'try:\n    from tests.sglang_cpu_shim import prepare_sglang_import\n    prepare_sglang_import()\n    from tools.flashinfer_placeholder import install\n    install()\nexcept Exception:\n    pass\n' > /tmp/site/sitecustomize.py
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/card.txt
what=${1:-all}
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 420 python3 -m pytest -q --maxfail=8 -m gpu ${TEST_ARGS:-tests/test_sglang_gpu.py tests/test_backend_gpu.py tests/test_fp8_cache_gpu.py} > $OUT/gpu_tests.txt 2>&1
  tail -5 $OUT/gpu_tests.txt
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 400 python3 benchmarks/sglang_backends.py --out $OUT/sglang_backends.csv ${BENCH_ARGS:-} > $OUT/sglang_backends.txt 2>&1
  tail -60 $OUT/sglang_backends.txt
fi
if [ "$what" = engine ] || [ "$what" = all ]; then
  timeout 500 python3 benchmarks/sglang_engine_check.py --out $OUT/engine_check.json ${ENGINE_ARGS:-} > $OUT/engine_check.txt 2>&1
  tail -30 $OUT/engine_check.txt
fi

#!/usr/bin/env bash
# On the GPU machine, from the checkout root, with nothing carried (no sgl-kernel, no SGLang): our own Triton and
# Gluon kernels, which need only the image's torch and triton. Results under $OUT.
#   the Gluon decode kernel: its --check, its GPU tests (split-KV's warp-specialized switch included), its benchmark
#   over a bf16 and over an e4m3 cache
#   the tree part's Triton kernel: its GPU test (TREE_BENCH=1: benchmarks/tree_attention.py too; whole tree steps need
#   the kit: the backend resolves FA3 for every step)
# conftest skips every gpu test without sgl_kernel, so pytest runs with --noconftest here (the tests named need none).
# KIT=1: sgl-kernel is set up in /tmp/site (`tools/device_pack.sh kit`'s .upk1 .upk2 .upk3 uploaded, then
# `bash tools/device_kit_setup.sh` in the same call as this):
# conftest on, the whole tree steps and the tree graph runner too (they resolve FA3), FA3 / FlashMLA in the benchmark.
set -uo pipefail
if [ "${KIT:-0}" = 1 ]; then
  export PYTHONPATH=$PWD:/tmp/site
  tests="tests/test_gluon_decode_gpu.py tests/test_tree_attention_triton.py tests/test_tree_steps_gpu.py tests/test_tree_graph_runner_gpu.py"
  conftest=""
else
  export PYTHONPATH=$PWD
  tests="tests/test_gluon_decode_gpu.py tests/test_tree_attention_triton.py"
  conftest="--noconftest"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/card.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/card.txt
timeout 150 python3 benchmarks/gluon_decode_spike.py --fp8 --check > $OUT/gluon_check.txt 2>&1  # bf16 and e4m3
echo "gluon --check rc=$?"; tail -12 $OUT/gluon_check.txt | cut -c1-300
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q $conftest -m gpu -p no:cacheprovider --durations=8 ${TESTS:-$tests} \
  > $OUT/gpu_tests.txt 2>&1
grep -E "passed|failed|error" $OUT/gpu_tests.txt | tail -6; grep -E "^FAILED|^ERROR" $OUT/gpu_tests.txt | head -20 | cut -c1-300
# BENCH=1: both benchmarks below; BENCH=fp8: the e4m3 one alone; BENCH=0: none
if [ "${BENCH:-1}" = 1 ]; then
  # TREE_ARGS="--out-splits 1,2,4,8": the tree kernel's output split beside the single group
  [ "${TREE_BENCH:-0}" = 1 ] && timeout 120 python3 benchmarks/tree_attention.py --out $OUT/tree_attention.txt \
    ${TREE_ARGS:-} 2>&1 | tail -16
  # bf16: waves x (fp32 | bf16 partials), the combine a programmatic dependent (SPIKE_ARGS to narrow the shapes)
  timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/gluon_decode_spike.py --half --waves 0.5,1.0,2.0 ${SPIKE_ARGS:-} \
    --out $OUT/gluon_spike.csv > $OUT/gluon_bench.txt 2>&1
  tail -16 $OUT/gluon_bench.txt | cut -c1-400
fi
if [ "${BENCH:-1}" = 1 ] || [ "${BENCH:-1}" = fp8 ]; then
  timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/gluon_decode_spike.py --fp8 --half --waves 1.0,2.0 \
    ${SPIKE_ARGS_FP8:---batch 1,4,16,64 --context 16384,65536} --out $OUT/gluon_spike_fp8.csv > $OUT/gluon_bench_fp8.txt 2>&1
  tail -14 $OUT/gluon_bench_fp8.txt | cut -c1-400
fi

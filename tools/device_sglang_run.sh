#!/usr/bin/env bash
# On the GPU machine, from the checkout root, after the pieces of tools/device_pack.sh were copied to /tmp/up:
# assembles sgl-kernel and SGLang 0.5.17's wheels into /tmp/site, makes the plugin's entry point visible, then runs
#   $@ = one or more of tests bench replay engine onebatch tree gap ab, or all  (results under $OUT; ab is not in all)
# MLA_FA3_FLASHINFER=real puts the carried flashinfer 0.6.15.post1 on the path (JIT-built on first call);
# otherwise flashinfer is answered by a placeholder (tools/import_placeholders.py: its names raise if called);
# deep_gemm (never carried; SGLang's EAGLE draft worker imports it through the DSA backend) always is.
set -uo pipefail
export PYTHONPATH=$PWD:/tmp/site
if [ ! -f /tmp/payload/done ]; then
  n=$(ls /tmp/up/p* 2>/dev/null | wc -l)
  echo "assembling $n pieces"
  mkdir -p /tmp/payload && cat /tmp/up/p* | tar -x -C /tmp/payload || { echo "pieces missing: upload .up1 .. again" >&2; exit 3; }
  if [ -d /tmp/payload/kit ]; then  # the .up pieces carry the kit; the .upw pieces (wheels alone) do not
    mkdir -p /tmp/kit && cp /tmp/payload/kit/* /tmp/kit/ && mkdir -p .kit3 && cp /tmp/payload/kit/setup.sh /tmp/payload/kit/fo.part2 /tmp/payload/kit/sgl_rest.tar.xz .kit3/
  fi
  [ -d /tmp/site/sgl_kernel ] || bash .kit3/setup.sh || exit 3  # the kit may be set up already (device_kit_setup.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/payload/whl/*.whl 2>&1 | grep -v "^WARNING" | tail -2
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fi /tmp/payload/fi/*.whl 2>&1 | grep -v "^WARNING" | tail -2
  touch /tmp/payload/done
fi
# sgl-kernel's distribution metadata: the kit puts the package on the path without it, and SGLang's Engine asks
# importlib.metadata for sglang-kernel >= 0.4.5 before it starts
for n in sglang_kernel sgl_kernel; do
  d=/tmp/site/${n}-0.4.5.dist-info; mkdir -p $d; printf "Metadata-Version: 2.1\nName: ${n/_/-}\nVersion: 0.4.5\n" > $d/METADATA
done
# the entry point SGLang's plugin loader looks up (an installed distribution's metadata; the code is on PYTHONPATH)
mkdir -p /tmp/site/mla_fa3_plugin-0.dist-info
printf 'Metadata-Version: 2.1\nName: mla-fa3-plugin\nVersion: 0\n' > /tmp/site/mla_fa3_plugin-0.dist-info/METADATA
printf '[sglang.srt.plugins]\nmla_fa3 = mla_fa3.integrations.sglang.plugin:register\n' > /tmp/site/mla_fa3_plugin-0.dist-info/entry_points.txt
# with deep_gemm a placeholder, SGLang must not take it for the real one: no JIT DeepGEMM, no deep_gemm.set_pdl at
# ModelRunner start (seen 2026-12-07, fifth run: the placeholder's set_pdl stopped every Engine / bench_one_batch)
export SGLANG_ENABLE_JIT_DEEPGEMM=0 SGLANG_DEEPGEMM_PDL=0
# this image's transformers is newer than SGLang's pin: the shim (tests/sglang_cpu_shim.py) in every process;
# flashinfer: the carried one (MLA_FA3_FLASHINFER=real) or the placeholder
if [ "${MLA_FA3_FLASHINFER:-placeholder}" = real ]; then export PYTHONPATH=$PYTHONPATH:/tmp/fi; fi
printf 'import os\ntry:\n    from tests.sglang_cpu_shim import prepare_sglang_import\n    prepare_sglang_import()\n    from tools.import_placeholders import install\n    real = os.environ.get("MLA_FA3_FLASHINFER", "placeholder") == "real"\n    install(("deep_gemm",) if real else ("deep_gemm", "flashinfer"))\nexcept Exception:\n    pass\n' > /tmp/site/sitecustomize.py
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/card.txt
modes=" ${*:-all} "  # one or more of the modes, in this order
want() { [[ "$modes" == *" $1 "* || "$modes" == *" all "* ]]; }
if want tests; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q --maxfail=8 -m gpu ${TEST_ARGS:-tests/test_sglang_gpu.py tests/test_backend_gpu.py tests/test_fp8_cache_gpu.py} > $OUT/gpu_tests.txt 2>&1
  tail -5 $OUT/gpu_tests.txt
fi
# the Engine captures SGLang's DeepSeek model in CUDA graphs, whose RMSNorm is flashinfer's: the carried flashinfer
# (seen 2026-12-07: the placeholder stops the capture), JIT-built on first use
engine_env="MLA_FA3_FLASHINFER=real PYTHONPATH=$PYTHONPATH:/tmp/fi"
# (also for the bench: SGLang's flashmla backend needs flashinfer to construct)
if want bench; then
  env $engine_env timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/sglang_backends.py --out $OUT/sglang_backends.csv ${BENCH_ARGS:-} \
    > $OUT/sglang_backends.txt 2>&1
  tail -60 $OUT/sglang_backends.txt
fi
if want replay; then  # the host update before each replay of a decode (and chain verify) graph, per backend
  env $engine_env timeout ${REPLAY_TIMEOUT:-200} python3 benchmarks/sglang_replay_host.py --device cuda \
    --out $OUT/replay_host.csv ${REPLAY_ARGS:---verify 2} > $OUT/replay_host.txt 2>&1
  grep -v Warning $OUT/replay_host.txt | tail -30 | cut -c1-300
fi
if want engine; then
  env $engine_env timeout ${ENGINE_TIMEOUT:-300} python3 benchmarks/sglang_engine_check.py --out $OUT/engine_check.json \
    ${ENGINE_ARGS:-} > $OUT/engine_check.txt 2>&1
  grep '^{' $OUT/engine_check.txt | cut -c1-400
  grep -q greedy_match $OUT/engine_check.txt || tail -30 $OUT/engine_check.txt | cut -c1-300
fi
if want onebatch; then
  env $engine_env timeout ${ONEBATCH_TIMEOUT:-540} python3 benchmarks/sglang_one_batch.py --out $OUT/one_batch.csv \
    ${ONEBATCH_ARGS:-} > $OUT/one_batch.txt 2>&1
  tail -40 $OUT/one_batch.txt | cut -c1-300
fi
if want tree; then
  timeout ${TREE_TIMEOUT:-300} python3 benchmarks/sglang_tree_verify.py --out $OUT/tree_verify.csv ${TREE_ARGS:-} > $OUT/tree_verify.txt 2>&1
  grep -v Warning $OUT/tree_verify.txt | tail -60 | cut -c1-300
fi
if [[ "$modes" == *" ab "* ]]; then  # the package at .base (tools/device_pack.sh base REV) against the working tree:
  # sglang_backends.py with AB_ARGS in each, alternating, AB_ROUNDS rounds; each tree runs from its own directory (the
  # bench puts its own checkout first on sys.path, so PYTHONPATH cannot select the package)
  [ -d .base/mla_fa3 ] || { echo "ab: .base/mla_fa3 missing (tools/device_pack.sh base REV, carry .base)" >&2; exit 3; }
  # the base's own benchmarks when packed with it (device_pack.sh base), else this tree's
  rm -rf /tmp/ab_base && mkdir -p /tmp/ab_base && cp -r benchmarks tests tools /tmp/ab_base/ && cp -r .base/mla_fa3 /tmp/ab_base/
  [ -d .base/benchmarks ] && rm -rf /tmp/ab_base/benchmarks && cp -r .base/benchmarks /tmp/ab_base/
  for i in $(seq 1 ${AB_ROUNDS:-2}); do
    for v in base new; do
      d=$PWD; [ $v = base ] && d=/tmp/ab_base
      (cd $d && env $engine_env PYTHONPATH=$d:/tmp/site:/tmp/fi timeout ${AB_TIMEOUT:-200} python3 benchmarks/sglang_backends.py \
        --out $OUT/ab_${v}_$i.csv ${AB_ARGS:---kv bf16 --shapes 16:4:32768,16:4:65536,16:1:65536} > $OUT/ab_${v}_$i.txt 2>&1)
      echo "== $v round $i ($d, base $(cat .base/REV 2>/dev/null))"
      cut -d, -f1-5,13,14 $OUT/ab_${v}_$i.csv 2>/dev/null | grep -E "mla_fa3|fa3," || tail -5 $OUT/ab_${v}_$i.txt
    done
  done
fi
if want gap; then
  timeout ${GAP_TIMEOUT:-200} python3 benchmarks/sglang_fa3_gap.py ${GAP_ARGS:-} > $OUT/fa3_gap.txt 2>&1
  grep -v Warning $OUT/fa3_gap.txt | tail -30 | cut -c1-300
fi

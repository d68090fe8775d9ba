#!/usr/bin/env bash
# Packs what the GPU machine needs for the SGLang runs into carry pieces .up1 .. .upN (git-ignored), each at most
# 2 x 29 MB so that one run may take it along beside the working tree (64 MiB in all):
#   kit/   sgl-kernel 0.4.5 as shared/device/prepare-kit packs it (.kit1 .kit2 .kit3; run that first)
#   whl/   SGLang 0.5.17's wheels for Python 3.12 (this script downloads them, --no-deps: the import set
#          of the offline Engine, bench_one_batch and the attention test kit; torch, triton, numpy,
#          transformers are on the machine already)
#   fi/    flashinfer 0.6.15.post1 (SGLang's pin; pure Python, JIT) and the two small packages its import
#          needs; tools/device_sglang_run.sh uses it only with MLA_FA3_FLASHINFER=real
# Upload = one run per piece, back to back (the machine forgets /tmp when it goes cold ~30 s after a run):
#   take .upK along, command: mkdir -p /tmp/up && cp .upK/* /tmp/up/
# then, with the last piece: bash tools/device_sglang_run.sh all   (it assembles /tmp/up first)
# `device_pack.sh wheels`: the wheels alone (whl/, fi/) as .upw1 .upw2, for a machine whose sgl-kernel was set up
# from the kit pieces below (tools/device_kernels_run.sh KIT=1 may run there first): upload each the same way, then
# bash tools/device_sglang_run.sh ... (it skips the kit when /tmp/site/sgl_kernel exists)
# `device_pack.sh kit`: sgl-kernel alone, re-cut into .upk1 .upk2 .upk3 (at most 58 MB each, so that each fits beside
# the working tree); upload each as above, then bash tools/device_kit_setup.sh
# `device_pack.sh base REV`: the package and the benchmarks as they were at REV, in .base/mla_fa3 and .base/benchmarks
# (~2 MB), for an A/B of REV against the working tree inside one run: take .base along, then
# `AB_ARGS=... bash tools/device_sglang_run.sh ab` (each tree times itself with its own benchmarks)
set -euo pipefail
repo=$(git rev-parse --show-toplevel)
if [ "${1:-}" = base ]; then
  rev=${2:?usage: device_pack.sh base REV}
  rm -rf "$repo/.base" && mkdir -p "$repo/.base"
  git -C "$repo" archive "$rev" mla_fa3 benchmarks | tar -x -C "$repo/.base"
  git -C "$repo" rev-parse "$rev" > "$repo/.base/REV"
  ex="$(git -C "$repo" rev-parse --git-dir)/info/exclude"
  grep -qx '/.base/' "$ex" 2>/dev/null || echo '/.base/' >> "$ex"
  echo ".base/mla_fa3 and .base/benchmarks at $(cat "$repo/.base/REV"): take them along as carry .base"
  exit 0
fi
if [ "${1:-}" = kit ]; then
  for i in 1 2 3; do [ -d "$repo/.kit$i" ] || { echo "run ../shared/device/prepare-kit first (.kit$i missing)" >&2; exit 1; }; done
  rm -rf "$repo"/.upk[0-9]*
  mkdir -p "$repo/.upk1" "$repo/.upk2" "$repo/.upk3"
  cat "$repo/.kit1/fo.part0" "$repo/.kit2/fo.part1" "$repo/.kit3/fo.part2" | split -b 58000000 -d -a 2 - "$repo/.upk1/k."
  mv "$repo/.upk1/k.01" "$repo/.upk2/"
  mv "$repo/.upk1/k.02" "$repo/.upk3/"
  [ ! -e "$repo/.upk1/k.03" ] || { echo "the FA3 library grew past 3 pieces: adjust device_pack.sh kit" >&2; exit 1; }
  cp "$repo/.kit3/sgl_rest.tar.xz" "$repo/.upk3/"
  du -sb "$repo"/.upk[0-9]
  exit 0
fi
cache="${HOME}/.cache/mla-kit/sglang-0.5.17"
mkdir -p "$cache/whl" "$cache/fi"
for i in 1 2 3; do [ -d "$repo/.kit$i" ] || { echo "run ../shared/device/prepare-kit first (.kit$i missing)" >&2; exit 1; }; done
dl() {  # cp312 manylinux wheels, no dependencies resolved here: the list below is the closure we need
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      $(for v in 34 28 27 26 24 17 12 5; do printf -- "--platform manylinux_2_%s_x86_64 " $v; done) --platform any -d "$@"
}
if [ ! -f "$cache/done" ]; then
  # the versions seen to import together on the machine (the offline Engine's and the test kit's import set)
  dl "$cache/whl" sglang==0.5.17 torchvision==0.26.0 xgrammar==0.2.1 apache-tvm-ffi==0.1.11 \
     aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-types==0.8.0 anyio==4.16.0 \
     attrs==26.1.0 backports.tarfile==1.2.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 click==8.5.1 \
     compressed-tensors==0.20.1 dill==0.4.1 distro==1.9.0 einops==0.8.2 fastapi==0.165.0 frozenlist==1.8.0 \
     gguf==0.19.0 h11==0.16.0 httpcore2==2.17.0 httpx2==2.17.0 idna==3.21 importlib-metadata==10.2.0 \
     ipython==9.19.1 jaraco-context==6.1.2 jaraco-functools==4.6.0 jaraco-text==4.3.0 jiter==0.19.0 \
     kernels==0.19.1 loguru==0.7.3 more-itertools==11.2.1 msgspec==0.23.0 multidict==7.2.1 openai==3.63.0 \
     opentelemetry-api==1.45.3 orjson==3.13.0 packaging==26.4 partial-json-parser==0.2.1.1.post7 \
     propcache==0.5.4 psutil==7.2.2 pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5 pyyaml==6.0.4 \
     pyzmq==27.3.0 requests==2.34.2 sentencepiece==0.2.3 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0 \
     traitlets==5.16.1 truststore==0.10.5 typing-inspection==0.4.5 urllib3==2.8.0 uvicorn==0.55.0 \
     uvloop==0.23.0 yarl==1.25.1 zipp==4.1.2 interegular python-multipart prometheus-client
  dl "$cache/fi" flashinfer-python==0.6.15.post1 nvidia-ml-py tabulate
  touch "$cache/done"
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/kit" "$stage/whl" "$stage/fi"
cp "$cache"/whl/*.whl "$stage/whl/"
cp "$cache"/fi/*.whl "$stage/fi/"
if [ "${1:-}" = wheels ]; then
  prefix=.upw; parts="whl fi"
else
  prefix=.up; parts="kit whl fi"
  cp "$repo"/.kit1/* "$repo"/.kit2/* "$repo"/.kit3/* "$stage/kit/"
fi
rm -rf "$repo/$prefix"[0-9]*
tar -C "$stage" -cf - $parts | split -b 29000000 -d -a 2 - "$stage/p"
n=0
for f in "$stage"/p*; do
  k=$(( n / 2 + 1 )); mkdir -p "$repo/$prefix$k"; mv "$f" "$repo/$prefix$k/"; n=$(( n + 1 ))
done
ex="$(git -C "$repo" rev-parse --git-dir)/info/exclude"
grep -qx '/.up*/' "$ex" 2>/dev/null || echo '/.up*/' >> "$ex"
echo "$n chunks in ${prefix}1 .. $prefix$(( (n + 1) / 2 )); upload each with: mkdir -p /tmp/up && cp ${prefix}K/* /tmp/up/"

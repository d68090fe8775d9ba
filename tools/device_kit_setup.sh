#!/usr/bin/env bash
# On the GPU machine, from the checkout root, after the pieces of `tools/device_pack.sh kit` (.upk1 .upk2 .upk3) were
# copied to /tmp/up (one run each: mkdir -p /tmp/up && cp .upkK/* /tmp/up/): sgl-kernel 0.4.5 into /tmp/site, as
# shared/device/prepare-kit's own setup.sh does (its FA3 library xz-compressed in pieces, the rest as a tarball),
# from pieces of at most 58 MB so that each upload fits beside the working tree. Then PYTHONPATH=$PWD:/tmp/site.
set -euo pipefail
if [ -f /tmp/site/sgl_kernel/flash_ops.abi3.so ]; then echo "sgl_kernel ready in /tmp/site"; exit 0; fi
n=$(ls /tmp/up/k.* 2>/dev/null | wc -l)
[ "$n" -ge 3 ] && [ -f /tmp/up/sgl_rest.tar.xz ] || { echo "kit pieces missing ($n): upload .upk1 .upk2 .upk3 again" >&2; exit 3; }
mkdir -p /tmp/site
tar -xJf /tmp/up/sgl_rest.tar.xz -C /tmp/site
cat /tmp/up/k.* | xz -d -T0 > /tmp/site/sgl_kernel/flash_ops.abi3.so
echo "sgl_kernel ready in /tmp/site"

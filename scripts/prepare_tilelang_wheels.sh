#!/usr/bin/env bash
# Prepare TileLang for the GPU machine (no registry there): download the cp312 manylinux x86_64
# wheels of tilelang and the Requires-Dist its image lacks, install them into one folder for
# Python 3.12 and pack that folder as .tl/site.tar.xz (~37 MiB) (ignored by .gitignore) to `carry`.
#
# On the GPU machine:   mkdir -p /tmp/site && tar xJf .tl/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site
#
# The image already has torch 2.11 (cu130), numpy, ml-dtypes, cloudpickle, psutil, tqdm,
# typing-extensions (see the device KINDS.md package list); tilelang 0.1.15 is known to work beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUTDIR=.tl
# every package pinned (the versions in the archive that BENCHMARKS runs 84-88 used), so a re-run builds the same folder
PKGS=("tilelang==0.1.15" "apache-tvm-ffi==0.1.12" "torch-c-dlpack-ext==0.1.5" "z3-solver==4.15.4.0" "optree==0.20.0")
PLAT=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do PLAT+=(--platform "$p"); done
mkdir -p "$OUTDIR"
WHL=$(mktemp -d); SITE=$(mktemp -d)          # fresh each run: only this run's wheels are installed
trap 'rm -rf "$WHL" "$SITE"' EXIT
for pkg in "${PKGS[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
     "${PLAT[@]}" -d "$WHL" "$pkg"
done
ls -la "$WHL"
"$PY" -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
   --implementation cp "${PLAT[@]}" --target "$SITE" "$WHL"/*.whl
# Keep the archive well under the 64 MiB a device call may carry: z3 ships its library twice (no
# symlinks in wheels), and the C++ sources of TVM and CUTLASS's tools are not needed to JIT kernels.
rm -rf "$SITE"/bin "$SITE"/tilelang/3rdparty/cutlass/tools "$SITE"/tilelang/3rdparty/tvm/src
if [ -f "$SITE"/z3/lib/libz3.so.4.15 ]; then rm "$SITE"/z3/lib/libz3.so.4.15; ln -s libz3.so "$SITE"/z3/lib/libz3.so.4.15; fi
XZ_OPT="-6 -T0" tar cJf "$OUTDIR/site.tar.xz.tmp" -C "$SITE" . && mv "$OUTDIR/site.tar.xz.tmp" "$OUTDIR/site.tar.xz"
ls -la "$OUTDIR"

# Source on the GPU machine (from the repository root) before the GPU tests or the kernel bench:
#   source scripts/gpu_env.sh && python3 -m pytest -q tests/test_gpu_*.py && python3 -m functional_dsv41.kernels.bench
# Unpacks .tl/site.tar.xz (made by scripts/prepare_tilelang_wheels.sh, carried to the machine) and, when present,
# .tl/tlcache.tar.xz (TileLang's kernel cache, built here by scripts/pack_tl_cache.sh for sm_90a: kernels found in
# it are not compiled again there), and points Python at the repository without installing it.
# It reports a failure (a missing or broken archive) on stderr and returns 1, and leaves the caller's shell options
# as they were (no set -e / set +e here).
_root=$PWD
_gpu_env() {
  if [ ! -f .tl/site.tar.xz ]; then
    echo "gpu_env.sh: $_root/.tl/site.tar.xz is missing (make it with scripts/prepare_tilelang_wheels.sh and carry it)" >&2
    return 1
  fi
  mkdir -p /tmp/site /tmp/pkg/functional_dsv41 || return 1
  if [ ! -f /tmp/site/.done ]; then
    tar xJf .tl/site.tar.xz -C /tmp/site || { echo "gpu_env.sh: unpacking .tl/site.tar.xz failed" >&2; return 1; }
    touch /tmp/site/.done
  fi
  for f in "$_root"/functional_dsv41/*; do ln -sfn "$f" /tmp/pkg/functional_dsv41/ || return 1; done
  for d in kernels params train; do ln -sfn "$_root/$d" /tmp/pkg/functional_dsv41/$d || return 1; done
  export PYTHONPATH=/tmp/site:/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}
  if [ -f .tl/tlcache.tar.xz ]; then
    mkdir -p /tmp/tlcache && tar xJf .tl/tlcache.tar.xz -C /tmp/tlcache ||
      { echo "gpu_env.sh: unpacking .tl/tlcache.tar.xz failed" >&2; return 1; }
    export TILELANG_CACHE_DIR=/tmp/tlcache
    export DSV41_TL_TARGET='{"kind":"cuda","arch":"sm_90a"}'   # the key the cache was built under
  fi
  # the golden fixtures (packed by scripts/pack_tl_cache.sh; ../shared does not travel)
  if [ -f .tl/fixtures.tar.xz ]; then
    mkdir -p /tmp/fixtures && tar xJf .tl/fixtures.tar.xz -C /tmp/fixtures ||
      { echo "gpu_env.sh: unpacking .tl/fixtures.tar.xz failed" >&2; return 1; }
    export DSV41_FIXTURES=/tmp/fixtures
  elif [ -d .tl/fixtures ]; then export DSV41_FIXTURES=$_root/.tl/fixtures; fi
}
_gpu_env

# Compile TileLang kernels for the H200 on a machine WITHOUT a GPU (kernels cannot run here, but nvcc/ptxas
# check them and TileLang's cache keeps the binaries, which scripts/pack_tl_cache.sh ships to the GPU machine).
#   source scripts/local_tilelang_env.sh      # first time: installs into .tl/local (~300 MiB), then exports
#   .venv/bin/python -c "from kernels.tilelang import sparse_attn_tl as s; print(s.fwd_kernel(64, 512, 640, 0.04))"
# tilelang (+ its Requires-Dist missing from our venv) for this Python into .tl/local/site, and NVIDIA's nvcc 13.0
# wheels into .tl/local/cuda; DSV41_TL_TARGET pins the target, since there is no GPU to detect.
_py=${PYTHON:-.venv/bin/python}
_tl=$PWD/.tl/local
if [ ! -f "$_tl/.done" ]; then
  mkdir -p "$_tl"
  "$_py" -m pip install -q --target "$_tl/site" tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext \
      z3-solver==4.15.4.0 ml-dtypes cloudpickle psutil tqdm --no-deps &&
  "$_py" -m pip install -q --target "$_tl/cuda" --no-deps nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 \
      nvidia-cuda-cccl==13.0.85 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 &&
  touch "$_tl/.done"
fi
export PYTHONPATH=$_tl/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export CUDA_HOME=$_tl/cuda/nvidia/cu13
export PATH=$CUDA_HOME/bin:$PATH
export DSV41_TL_TARGET='{"kind":"cuda","arch":"sm_90a"}'

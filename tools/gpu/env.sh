# Source on the GPU machine after staging every part (tools/gpu/stage.sh): the bundle first on the path
# (its transformers 5.8.1 shadows the image's 5.17, which SGLang 0.5.14 cannot import), then this
# checkout. NVLink multicast stays off (the workplace's rule for shared hosts).
prefix="${RLSLURM_GPU_PREFIX:-/tmp/rlslurm-gpu}"
export PYTHONPATH="$prefix/site:$prefix/stubs:$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$prefix/site/bin:$PATH"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

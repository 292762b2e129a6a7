# Sourced by the field checks (field-check.sh, field-colocate.sh): rlslurm as a user installs it, a plain
# `pip install` of its wheel and the CLI's dependencies from .field/ into $work/site (not this checkout),
# on the paths with the staged bundle only. The image's python3 is a venv itself, and a venv made from it
# would not see its packages (docs/gpu.md, "The image as a user meets it"), hence --target.
# Needs $field, $prefix, $work and a log function; exits the caller when the install fails.
export PYTHONPATH="$prefix/site:$prefix/stubs${PYTHONPATH:+:$PYTHONPATH}"  # the image keeps its packages on it
python3 -m pip install -q --no-index --no-deps --target "$work/site" "$field"/rlslurm-*.whl "$field"/deps/*.whl \
  || { log "wheel install failed"; exit 1; }
export PYTHONPATH="$work/site:$PYTHONPATH" PATH="$work/site/bin:$prefix/site/bin:$PATH"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# Source at the start of a command on a GPU machine with no network:
#   source scripts/device_env.sh
# Installs the carried wheels (.whl/, see docs/gpu-machines.md) into /tmp/site and the
# package itself in editable mode, without touching the machine's own torch.
if [ -n "${PRIMUS_DEVICE_ENV:-}" ]; then return 0 2>/dev/null || exit 0; fi  # installed by the caller
set -e
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
export PYTHONUNBUFFERED=1
# multi-GPU machines: NVLink multicast stays off
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PRIMUS_DEVICE_ENV=1
set +e

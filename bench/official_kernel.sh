#!/usr/bin/env bash
# Copy the official implementation's Triton embedding bag (facebookresearch/memory,
# lingua/product_key/xformer_embeddingbag.py; licensed CC BY-NC 4.0, not ours)
# into .official/ (ignored by git), for bench/gpu_speed.py's side-by-side run.
# Never commit it: a device run gets it through the device tool's `carry`.
#
#   bash bench/official_kernel.sh <git dir of facebookresearch/memory> [dest, default .official]
#   python bench/gpu_speed.py kernels --official .official
#
# <git dir>: a clone, or the bare git directory that a `fetch` of
# github:facebookresearch/memory gives (read with git --git-dir).
set -euo pipefail
SRC="${1:?usage: bash bench/official_kernel.sh <git dir of facebookresearch/memory> [dest]}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEST="${2:-.official}"
if [ -d "$SRC/.git" ]; then
    SRC="$SRC/.git"
fi
mkdir -p "$DEST"
git --git-dir="$SRC" show HEAD:lingua/product_key/xformer_embeddingbag.py >"$DEST/xformer_embeddingbag.py"
git --git-dir="$SRC" show HEAD:LICENSE >"$DEST/LICENSE"
git --git-dir="$SRC" rev-parse HEAD >"$DEST/COMMIT"
echo "copied lingua/product_key/xformer_embeddingbag.py at $(cat "$DEST/COMMIT") to $DEST/ (not ours: keep it out of git)"

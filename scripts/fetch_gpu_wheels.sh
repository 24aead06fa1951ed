#!/usr/bin/env bash
# Fill DIR, on a connected machine, with what `make setup STACK=gpu WHEELS=DIR` installs offline on a
# CUDA box (air-gapped clusters): the binary wheels pinned in requirements-gpu.txt for the target's
# Python and platform, and DeepSpeed's source distribution (built there against the box's torch).
#   scripts/fetch_gpu_wheels.sh DIR [PYTHON_VERSION=3.12]
# The pins are for torch 2.11.0+cu130 (vLLM 0.26.0 is built against exactly that torch); the target
# must already have that torch. Copy DIR over (about 500 MB), then run the make command there.
set -euo pipefail
dest=${1:?usage: scripts/fetch_gpu_wheels.sh DIR [PYTHON_VERSION]}
py=${2:-3.12}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$dest"
reqs=$(mktemp); trap 'rm -f "$reqs"' EXIT
grep -v -e '^#' -e '^deepspeed==' -e '^$' "$root/requirements-gpu.txt" > "$reqs"
plat=()
for tag in manylinux_2_{5,12,17,24,26,27,28,31,34}_x86_64 manylinux1_x86_64 manylinux2010_x86_64 manylinux2014_x86_64; do
  plat+=(--platform "$tag")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  "${plat[@]}" -d "$dest" -r "$reqs"
python3 -m pip download -q --no-deps --no-binary=:all: -d "$dest" \
  "$(grep '^deepspeed==' "$root/requirements-gpu.txt")"
(cd "$dest" && sha256sum -- *.whl *.tar.gz > SHA256SUMS)
echo "$(ls "$dest" | wc -l) files, $(du -sh "$dest" | cut -f1) in $dest; on the GPU machine: make setup STACK=gpu WHEELS=$dest"

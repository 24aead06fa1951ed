#!/usr/bin/env bash
# The GPU stack as a small archive, for an offline Hopper (H100/H200) box reached through small
# transfers: ~107 MiB of xz in two parts, where scripts/fetch_gpu_wheels.sh's wheels are ~500 MB.
# It holds requirements-gpu.txt's wheels less what a CUDA PyTorch image already has or an H100 with a
# dense model never loads. From vLLM's wheel it drops FlashAttention 2 (Hopper runs FlashAttention
# 3), the FlashMLA kernels and the Rust frontend; its fused-MoE kernels (a mixture of experts' routing
# and sums, 39 MiB of xz) go to moe.tar.xz beside the parts, for the lease's third call, whose
# carry has room (the two parts' calls each carry ~63 of the device tool's 64 MiB with the working
# tree). It does not hold flashinfer (set VLLM_USE_FLASHINFER_SAMPLER=0) or DeepSpeed, whose source
# distribution lies beside the parts.
#   scripts/gpu_bundle.sh DIR [PART_MB=55]     # on a connected machine
# On the GPU machine, once DIR and all its parts are there (checks the archive, unpacks it into SITE,
# builds DeepSpeed into it):
#   bash DIR/install.sh SITE && export PYTHONPATH=SITE VLLM_USE_FLASHINFER_SAMPLER=0
#   tar xJf DIR/moe.tar.xz -C SITE          # for a mixture-of-experts model
# `python -m bench.gpu_check` then runs as `make gpu-check` does (2026-11-26, H100: stack, planner,
# e2e and oop ran from it).
set -euo pipefail
dest=${1:?usage: scripts/gpu_bundle.sh DIR [PART_MB]}
part_mb=${2:-55}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$dest" "$work/whl" "$work/site" "$work/moe"
dest=$(cd "$dest" && pwd)
# in a CUDA PyTorch image already, or never loaded for a dense model's text generation on Hopper
leave='^(flashinfer-python|humming-kernels|quack-kernels|nvidia-cutlass-dsl.*|nvidia-cuda-.*|nvidia-nvvm|nvidia-ml-py|cuda-core|cuda-python|cuda-tile|torchaudio|torchvision|torchcodec|opencv-python-headless|grpcio|ninja|six|tabulate|py-cpuinfo|ml-dtypes|deepspeed)=='
grep -v -e '^#' -e '^$' "$root/requirements-gpu.txt" | grep -v -E "$leave" > "$work/reqs.txt"
plat=()
for tag in manylinux_2_{5,12,17,24,26,27,28,31,34}_x86_64 manylinux1_x86_64 manylinux2010_x86_64 manylinux2014_x86_64; do
  plat+=(--platform "$tag")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d "$work/whl" -r "$work/reqs.txt"
python3 -m pip download -q --no-deps --no-binary=:all: -d "$dest" "$(grep '^deepspeed==' "$root/requirements-gpu.txt")"
python3 - "$work/whl" "$work/site" <<'EOF'
import os, sys, zipfile
from pathlib import Path
whl, site = Path(sys.argv[1]), Path(sys.argv[2])
drop = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs",
        "vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so")
moe = "vllm/_moe_C_stable_libtorch.abi3.so"  # into its own archive (moe.tar.xz)
for w in sorted(whl.glob("*.whl")):
    with zipfile.ZipFile(w) as z:
        for i in z.infolist():
            top, _, rest = i.filename.partition("/")
            if i.filename in drop or ("deep_gemm/_C.cpython-3" in i.filename and "cpython-312" not in i.filename):
                continue
            if top.endswith(".data"):  # a wheel's purelib/platlib go to the site; its scripts are not needed
                kind, _, rest = rest.partition("/")
                if kind not in ("purelib", "platlib"):
                    continue
                i.filename = rest
            into = site.parent / "moe" if i.filename == moe else site
            z.extract(i, into)
            if i.external_attr >> 16 & 0o111:
                os.chmod(into / i.filename, 0o755)
EOF
(cd "$work/moe" && tar cf - . | xz -T0 -6 > "$dest/moe.tar.xz")
(cd "$work/site" && tar cf - . | xz -T0 -6 > "$work/site.tar.xz")
(cd "$work" && sha256sum site.tar.xz) > "$dest/site.sha256"
rm -f "$dest"/site.part*
split -b "${part_mb}m" -d -a 1 "$work/site.tar.xz" "$dest/site.part"
cat > "$dest/install.sh" <<'EOF'
#!/usr/bin/env bash
# bash DIR/install.sh SITE: unpack the parts into SITE, build DeepSpeed there (no ops: JIT at first use)
set -euo pipefail
d=$(cd "$(dirname "$0")" && pwd); site=${1:?usage: install.sh SITE}
mkdir -p "$site"
cat "$d"/site.part* > "$site/../site.tar.xz"
(cd "$site/.." && sha256sum -c "$d/site.sha256")
tar xJf "$site/../site.tar.xz" -C "$site" && rm -f "$site/../site.tar.xz"
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" "$d"/deepspeed-*.tar.gz
PYTHONPATH=$site python3 -c "import vllm, deepspeed; print('vllm', vllm.__version__, 'deepspeed', deepspeed.__version__)"
EOF
ls -l "$dest"

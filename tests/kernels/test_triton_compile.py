"""The Triton kernels compile for an H100 (sm_90) even on a machine without a GPU.

The interpreter runs kernels as Python, so it misses what only the compiler rejects (non-constexpr
globals, dtype mismatches in tl.dot, shared memory overflows). This compiles the real kernels to
a cubin with Triton's bundled ptxas, in a subprocess without TRITON_INTERPRET.
"""

import os
import subprocess
import sys
import textwrap

import pytest

triton = pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from hybridrl.kernels import logprob as m

    def signature(fn, mm_dtype, consts):
        sig = {}
        for p in fn.params:
            if p.is_constexpr:
                sig[p.name] = "constexpr"
            elif p.name in ("H", "W", "B", "G"):
                sig[p.name] = "*" + mm_dtype  # GEMM operands and the dlogits buffer
            elif p.name == "Y":
                sig[p.name] = "*i64"
            elif p.name in ("LOGP", "ENT", "LSE", "Z", "GLP", "GENT"):
                sig[p.name] = "*fp32"  # per-token statistics and the stored fp32 logits
            else:
                sig[p.name] = "fp32" if p.name == "inv_t" else "i32"  # sizes and strides
        return ASTSource(fn, sig, consts)

    blocks = dict(BLOCK_N=m.BLOCK_N, BLOCK_V=m.BLOCK_V, BLOCK_D=m.BLOCK_D)
    target = GPUTarget("cuda", 90, 32)
    for mm, prec in (("bf16", None), ("fp32", "ieee")):
        fwd = dict(blocks, HAS_BIAS=True, STORE_Z=True, PRECISION=prec)
        triton.compile(signature(m._fwd_kernel, mm, fwd), target=target)
        grad = dict(blocks, HAS_BIAS=True, RECOMPUTE=mm == "bf16", PRECISION=prec)
        triton.compile(signature(m._grad_kernel, mm, grad), target=target)
    print("compiled")
""")


def test_kernels_compile_for_sm90(tmp_path):
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton wheel without the bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]

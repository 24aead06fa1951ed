"""Sequence parallelism's attention (engines/ulysses.py) at long rows: peak memory of one attention
layer's forward and backward through the wrapper, per packed row of L tokens, against the
block-causal [L, L] mask the sdpa path used to build (issue 59).

    python -m bench.sp_attention                          # CPU: sdpa, rows of 4k, 8k and 16k tokens
    python -m bench.sp_attention --tokens 4096 --samples 4
    python -m bench.sp_attention --cuda                   # a GPU: flash-attention where it imports, else sdpa

The layer is the 0.5B shape's (14 query heads, 2 KV heads, head_dim 64), on a group of one (the
exchanges are identities, what a rank computes is the same), in bfloat16 on CUDA and float32 on
CPU. `wrapper` is today's path (sdpa: one causal call per packed sample; flash: varlen from the
positions); `masked` is the path before the fix, sdpa with the [1, 1, L, L] mask, measured beside it
(sdpa only, rows up to 8k tokens). The figure is the peak above what the inputs hold: on CUDA the allocator's
high-water mark, on CPU the resident set's (glibc's default heap: freed tensors go back). A row per
run in bench/results/sp_attention.jsonl; the GPU lease runs it as its `sp_flash` stage.
"""

from __future__ import annotations

import argparse

import torch

from bench.results import record

MIB = 2.0**20
MASKED_MAX = 8192  # tokens: the masked reference is measured up to this row length


def _layer(impl: str, dtype: torch.dtype, device: torch.device):
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    cfg = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, attn_implementation=impl)
    return Qwen2Attention(cfg, layer_idx=0).to(device, dtype)


def measure(impl: str, L: int, samples: int, device: torch.device, dtype: torch.dtype, masked: bool) -> float:
    """MiB above the inputs at the peak of one attention forward + backward over a row of `samples`
    packed samples, L tokens in all."""
    from hybridrl.core import memory
    from hybridrl.engines import ulysses

    attn = _layer(impl, dtype, device)
    seg = torch.arange(samples, device=device).repeat_interleave(L // samples)
    positions = torch.cat([torch.arange(L // samples, device=device)] * samples)[None]
    q = torch.randn(1, 14, L, 64, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 2, L, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        memory.reset_peak()
        base = memory.host_memory()[0]
    ulysses.ACTIVE = ulysses.Active(ulysses.Group(None, 0, 1, 0), seg, positions)
    try:
        if masked:  # the path before the fix: sdpa with the whole row's block-causal mask
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            keep = torch.ones(L, L, dtype=torch.bool, device=device).tril_() & (seg[:, None] == seg[None])
            out, _ = sdpa_attention_forward(attn, q, k, v, keep[None, None])
        else:
            out, _ = ulysses._attention(impl)(attn, q, k, v, None)
        out.float().square().sum().backward()
    finally:
        ulysses.ACTIVE = None
    if cuda:
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / MIB
    return (memory.peak_since_reset() - base) / MIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="4096,8192,16384", help="tokens of the packed row; comma-separated")
    ap.add_argument("--samples", type=int, default=2, help="packed samples of equal length in the row")
    ap.add_argument("--cuda", action="store_true")
    args = ap.parse_args()
    import os

    os.environ.setdefault("HYBRIDRL_HOST_HEAP", "default")
    from hybridrl.core import launch

    launch.init_distributed()  # the exchanges run on a group of one
    device = torch.device("cuda") if args.cuda else torch.device("cpu")
    dtype = torch.bfloat16 if args.cuda else torch.float32
    impl = "sdpa"
    if args.cuda:
        try:
            import flash_attn  # noqa: F401

            impl = "flash_attention_2"
        except ImportError:
            pass
    print(f"one attention layer (0.5B shape), forward + backward, {args.samples} packed samples, {impl}, {dtype}")
    print(f"{'tokens':>7} {'wrapper MiB':>12} {'masked MiB':>11} {'MiB / 1k tokens (wrapper)':>26}")
    rows = []
    measure(impl, 512, args.samples, device, dtype, masked=False)  # first calls' own allocations, not counted
    for L in (int(t) for t in args.tokens.split(",")):
        got = measure(impl, L, args.samples, device, dtype, masked=False)
        # the masked path can fall back to sdpa's math kernel, whose [H, L, L] scores outgrow a small host
        old = (
            measure("sdpa", L, args.samples, device, dtype, masked=True) if impl == "sdpa" and L <= MASKED_MAX else None
        )
        rows.append({"tokens": L, "wrapper_mib": round(got, 1), "masked_mib": None if old is None else round(old, 1)})
        print(f"{L:>7} {got:>12.1f} {'-' if old is None else f'{old:.1f}':>11} {got / L * 1024:>26.2f}", flush=True)
    record(
        "sp_attention",
        {"impl": impl, "samples": args.samples, "dtype": str(dtype).split(".")[-1], "device": device.type},
        {"rows": rows},
    )


if __name__ == "__main__":
    main()

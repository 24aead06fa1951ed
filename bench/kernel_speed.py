"""Benchmark log-prob + PPO loss providers: forward+backward time and peak extra memory.

Workload per provider: hidden [N, d], LM head [V, d] -> per-token log-probs -> DAPO token-mean
clipped loss (eps 0.2/0.28, no KL) -> backward to hidden and head.
  naive          ppo_loss(*logprob_entropy_reference(...))      full [N, V] logits, autograd
  torch-unfused  ppo_loss(*logprob_entropy(provider="torch"))  chunked, logits recomputed (8NVd)
  torch-fused    fused_logprob_ppo_loss(provider="torch")       chunked, dlogits in fwd (6NVd)
  triton-*       the same with provider="triton"                (CUDA only)
  liger          liger_kernel LigerFusedLinearGRPOLoss(loss_type="dapo", beta=0; log-probs only,
                 no entropy; compiled=False on CPU)
Memory: each provider runs in a fresh subprocess. CPU: the kernel's resident-set high-water mark
(VmHWM, reset through /proc/self/clear_refs just before the first step) minus the RSS before it,
i.e. every page the step touched beyond the inputs, gradients included; measured on the first
step so no allocator cache hides it (tracemalloc does not see torch). CUDA: max_memory_allocated
minus memory_allocated before the step. Time: median of --iters steps after that first one.

Run: python -m bench.kernel_speed [--device cpu|cuda] [--shape cpu|qwen0.5b|llama3-8b|N,d,V]
Each run is recorded in bench/results/kernel_speed.jsonl (every provider's time and memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.results import record

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {"cpu": (4096, 256, 32768), "qwen0.5b": (8192, 896, 151936), "llama3-8b": (8192, 4096, 128256)}
LOSS = dict(eps_low=0.2, eps_high=0.28, agg="token_mean")
SEQ_LEN = 512  # liger wants [B, T]; N = B * SEQ_LEN


def _inputs(n, d, v, dtype, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(n, d, generator=g) / d**0.25).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g) / d**0.25).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    logp_old = (-torch.rand(n, generator=g) * 5).to(device)
    adv = torch.randn(n // SEQ_LEN, generator=g).repeat_interleave(SEQ_LEN).to(device)  # per sequence
    mask = (torch.rand(n, generator=g) > 0.1).float().to(device)
    return hidden, weight, targets, logp_old, adv, mask


def _step_fn(provider, chunk_size):
    """A closure running one forward+backward of `provider`."""
    import torch

    from hybridrl.kernels.fused_loss import fused_logprob_ppo_loss
    from hybridrl.kernels.logprob import logprob_entropy
    from hybridrl.kernels.ppo_loss import ppo_loss

    def unfused(impl):
        def step(h, w, y, old, adv, mask):
            logp, ent = logprob_entropy(h, w, y, provider=impl, chunk_size=chunk_size)
            ppo_loss(logp, old, adv, mask, entropy=ent, **LOSS)[0].backward()

        return step

    def fused(impl):
        def step(h, w, y, old, adv, mask):
            fused_logprob_ppo_loss(h, w, y, old, adv, mask, provider=impl, chunk_size=chunk_size, **LOSS)[0].backward()

        return step

    def liger(h, w, y, old, adv, mask):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        b = h.shape[0] // SEQ_LEN
        loss_fn = LigerFusedLinearGRPOLoss(
            beta=0.0, compiled=h.is_cuda, use_ref_model=False, epsilon_low=0.2, epsilon_high=0.28, loss_type="dapo"
        )
        loss, _ = loss_fn(
            h.view(b, SEQ_LEN, -1),
            w,
            y.view(b, SEQ_LEN),
            mask.view(b, SEQ_LEN),
            adv.view(b, SEQ_LEN)[:, 0],
            old_per_token_logps=old.view(b, SEQ_LEN),
        )
        loss.backward()

    table = {
        "naive": unfused("naive"),
        "torch-unfused": unfused("torch"),
        "torch-fused": fused("torch"),
        "triton-unfused": unfused("triton"),
        "triton-fused": fused("triton"),
        "liger": liger,
    }
    return table[provider], torch


def _rss_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def worker(provider, shape, dtype_name, device, iters, chunk_size):
    """Runs in its own process; prints one JSON line."""
    step, torch = _step_fn(provider, chunk_size)
    dtype = getattr(torch, dtype_name)
    inputs = _inputs(*shape, dtype, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _rss_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    step(*inputs)
    sync()
    first = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else _rss_kib("VmHWM") * 1024
    times = []
    for _ in range(iters):
        inputs[0].grad = inputs[1].grad = None
        t0 = time.perf_counter()
        step(*inputs)
        sync()
        times.append(time.perf_counter() - t0)
    print(
        json.dumps(
            {
                "provider": provider,
                "time_s": statistics.median(times) if times else first,
                "peak_extra_bytes": peak - base,
            }
        )
    )


def run_provider(provider, shape, dtype, device, iters, chunk_size):
    cmd = [
        sys.executable,
        "-m",
        "bench.kernel_speed",
        "--worker",
        provider,
        "--device",
        device,
        "--shape",
        ",".join(map(str, shape)),
        "--dtype",
        dtype,
        "--iters",
        str(iters),
    ]
    if chunk_size:
        cmd += ["--chunk-size", str(chunk_size)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        return {"provider": provider, "error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--shape", default=None, help="preset (%s) or N,d,V" % ", ".join(SHAPES))
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: fp32 CPU, bf16 CUDA)")
    p.add_argument("--providers", default=None, help="comma list (default: all for the device)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--chunk-size", type=int, default=None, help="token chunk (default: auto)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = a.device == "cuda"
    dtype = a.dtype or ("bfloat16" if cuda else "float32")
    names = [a.shape] if a.shape else (["qwen0.5b", "llama3-8b"] if cuda else ["cpu"])
    shapes = [SHAPES[s] if s in SHAPES else tuple(int(x) for x in s.split(",")) for s in names]
    if a.worker:
        return worker(a.worker, shapes[0], dtype, a.device, a.iters, a.chunk_size)
    providers = (
        a.providers.split(",")
        if a.providers
        else (
            ["naive", "torch-unfused", "torch-fused"] + (["triton-unfused", "triton-fused"] if cuda else []) + ["liger"]
        )
    )
    runs = []
    for n, d, v in shapes:
        runs.append({"shape": [n, d, v], "providers": {}})
        print(f"\n{a.device} {dtype} N={n} d={d} V={v} (fwd+bwd, median of {a.iters})")
        print(f"{'provider':<15}{'time ms':>10}{'x naive':>9}{'peak extra MiB':>16}{'x naive':>9}{'TFLOP/s':>9}")
        ref = None
        for prov in providers:
            r = run_provider(prov, (n, d, v), dtype, a.device, a.iters, a.chunk_size)
            runs[-1]["providers"][prov] = r
            if "error" in r:
                print(f"{prov:<15}  failed: {r['error'][:90]}")
                continue
            ref = ref or r
            tflops = 6 * n * v * d / r["time_s"] / 1e12  # the 6NVd floor, whatever the provider did
            print(
                f"{prov:<15}{r['time_s'] * 1e3:>10.0f}{r['time_s'] / ref['time_s']:>9.2f}"
                f"{r['peak_extra_bytes'] / 2**20:>16.0f}"
                f"{r['peak_extra_bytes'] / ref['peak_extra_bytes']:>9.2f}{tflops:>9.2f}"
            )
    record(
        "kernel_speed",
        {
            "device": a.device,
            "dtype": dtype,
            "shapes": names,
            "providers": providers,
            "iters": a.iters,
            "chunk_size": a.chunk_size,
        },
        {"runs": runs},
    )


if __name__ == "__main__":
    main()

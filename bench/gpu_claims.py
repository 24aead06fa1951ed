"""What the GPU self-check claims, and how its checks report.

CLAIMS lists, for each check, its timeout and the rows it reports (claim, target): the driver
(bench/gpu_check.py) lists them unmeasured without CUDA, and the checks (gpu_engine_checks.py,
gpu_run_checks.py) name their rows from it. `row` prints one row for the driver to collect;
`half_b_model` builds the Qwen2.5-0.5B-shaped model several checks share.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "hybridrl" / "demo_model"
UNMEASURED = "unmeasured (no CUDA)"
GIB = 2.0**30
KERNEL_SHAPE = (16384, 896, 151936)

# check -> (timeout s, [(claim, target)]) : the rows each check reports, also listed without CUDA
CLAIMS: dict[str, tuple[int, list[tuple[str, str]]]] = {
    "stack": (120, [("software stack", "")]),
    "expandable": (
        180,
        [
            ("expandable segments set for training (environ.setup)", "expandable_segments:True"),
            ("expandable segments off inside vLLM's pool, back on after", "False inside, True after"),
            (
                "fragmentation case (7x512 MiB freed, 7x300 MiB, then 1 GiB, under a 4 GiB cap)",
                "OOM without, fits with",
            ),
        ],
    ),
    "kernels": (
        420,
        [
            ("kernel time: triton-fused vs naive", "<= 1.0x naive"),
            ("kernel memory: triton-fused vs naive", "<= 0.10x naive"),
            ("kernel time: triton-fused vs Liger", "<= 0.33x Liger"),
            ("kernel time: torch-fused vs naive", "<= 1.0x naive"),
            ("kernel memory: torch-fused vs naive", "<= 0.10x naive"),
            ("kernel time: torch-fused vs Liger", "<= 0.33x Liger"),
            ("kernel correctness vs fp32 reference (loss, dhidden, dweight)", "rel. error <= 2e-2"),
        ],
    ),
    "offload": (
        480,
        [
            (
                f"trainer offload/reload, ZeRO-{z}{', with params' if p else ''}",
                "states leave and return; next step's log-probs equal (rel. 1e-4)",
            )
            for z in (2, 3)
            for p in (False, True)
        ],
    ),
    "sleep": (
        300,
        [
            ("vLLM sleep level 1: device memory freed", ">= 90% of what vLLM held"),
            ("vLLM sleep level 2: device memory freed", ">= 90% of what vLLM held"),
            ("sleep / wake latency (weights, KV) per level", "reported"),
            ("KV cache refused over weights a level-2 sleep discarded", "RuntimeError"),
            ("greedy tokens after level-1 wake", "identical to before sleeping"),
            ("greedy tokens after level-2 sleep + wake + full hand-off", "identical to before sleeping"),
        ],
    ),
    "planner": (
        360,
        [
            ("planner: vLLM footprint vs planned budget", "within 5%"),
            ("one full cycle at the planned utilization", "no OOM"),
        ],
    ),
    "e2e": (
        580,
        [
            ("demo on one GPU: held-out accuracy before -> after", "rises"),
            ("demo: s/step and phase split", "reported"),
            ("0.5B, 20 steps, 256-token completions: s/step, phases, rollout tok/s", "reported"),
            ("0.5B: hybrid overhead (sleep+wake+offload+reload+hand-off) % of step", "<= 3%"),
            ("0.5B: memory timeline (device used after each phase)", "reported"),
            ("hand-off, in process: demo / 0.5B (s, bytes)", "reported"),
            ("post-hand-off probe gap: demo fp32 max / 0.5B bf16 mean (abs dlogp)", "<= 1e-4 / <= 2e-2"),
            ("0.5B, sleep level 2 vs 1: step and overhead", "reported"),
            ("flash-attention varlen packing", "packed loss == padded"),
        ],
    ),
    "oop": (420, [("hand-off, out of process (CUDA IPC buckets): demo / 0.5B (s)", "completes, probe passes")]),
    "critic": (300, [("PPO with a critic (gae) + checkpoints on GPU", "completes")]),
    "variants": (
        480,
        [("0.5B: the planner's choices vs the previous plan, and CUDA graphs vs eager, side by side", "reported")],
    ),
    "paths": (
        420,
        [
            (f"demo, {name}: step-1 KL, probe gap after every hand-off", f"KL 0 at step 1, {gap}")
            for name, gap in (
                ("KL reference copy on the device (ZeRO-2)", "gap <= 1e-4"),
                ("LoRA rank 8, bfloat16 (adapter hand-off, base model as KL reference)", "mean gap <= 2e-2"),
                ("ZeRO-3 (zero.Init onto the device, gathered hand-off, sharded reference)", "gap <= 1e-4"),
            )
        ],
    ),
    # rollout.tensor_parallel_size: proven on CPU (2 ranks, shared memory); NCCL and CUDA graphs need >= 2 GPUs
    "tp": (
        420,
        [
            (
                f"demo, 2 GPUs, tensor parallel 2 ({how}): greedy held-out acc vs TP 1, probe gap every hand-off",
                "acc equal, gap <= 1e-4",
            )
            for how in ("NCCL, eager", "NCCL, CUDA graphs")
        ],
    ),
}


def row(claim: str, value, target: str = "", verdict: str = "info", **data) -> dict:
    r = {"claim": claim, "value": str(value), "target": target, "verdict": verdict, "data": data}
    print("ROW " + json.dumps(r, default=str), flush=True)
    return r


def verdict(ok: bool) -> str:
    return "pass" if ok else "fail"


def half_b_model() -> str:
    """A Qwen2.5-0.5B-shaped model with random weights (built once, on the GPU, into the cache)."""
    from hybridrl.core import environ

    dest = environ.cache_dir() / "bench-qwen2-0.5b"
    if (dest / "config.json").exists():
        return str(dest)
    import shutil

    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(tmp)
    for f in DEMO.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(dest)
    return str(dest)


if __name__ == "__main__":  # python -m bench.gpu_claims --help: what this module is
    print(__doc__)

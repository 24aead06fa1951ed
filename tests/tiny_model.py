"""A small non-demo model for tests: a random Qwen2 model with a byte-level BPE tokenizer trained
here (the tokenizers library, a few hundred tokens, under a second), a chat template, and EOS.

Its next-token distribution is made (nearly) independent of the context, so tests can reason
about what it samples: every embedding carries a large constant in dimension 0, which dominates
the residual stream, so after the final RMSNorm that dimension is ~sqrt(hidden) whatever the
prompt; the LM head's column 0 then adds a fixed logit per token. `build(dir, logits={"!": 3.0})`
makes '!' e^3 times likelier than any other token; EOS gets -30 (never sampled) unless given.
The weights stay those of a real Qwen2ForCausalLM: vLLM and DeepSpeed load it like any other.

    python tests/tiny_model.py DIR      # writes the model and tokenizer to DIR
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "what is the sum of and answer with a number please think step by step you are a helpful assistant "
    "system user question reply short one two three four five six seven eight nine zero"
).split()


def corpus(n: int = 400) -> list[str]:
    """Text to learn merges from: words, digits and the chat roles; no '!' and no '~', so those stay
    single-byte tokens (tests use '!' as the stop string and '~' for over-long prompts)."""
    import random

    rng = random.Random(0)
    return [
        " ".join(rng.choice(WORDS) for _ in range(12)) + f" {rng.randint(0, 999)}+{rng.randint(0, 999)}="
        for _ in range(n)
    ]


def tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(
    dest,
    *,
    logits: dict[str, float] | None = None,
    max_positions: int = 2048,
    eos: bool = True,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
) -> Path:
    """Write the model and its tokenizer to `dest`. `logits`: a fixed extra logit per single-token
    string ('<|im_end|>' included; EOS defaults to -30). `eos=False` saves a tokenizer without EOS."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dest = Path(dest)
    tok = tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(cfg).float()
    bias = {tok.eos_token: -30.0, **(logits or {})}
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 30.0  # dimension 0 dominates every hidden state
        head = model.lm_head.weight  # [V, d]; after the final norm h[0] ~ sqrt(d)
        head[:, 0] = 0.0
        for text, value in bias.items():
            ids = tok.convert_tokens_to_ids([text]) if text in SPECIALS else tok(text)["input_ids"]
            assert len(ids) == 1, f"{text!r} is {len(ids)} tokens"
            head[ids[0], 0] = value / math.sqrt(hidden)
    model.save_pretrained(dest, safe_serialization=True)
    if not eos:
        tok.eos_token = None
    tok.save_pretrained(dest)
    return dest


if __name__ == "__main__":
    build(sys.argv[1], logits={"!": 3.0})
    print(f"wrote {sys.argv[1]}")

"""The demo task (`hybridrl.data.tasks.arithmetic`) and the shipped demo model. Fast, no vLLM.

The vLLM side (same greedy accuracy, log-probs within 1e-5 of transformers) is checked by
`python examples/make_demo_model.py --check-vllm`.
"""

import hashlib

import pytest

from hybridrl.data.tasks import arithmetic

# sha256 of the split's prompts joined by spaces, in load() order (first 16 hex digits)
HELDOUT_DIGEST = "03766c11585d7a54"
TRAIN_DIGEST = "320901102327231b"


@pytest.mark.fast
def test_splits_are_fixed_disjoint_and_cover_all_pairs():
    train, held = arithmetic.load("train"), arithmetic.load("heldout")
    assert (len(train), len(held)) == (2244, 256)
    train_p, held_p = {r["prompt"] for r in train}, {r["prompt"] for r in held}
    assert len(train_p) == 2244 and len(held_p) == 256
    assert not train_p & held_p
    assert train_p | held_p == {f"{a}+{b}=" for a in range(50) for b in range(50)}
    # Fixed forever: these exact rows, and a digest of both splits in order.
    assert held[:5] == [
        {"prompt": "0+3=", "answer": "3"},
        {"prompt": "0+12=", "answer": "12"},
        {"prompt": "0+30=", "answer": "30"},
        {"prompt": "0+35=", "answer": "35"},
        {"prompt": "1+0=", "answer": "1"},
    ]
    assert train[:3] == [
        {"prompt": "2+25=", "answer": "27"},
        {"prompt": "8+23=", "answer": "31"},
        {"prompt": "1+9=", "answer": "10"},
    ]

    def digest(rows):
        return hashlib.sha256(" ".join(r["prompt"] for r in rows).encode()).hexdigest()

    assert digest(held)[:16] == HELDOUT_DIGEST
    assert digest(train)[:16] == TRAIN_DIGEST


@pytest.mark.fast
def test_rows_are_correct_sums():
    for r in arithmetic.load("train") + arithmetic.load("heldout"):
        a, b = r["prompt"].rstrip("=").split("+")
        assert r["answer"] == str(int(a) + int(b)) == arithmetic.answer_text(int(a), int(b))
        assert r["prompt"] == arithmetic.prompt_text(int(a), int(b))


@pytest.mark.fast
def test_unknown_split_raises():
    with pytest.raises(ValueError):
        arithmetic.load("test")


@pytest.mark.fast
@pytest.mark.parametrize(
    "completion,expected",
    [
        ("46", 1.0),
        (" 46\n", 1.0),
        ("46<eos>", 1.0),
        ("46 <eos>", 1.0),
        ("\t46<eos>\n", 1.0),
        ("46<eos><eos>", 1.0),
        ("4 6", 0.0),
        ("046", 0.0),
        ("47", 0.0),
        ("46+1", 0.0),
        ("", 0.0),
        ("<eos>", 0.0),
        ("46<eos>7", 0.0),
        ("4", 0.0),
    ],
)
def test_verify_and_reward(completion, expected):
    assert arithmetic.verify(completion, "46") == expected
    assert arithmetic.reward("12+34=", completion, "46") == expected


def test_task_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, hybridrl.data.tasks.arithmetic; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(arithmetic.DEMO_MODEL_DIR)


@pytest.mark.fast
def test_tokenizer_round_trip(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.eos_token == arithmetic.EOS_TEXT
    assert len(tokenizer) == 15
    ids = tokenizer("12+34=").input_ids
    assert ids == [1, 4, 5, 13, 6, 7, 14]  # bos, then one token per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+34="
    answer = tokenizer("46", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    assert answer == [7, 9, 2]
    assert tokenizer.decode(answer, skip_special_tokens=True) == "46"  # no spaces between chars
    assert tokenizer.decode(answer) == "46<eos>"
    for r in arithmetic.load("heldout"):
        assert tokenizer.decode(tokenizer(r["prompt"]).input_ids[1:]) == r["prompt"]


@pytest.mark.fast
def test_tokenizer_file_agrees_with_autotokenizer(tokenizer):
    """transformers 5 loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer, which rebuilds
    the pipeline; the shipped tokenizer.json mirrors it, so raw `tokenizers` (and
    transformers 4) give the same ids and text."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(arithmetic.DEMO_MODEL_DIR / "tokenizer.json"))
    assert raw.get_vocab_size() == len(tokenizer) == 15
    for r in arithmetic.load("heldout")[:64]:
        ids = tokenizer(r["prompt"]).input_ids
        assert raw.encode(r["prompt"]).ids == ids
        assert raw.decode(ids, skip_special_tokens=True) == r["prompt"]


@pytest.mark.fast
def test_shipped_model_is_weak_but_not_blank(tokenizer):
    """Greedy held-out accuracy in the 15-30% band (the warm-up stopped at 21.9%).

    Uses transformers' own `generate` with left padding: an implementation independent of the
    grouped decode in `examples/make_demo_model.py`.
    """
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(arithmetic.DEMO_MODEL_DIR, dtype=torch.float32)
    model.eval()
    cfg = model.config
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size // cfg.num_attention_heads) == (
        "qwen2",
        len(tokenizer),
        32,
    )  # head size 32: one vLLM's CPU attention supports
    assert sum(p.numel() for p in model.parameters()) == 858_496

    rows = arithmetic.load("heldout")
    tokenizer.padding_side = "left"
    batch = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=4,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
    acc = sum(arithmetic.reward(r["prompt"], t, r["answer"]) for r, t in zip(rows, texts)) / len(rows)
    assert 0.15 <= acc <= 0.30, acc
    assert all(t.isdigit() for t in texts)  # the format is learned: digits, then eos

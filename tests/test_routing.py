"""Routing replay (engines/routing.py): the mismatch and load metrics on hand-made cases, and the router
seam on a tiny Qwen3-MoE built from its config (no engine): replayed experts are the ones used, the gate
weights keep their gradient, replaying the model's own routes changes nothing, and every layout (padded,
packed, shared prompt) lines the routes up with its tokens. vLLM's side: test_routing_e2e.py."""

from __future__ import annotations

import pytest
import torch

from hybridrl.data.batch import Batch, stack_routes
from hybridrl.engines import routing

pytestmark = pytest.mark.fast


def test_mismatch_exact_on_a_constructed_case():
    # 4 tokens, 2 layers, top-2. Token 0 agrees everywhere; token 1 lists the same experts in another
    # order (a set: agrees); token 2 differs at layer 1 only; token 3 differs at both layers.
    ours = torch.tensor([[[0, 1], [2, 3]], [[1, 0], [3, 2]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]])
    theirs = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[4, 5], [6, 1]], [[0, 3], [1, 2]]])
    assert routing.mismatch_counts(ours, theirs) == (2, 3)  # tokens 2, 3; pairs (2,1), (3,0), (3,1)
    assert routing.routing_mismatch(ours, theirs) == 0.5
    assert routing.routing_mismatch(ours, ours) == 0.0


def test_load_balance_exact():
    # layer 0: even (cv 0, max/mean 1); layer 1: all 8 tokens on expert 0 of 4 (mean 2, std sqrt(12),
    # cv sqrt(3), max/mean 4); reported: the means over layers
    m = routing.load_balance(torch.tensor([[2, 2, 2, 2], [8, 0, 0, 0]]))
    assert m["router/load_cv"] == pytest.approx(3**0.5 / 2)
    assert m["router/load_max_mean"] == pytest.approx(2.5)
    assert routing.load_balance(torch.zeros(2, 4)) == {}


def tiny_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=15,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    m = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("gate.weight"):
                p.normal_(0, 0.5)
    return m


def _used_experts(model):
    """Hooks on the experts' modules recording the top-k index each forward used, per layer."""
    seen, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        handles.append(
            layer.mlp.experts.register_forward_hook(
                lambda mod, args, out, i=i: seen.setdefault(i, []).append(args[1].clone())
            )
        )
    return seen, handles


def test_replay_uses_the_given_experts_and_the_router_still_learns():
    model = tiny_moe()
    router = routing.Router(model)
    assert sorted(router.layers) == [0, 1] and routing.supported(model) is None
    tokens = torch.randint(3, 15, (2, 7))
    att = torch.ones(2, 7, dtype=torch.bool)
    att[1, 5:] = False
    theirs = torch.randint(0, 8, (2, 7, 2, 1)).expand(2, 7, 2, 2).clone()  # [B, T, L, k]
    theirs[..., 1] = (theirs[..., 0] + 1 + torch.randint(0, 7, theirs[..., 0].shape)) % 8  # k distinct experts
    theirs[0, 6] = -1  # a token without vLLM's routes: the trainer routes it itself
    seen, handles = _used_experts(model)
    with router.run(routing.padded_segments(theirs, att), substitute=True):
        out = model(input_ids=tokens, attention_mask=att.long()).logits
    used = torch.stack([seen[i][0] for i in (0, 1)], 1).view(2, 7, 2, 2)  # [B, T, L, k]
    known = (theirs >= 0).all(-1).all(-1) & att  # padding keeps the router's own choice: it is never read
    assert torch.equal(used[known], theirs[known].long())
    out[att].sum().backward()
    for r in router.layers.values():
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    m = router.metrics()
    assert m["routing/mismatch"] > 0.5  # random experts differ from the router's own choice
    assert set(m) >= {"router/load_cv", "router/load_max_mean", "routing/mismatch_layer"}
    for h in handles:
        h.remove()


def test_replaying_the_models_own_routes_changes_nothing():
    model = tiny_moe()
    router = routing.Router(model)
    tokens = torch.randint(3, 15, (3, 9))
    att = torch.ones(3, 9, dtype=torch.bool)
    with router.run(routing.padded_segments(torch.full((3, 9, 2, 2), -1, dtype=torch.int16), att), substitute=True):
        seen, handles = _used_experts(model)
        ref = model(input_ids=tokens).logits
    own = torch.stack([seen[i][0] for i in (0, 1)], 1).view(3, 9, 2, 2)
    with router.run(routing.padded_segments(own, att), substitute=True):
        again = model(input_ids=tokens).logits
    assert torch.allclose(ref, again, atol=1e-6)
    assert router.metrics()["routing/mismatch"] == 0.0
    for h in handles:
        h.remove()


def _own_routes(model, batch):
    """The model's own experts for each token of `batch`'s rows, each row run alone: [B, T, L, k]."""
    seen, handles = _used_experts(model)
    out = torch.full((len(batch), batch.tokens.shape[1], 2, 2), -1, dtype=torch.int16)
    for b in range(len(batch)):
        n = int(batch.lengths[b])
        model(input_ids=batch.tokens[b : b + 1, :n])
        out[b, :n] = torch.stack([seen[i][-1] for i in (0, 1)], 1).to(torch.int16)
    for h in handles:
        h.remove()
    return out


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_every_layout_lines_routes_up_with_its_tokens(layout):
    from hybridrl.engines.policy import TokenLogprobs, module_inputs

    model = tiny_moe(1)
    prompts = [[1, 5, 6, 7], [1, 5, 6, 7], [1, 9, 3]]
    comps = [[8, 9, 2], [10, 2], [4, 4, 4, 2]]
    batch = Batch.from_rows(prompts, comps, [[0.0] * len(c) for c in comps], [0.0] * 3)
    batch.routes = _own_routes(model, batch)
    # shift every recorded route by one expert: the model's output then differs from its own routing,
    # and a layout that misplaced a row would use another token's experts than the ones given
    given = torch.where(batch.routes >= 0, (batch.routes + 1) % 8, batch.routes)
    batch.routes = given
    router = routing.Router(model)
    seen, handles = _used_experts(model)
    module = TokenLogprobs(model, "torch", 64)
    args, kw = module_inputs(batch, layout == "packed", layout == "shared")
    att = batch.attention_mask()
    segments = {"padded": routing.padded_segments, "packed": routing.packed_segments}.get(layout)
    segs = routing.shared_segments(given, batch) if layout == "shared" else segments(given, att)
    with router.run(segs, substitute=True):
        logp = module(*args, 1.0, **kw)[0]
    for h in handles:
        h.remove()
    for seg, call in zip(segs, range(len(segs))):
        used = torch.stack([seen[i][call] for i in (0, 1)], 1)  # [N, L, k]
        known = (seg.routes >= 0).all(-1).all(-1) & seg.valid
        assert torch.equal(used[known], seg.routes[known])
    # and the log-probs are the padded layout's
    with router.run(routing.padded_segments(given, att), substitute=True):
        ref = module(batch.tokens, att, batch.loss_mask, 1.0)[0]
    assert torch.allclose(logp, ref, atol=1e-5)


def test_routes_travel_with_rows():
    r0 = torch.arange(5 * 2 * 2, dtype=torch.int16).view(5, 2, 2)
    batch = Batch.from_rows([[1, 2], [1, 2, 3]], [[4, 5, 6], [7]], [[0.0] * 3, [0.0]], [0.0, 0.0], routes=[r0, None])
    assert batch.routes.shape == (2, 5, 2, 2) and torch.equal(batch.routes[0], r0)
    assert (batch.routes[1] == -1).all()
    sub = batch.select(torch.tensor([1]))
    assert sub.routes.shape == (1, 4, 2, 2)  # trimmed to the row's length, like the tokens
    assert stack_routes([None, None], 3) is None
    assert Batch.from_rows([[1]], [[2]], [[0.0]], [0.0]).routes is None


def test_dense_models_record_nothing_and_auto_replays_moe():
    from types import SimpleNamespace

    from transformers import Qwen2Config

    cfg = SimpleNamespace(algo=SimpleNamespace(routing_replay="auto"))
    assert routing.wanted(cfg, Qwen2Config()) == (False, False)
    moe = tiny_moe().config
    # auto replays a MoE model's routes (it costs little: bench.routing_replay); off still records them
    # for the mismatch and load metrics
    assert routing.wanted(cfg, moe) == (True, True)
    cfg.algo.routing_replay = "off"
    assert routing.wanted(cfg, moe) == (True, False)
    cfg.algo.routing_replay = "on"
    assert routing.wanted(cfg, moe) == (True, True)


def test_replay_on_with_multi_turn_episodes_is_refused_in_one_line():
    """An episode's later turns are requests of their own whose routes are not recorded: `on` with an
    environment is refused before any engine starts; `auto` leaves the trainer routing episodes itself."""
    from hybridrl.core import config

    env = {"env.cls": "hybridrl.data.envs:ToolEnv"}
    with pytest.raises(
        config.ConfigError, match="algo.routing_replay=on with env.cls: .* set algo.routing_replay auto"
    ) as e:
        config.load(None, {**env, "algo.routing_replay": "on"})
    assert "\n" not in str(e.value)
    assert config.load(None, env).algo.routing_replay == "auto"

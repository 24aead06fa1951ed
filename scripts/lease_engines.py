"""The lease's stages that start a vLLM engine alone, without a trainer (scripts/lease.py runs them as
scripts/lease_stages.py's): a 7B shape's and a Qwen3-30B-A3B shape's decode with dummy weights, what an
engine keeps on the device through a level-2 sleep, and the group's own sampling state. Each engine
runs in a process of its own (`python -m scripts.lease --decode ...`): an in-process vLLM engine does
not give all its memory back.
"""

from __future__ import annotations

import subprocess
import sys
import time

from scripts.lease_stages import GIB, ROOT, _seconds

DECODE_SEQS, DECODE_TOKENS, DECODE_PROMPT = 64, 512, 64  # the 7B-shape and MoE decodes
# the decodes' shapes (shipped config.json, dummy weights): the whole 30B-A3B is 57 GiB of bf16 weights,
# which one H100 holds beside the decode's KV cache
DECODE_SHAPES = {"qwen2.5-7b": "7B shape", "qwen3-30b-a3b": "Qwen3-30B-A3B shape (128 experts, 8 per token)"}


def decode_plan(graphs: bool, config: str = "qwen2.5-7b") -> dict[str, int]:
    """The plan's vLLM rows for a decode of `config`'s shape (bf16, one GPU, 64 sequences): its
    weights are every expert's, its activations go by the active parameters."""
    from hybridrl.core import memory
    from hybridrl.cycle import plan
    from hybridrl.cycle.shape import Shape, read_config

    shape = Shape.from_config(read_config(config))
    weights = shape.params * 2
    kv = DECODE_SEQS * (DECODE_PROMPT + DECODE_TOKENS) * 2 * shape.layers * shape.kv_dim * 2
    kv = max(int(memory.KV_HEADROOM * kv), memory.KV_MIN)
    return {
        "weights": weights,
        "KV cache": kv,
        "activations": int(GIB + shape.active_params * 2 // 10 + memory.sampler_bytes(DECODE_SEQS, shape.vocab)),
        "CUDA graphs": plan.graph_bytes(shape, 2, DECODE_SEQS, 1) if graphs else 0,
        "buffers": plan.buffer_bytes(shape, 2, 1),
    }


def stage_decode7b(cuda: bool) -> None:
    from bench.gpu_claims import row

    plans = {mode: decode_plan(mode == "graphs") for mode in ("eager", "graphs")}
    for mode, p in plans.items():
        if not cuda:
            row(
                f"7B shape, dummy weights, {mode}: {DECODE_SEQS} x {DECODE_TOKENS} tokens",
                "plan " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in p.items()) + " GiB; measured: skipped: no CUDA",
                "",
                "skipped",
                plan_gib={k: v / GIB for k, v in p.items()},
            )
            continue
        # each engine in its own process: an in-process vLLM engine does not give all its memory back
        try:
            subprocess.run([sys.executable, "-m", "scripts.lease", "--decode", mode], timeout=_seconds(110), cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            row(
                f"7B shape, dummy weights, {mode}: {DECODE_SEQS} x {DECODE_TOKENS} tokens",
                f"cut at {e.timeout:.0f} s",
                "",
                "fail",
            )


def stage_moe_decode(cuda: bool) -> None:
    """decode7b's measurement for a mixture of experts: vLLM's fused-MoE kernels, every expert's
    weights in the footprint, and CUDA graphs' gain where a token reads only 8 of 128 experts."""
    from bench.gpu_claims import row

    config, label = "qwen3-30b-a3b", DECODE_SHAPES["qwen3-30b-a3b"]
    for mode in ("eager", "graphs"):
        p = decode_plan(mode == "graphs", config)
        claim = f"{label}, dummy weights, {mode}: {DECODE_SEQS} x {DECODE_TOKENS} tokens"
        if not cuda:
            row(
                claim,
                "plan " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in p.items()) + " GiB; measured: skipped: no CUDA",
                "",
                "skipped",
                plan_gib={k: v / GIB for k, v in p.items()},
            )
            continue
        try:  # its own process, as decode7b's
            subprocess.run(
                [sys.executable, "-m", "scripts.lease", "--decode", mode, "--decode-config", config],
                timeout=_seconds(110),
                cwd=ROOT,
            )
        except subprocess.TimeoutExpired as e:
            row(claim, f"cut at {e.timeout:.0f} s", "", "fail")


def decode(mode: str, config: str = "qwen2.5-7b") -> None:
    """One engine: vLLM with a shipped shape's config (DECODE_SHAPES) and dummy weights (no download),
    64 sequences of 512 new tokens after a 64-token prompt; its footprint against the plan's rows."""
    import torch

    from bench import gpu_engine_checks as engine
    from bench.gpu_claims import row, verdict
    from hybridrl.core import environ, memory
    from hybridrl.cycle.shape import shipped_config
    from hybridrl.engines import vllm_compat

    engine._world()
    src, label = shipped_config(config), DECODE_SHAPES[config]
    model = environ.cache_dir() / f"lease-{config}-config"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(src.read_text())
    from vllm import LLM, SamplingParams

    p = decode_plan(mode == "graphs", config)
    kw = vllm_compat.engine_kwargs(
        on_cpu=False,
        kv_cache_bytes=p["KV cache"],
        gpu_memory_utilization=0.9,
        sleep_mode=False,
        max_num_seqs=DECODE_SEQS,
        enforce_eager=mode == "eager",
    )
    before = engine._used()
    t = time.perf_counter()
    with memory.vllm_pool(True), vllm_compat.engine_env(out_of_process=False, local_rank=0, cuda=True):  # as Rollout
        llm = LLM(
            model=str(model),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            seed=0,
            enforce_eager=mode == "eager",
            max_model_len=DECODE_PROMPT + DECODE_TOKENS + 64,
            **kw,
        )
    start_s = time.perf_counter() - t
    footprint = engine._used() - before
    planned = sum(p.values())
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(100, 150000, (DECODE_PROMPT,), generator=g).tolist()}
        for _ in range(DECODE_SEQS)
    ]
    params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True, temperature=1.0, detokenize=False)
    llm.generate(prompts[:8], SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False), use_tqdm=False)
    times = []
    for _ in range(2):
        times.append(engine._timed(lambda: llm.generate(prompts, params, use_tqdm=False)))
    best = min(times)
    row(
        f"{label}, dummy weights, {mode}: {DECODE_SEQS} x {DECODE_TOKENS} tokens",
        f"{DECODE_SEQS * DECODE_TOKENS / best:.0f} tok/s ({best:.2f} s, best of {len(times)}); engine start "
        f"{start_s:.0f} s",
        "reported",
        "info",
        times=times,
        start_s=start_s,
    )
    err = footprint / planned - 1
    row(
        f"{label}, {mode}: vLLM's footprint vs the plan",
        f"{footprint / GIB:.2f} vs {planned / GIB:.2f} GiB "
        f"({err:+.1%}; plan " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in p.items()) + ")",
        "within 5%",
        verdict(abs(err) <= 0.05),
        footprint_gib=footprint / GIB,
        plan_gib={k: v / GIB for k, v in p.items()},
    )


def stage_asleep(cuda: bool) -> None:
    """The plan's rows for what vLLM keeps asleep (0.5B, bf16, TP 1, 64 sequences, CUDA graphs) and, on a
    GPU, the device memory vLLM still holds after a level-2 sleep, in its own process."""
    from bench.gpu_claims import row

    if not cuda:
        from hybridrl.cycle import plan
        from hybridrl.cycle.shape import Shape, read_config

        shape = Shape.from_config(read_config("qwen2.5-0.5b"))
        p = {"CUDA graphs": plan.graph_bytes(shape, 2, DECODE_SEQS, 1), "buffers": plan.buffer_bytes(shape, 2, 1)}
        row(
            "0.5B, CUDA graphs: vLLM's device memory after a level-2 sleep vs the plan",
            "plan " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in p.items()) + " GiB; measured: skipped: no CUDA",
            "",
            "skipped",
            plan_gib={k: v / GIB for k, v in p.items()},
        )
        return
    try:
        subprocess.run([sys.executable, "-m", "scripts.lease", "--decode", "asleep"], timeout=_seconds(180), cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        row(
            "0.5B, CUDA graphs: vLLM's device memory after a level-2 sleep vs the plan",
            f"cut at {e.timeout:.0f} s",
            "",
            "fail",
        )


def _half_b_engine(enforce_eager: bool, sleep_mode: bool):
    from vllm import LLM

    from bench import gpu_engine_checks as engine
    from bench.gpu_claims import half_b_model
    from hybridrl.core import memory
    from hybridrl.engines import vllm_compat

    engine._world()
    kw = vllm_compat.engine_kwargs(
        on_cpu=False,
        kv_cache_bytes=GIB,
        gpu_memory_utilization=0.3,
        sleep_mode=sleep_mode,
        max_num_seqs=DECODE_SEQS,
        enforce_eager=enforce_eager,
    )
    with memory.vllm_pool(True), vllm_compat.engine_env(out_of_process=False, local_rank=0, cuda=True):
        return LLM(
            model=half_b_model(), dtype="bfloat16", seed=0, enforce_eager=enforce_eager, max_model_len=1024, **kw
        )


def asleep() -> None:
    """One 0.5B engine with CUDA graphs and sleep mode: what it holds after a level-2 sleep."""
    import torch
    from vllm import SamplingParams

    from bench import gpu_engine_checks as engine
    from bench.gpu_claims import row, verdict
    from hybridrl.cycle import plan
    from hybridrl.cycle.shape import Shape, read_config

    torch.cuda.init()
    before = engine._used()
    llm = _half_b_engine(enforce_eager=False, sleep_mode=True)
    awake = engine._used() - before
    llm.generate(
        [{"prompt_token_ids": list(range(100, 164))}] * 8,
        SamplingParams(max_tokens=32, ignore_eos=True),
        use_tqdm=False,
    )
    from hybridrl.core import memory

    with memory.vllm_pool(True):  # as Rollout.sleep
        llm.sleep(level=2)
    kept = engine._used() - before
    shape = Shape.from_config(read_config("qwen2.5-0.5b"))
    graphs, buffers = plan.graph_bytes(shape, 2, DECODE_SEQS, 1), plan.buffer_bytes(shape, 2, 1)
    planned = graphs + buffers
    row(
        "0.5B, CUDA graphs: vLLM's device memory after a level-2 sleep vs the plan",
        f"{kept / GIB:.2f} GiB kept of {awake / GIB:.2f} awake vs plan {planned / GIB:.2f} (graphs "
        f"{graphs / GIB:.2f}, buffers {buffers / GIB:.2f}; the CUDA context is the reserve's)",
        "plan >= measured",
        verdict(kept <= planned),
        kept_gib=kept / GIB,
        awake_gib=awake / GIB,
        plan_gib=planned / GIB,
    )


def stage_tp_rng(cuda: bool) -> None:
    """The group's sampling state (vllm_compat.SamplingRNG): on CPU that it is isolated from the global
    generator; on a GPU that it, not the global CUDA generator, decides vLLM's unseeded samples."""
    import torch

    from bench.gpu_claims import row, verdict
    from hybridrl.engines import vllm_compat

    rng = vllm_compat.SamplingRNG(7, cuda=False)
    with rng.active():
        a = torch.rand(4)
    torch.rand(10)  # a rank-local random op
    again = vllm_compat.SamplingRNG(7, cuda=False)
    with again.active():
        b = torch.rand(4)
    row(
        "SamplingRNG on CPU: a rank-local random op outside does not change the draws inside",
        "identical" if torch.equal(a, b) else "DIFFER",
        "identical",
        verdict(torch.equal(a, b)),
    )
    claim = "0.5B on a GPU: unseeded samples under the group's state, a rank-local CUDA random op between"
    if not cuda:
        row(claim, "skipped: no CUDA", "identical", "skipped")
        return
    from vllm import SamplingParams

    llm = _half_b_engine(enforce_eager=True, sleep_mode=False)
    prompts = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(8)]
    params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True, detokenize=False)

    def sample(state: bool) -> list:
        if state:
            with vllm_compat.SamplingRNG(11, cuda=True).active():
                outs = llm.generate(prompts, params, use_tqdm=False)
        else:
            torch.cuda.manual_seed(11)
            outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    first = sample(True)
    torch.rand(1000, device="cuda")  # a rank-local random op on the global CUDA generator
    second = sample(True)
    g1 = sample(False)
    torch.rand(1000, device="cuda")
    g2 = sample(False)
    torch.cuda.manual_seed(11)
    torch.rand(1000, device="cuda")
    g3 = llm.generate(prompts, params, use_tqdm=False)
    moved = [list(o.outputs[0].token_ids) for o in g3] != g1
    row(
        claim,
        f"{'identical' if first == second else 'DIFFER'}; the global generator alone: same seed "
        f"{'identical' if g1 == g2 else 'differs'}, moved by the op {'differs' if moved else 'identical'}",
        "identical (and the moved global generator differs)",
        verdict(first == second and moved),
    )


STAGE_FUNCS = {
    "decode7b": stage_decode7b,
    "moe_decode": stage_moe_decode,
    "asleep": stage_asleep,
    "tp_rng": stage_tp_rng,
}

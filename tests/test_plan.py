"""The memory plan (hybridrl/cycle/plan.py): its arithmetic against figures worked out by hand for two
real shapes, the choices it makes for what the user left unset, its refusals, `hybridrl plan`
and the shipped 8xH100 recipes. Pure arithmetic on config.json: no engine starts here."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.core import config, recipe
from hybridrl.core.config import ConfigError
from hybridrl.cycle import plan
from hybridrl.cycle.shape import CONFIGS, Shape

from helpers.plan import H100, NODE, gpu_config, shape

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


@pytest.mark.fast
def test_shape_of_qwen25_7b_by_hand():
    s = shape("Qwen/Qwen2.5-7B-Instruct")
    # config.json: hidden 3584, MLP 18944, 28 layers, 28 query / 4 KV heads of 128, vocabulary 152064, untied
    layer = (
        3584 * 3584 * 2  # q_proj, o_proj
        + 2 * 3584 * 512  # k_proj, v_proj (4 KV heads x 128)
        + 3584
        + 2 * 512  # q/k/v biases (Qwen2)
        + 3 * 3584 * 18944  # gate, up, down
        + 2 * 3584
    )  # two RMSNorms
    assert s.layer_params == layer == 233_057_792
    assert s.params == 2 * 152064 * 3584 + 28 * layer + 3584 == 7_615_616_512  # Qwen's model card: 7.61B
    # per token and layer, bfloat16: (6 x 2 + 8) x hidden + 2 x 2 x KV width + 4 x 2 x MLP width
    assert s.layer_activations(2) == 20 * 3584 + 4 * 512 + 8 * 18944 == 225_280


@pytest.mark.fast
def test_params_match_transformers_for_shipped_configs():
    """The plan's count against transformers' own model, built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in ("qwen2.5-0.5b", "qwen2.5-7b", "llama-3.1-8b"):
        conf = AutoConfig.from_pretrained(str(CONFIGS / f"{name}.json"))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(conf)
        assert Shape.from_config(json.loads((CONFIGS / f"{name}.json").read_text())).params == sum(
            p.numel() for p in model.parameters()
        ), name


@pytest.mark.fast
def test_plan_of_7b_on_8_gpus_by_hand():
    """Qwen2.5-7B at the real-model defaults on 8 x 80 GB: ZeRO-2, bfloat16, micro-batches of 4096
    tokens (the plan's choice), every term worked out from the config."""
    cfg = gpu_config("Qwen/Qwen2.5-7B-Instruct", 8)
    cfg, p = plan.decide(cfg, shape("Qwen/Qwen2.5-7B-Instruct"), device=H100, host=NODE, world=8, local=8, on_cpu=False)
    P, layer = 7_615_616_512, 233_057_792
    params = P * 2  # bf16, replicated under ZeRO-2
    grads = P * 2 // 8 + 500_000_000 * 2  # this rank's partition + DeepSpeed's reduce bucket
    states = 12 * P // 8  # fp32 master + two Adam moments, partitioned
    tokens = 4096
    saved = tokens * ((4 + 2) * 3584 + 28 * 225_280)  # embedding/final norm + 28 layers
    backward = tokens * 225_280 + layer * 2  # one layer's activation and weight gradients
    head = 1024 * 152064 * (2 + 8)  # a 1024-token chunk of logits, not the full [tokens, vocab]
    head += 152064 * 3584 * (4 + 2)  # the LM head's fp32 dW accumulator and a bf16 copy, whole on each rank
    reserve = 2048 << 20
    # what vLLM keeps asleep (issue 47 item 5), outside its sleep-mode pool: the CUDA-graph pool, full and
    # piecewise graphs for 11 sizes up to 64 sequences, each size 2 MiB + at the top one layer's activations
    # per sequence ((q + 2 kv + hidden + 2 MLP) x 2 bytes + the vocabulary's float32 logits), and the model
    # runner's persistent buffers for 16384 batched tokens (the hidden state in bf16 + 24 bytes of ids)
    per_seq = (3584 + 2 * 512 + 3584 + 2 * 18944) * 2 + 152064 * 4
    graphs = (64 << 20) + 2 * (11 * (2 << 20) + 64 * per_seq)
    buffers = 16384 * (3584 * 2 + 24)
    assert p.rows["CUDA graphs"]["train"] == graphs == 202_899_456
    assert p.rows["vLLM buffers"]["train"] == buffers == 117_833_728
    train = params + grads + states + saved + backward + head + reserve + graphs + buffers
    assert p.total("train") == train == 64_167_753_856  # 59.8 GiB (56.7 before the head's weight gradient)
    assert p.rows["activations"]["train"] == saved + backward + head
    # generating: vLLM's weights, its KV cache for 64 sequences of 1536 tokens (x 2 headroom), its
    # activations (1 GiB + 10% of the weights + the sampler's rows), CUDA graphs, the trainer kept
    kv = 2 * (64 * 1536 * (2 * 28 * 512 * 2))
    vllm_act = GIB + params // 10 + 64 * 152064 * 4
    assert p.rows["vLLM KV cache"]["generate"] == kv
    assert p.rows["vLLM activations"]["generate"] == vllm_act
    assert p.total("generate") == params + kv + vllm_act + graphs + buffers + params + grads + states + reserve
    assert p.fits and p.peak[0] == "train"  # generate: 57.0 GiB
    assert (
        cfg.train.max_tokens_per_micro_batch == 4096
        and cfg.sources["train.max_tokens_per_micro_batch"] == "memory plan"
    )
    assert not cfg.model.gradient_checkpointing and cfg.train.zero_stage == 2
    assert "train.max_tokens_per_micro_batch=4096" in p.table()


@pytest.mark.fast
def test_plan_of_05b_zero3_with_checkpointing_by_hand():
    """Qwen2.5-0.5B on 2 GPUs, ZeRO-3 and gradient checkpointing as set, a KL reference and a critic."""
    cfg = gpu_config(
        "Qwen/Qwen2.5-0.5B",
        2,
        **{
            "train.zero_stage": 3,
            "model.gradient_checkpointing": True,
            "algo.kl_coef": 0.01,
            "algo.advantage": "gae",
            "train.max_tokens_per_micro_batch": 2048,
        },
    )
    s = shape("Qwen/Qwen2.5-0.5B")
    k = plan.knobs(cfg, s, world=2, local=2, on_cpu=False)
    p = plan.build(s, k, device=H100, host=NODE)
    P = 494_032_768  # tied embeddings: one 151936 x 896 matrix
    assert s.params == P
    layer_act = 20 * 896 + 4 * 128 + 8 * 4864  # 56,352 bytes per token
    layer = s.layer_params
    act = 2048 * ((4 + 2) * 896 + 24 * 2 * 896 + layer_act)  # each layer's input, one layer recomputed
    act += 2048 * layer_act + layer * 2 + 1024 * 151936 * 10
    act += 151936 * 896 * (4 + 2)  # the head's fp32 dW accumulator and a bf16 copy
    assert p.rows["activations"]["train"] == act
    assert p.rows["trainer params"]["train"] == P * 2 // 2  # ZeRO-3: a shard
    assert p.rows["trainer grads"]["train"] == P * 2 // 2 + P * 2  # the model is smaller than the reduce bucket
    assert p.rows["reference"]["reference"] == 2 * layer * 2  # ZeRO-3: gathered a layer at a time
    critic_P = P  # tied: no separate LM head to leave out
    assert p.rows["critic"]["train"] == critic_P * 2 // 2 + critic_P * 2 // 2 + critic_P * 2 + 12 * critic_P // 2
    # its shards, one copy per node, pinned parameter by parameter, each rounded up to a power of two by
    # torch's pinned allocator (issue 47 item 4): half of each bf16 tensor per rank -
    # embedding 151936 x 896 / 2 x 2 B = 136,134,656 -> 2^28; per layer q and o 802,816 -> 2^20 each, k and v
    # 114,688 -> 2^17, biases 896 -> 2^10 and 128 (x2), gate/up/down 4,358,144 -> 2^23 each, norms 896 -> 2^10 (x2)
    layer_pinned = 2 * 2**20 + 2 * 2**17 + 2**10 + 2 * 128 + 3 * 2**23 + 2 * 2**10
    assert p.pinned["reference"] == 2 * (2**28 + 24 * layer_pinned + 2**10) == 1_858_238_464  # 1.88x its bytes
    assert P * 2 // 2 * 2 == 988_065_536  # what the plan counted before


@pytest.mark.fast
def test_what_vllm_keeps_asleep_is_planned_in_every_phase():
    """Issue 47 item 5: vLLM's CUDA-graph pool (full and piecewise graphs), its persistent buffers and
    a TP group's NCCL buffers are allocated outside its sleep-mode pool, so a sleep releases none of
    them: the trainer's phases must leave room for them too. The 72B recipe, TP 4."""
    cfg = config.load(str(ROOT / "examples" / "recipes" / "qwen2.5-72b-8xh100.yaml"), {})
    cfg, p, _ = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
    s = shape("Qwen/Qwen2.5-72B-Instruct")
    graphs, buffers = p.rows["CUDA graphs"], p.rows["vLLM buffers"]
    for phase in p.PHASES:
        assert graphs[phase] == plan.graph_bytes(s, 2, 256, 4) and buffers[phase] == plan.buffer_bytes(s, 2, 4)
    # two capture modes: the pool's per-size and per-sequence terms twice over one mode's
    assert plan.graph_bytes(s, 2, 256, 4) - (64 << 20) == 2 * (plan.graph_bytes(s, 2, 256, 4, modes=1) - (64 << 20))
    # 16384 tokens' hidden state (8192 x bf16) + ids, and two NCCL communicators at TP > 1
    assert plan.buffer_bytes(s, 2, 4) == 16384 * (8192 * 2 + 24) + 2 * plan.NCCL_COMM
    assert plan.buffer_bytes(s, 2, 1) == 16384 * (8192 * 2 + 24)
    # the planner that runs keeps the same bytes back beside vLLM's budget
    from hybridrl.core import memory

    m = memory.plan(80 * GIB, 70 * GIB, 76 * GIB, margin=2 * GIB, weights=GIB, need=2 * GIB, asleep=64 * GIB)
    assert m.offload and m.asleep == 64 * GIB and "graphs and buffers (kept asleep) 64.00 GiB" in m.describe()


@pytest.mark.fast
def test_pinned_host_memory_is_counted_as_torch_and_deepspeed_pin_it():
    """Issue 47 item 4: torch's pinned allocator rounds every allocation up to a power of two, ZeRO-3
    with the optimizer offloaded pins a flat bf16 gradient buffer and fp32 sub-group gradients (its
    fp32 master weights and Adam's moments are ordinary pages), and the reference pins tensor by
    tensor. The 72B recipe (8 ranks, ZeRO-3, optimizer offloaded) from DeepSpeed's stage3.py:
    a rank's 9,088,275,456 trained parameters pin 2 x 9.09e9 B of bf16 gradients -> 32 GiB and 9
    sub-groups of 1e9 fp32 gradients (4e9 B -> 4 GiB each) + the 88,275,456-element rest -> 512 MiB:
    68.5 GiB a rank, 548 GiB a node; 12 B a parameter of pageable states: 812.6 GiB. 1360.6 GiB
    in all where the plan counted 16 B a parameter, all pinned: 1083.4 GiB."""
    assert [plan.pinned_bytes(n) for n in (1, 3, 4096, 4097, 1_089_994_752)] == [1, 4, 4096, 8192, 2**31]
    cfg = config.load(str(ROOT / "examples" / "recipes" / "qwen2.5-72b-8xh100.yaml"), {})
    cfg, p, _ = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
    s = shape("Qwen/Qwen2.5-72B-Instruct")
    assert sum(s.tensors()) == sum(s.tensors(fused=True)) == s.params == 72_706_203_648
    part = s.params // 8
    assert part == 9_088_275_456 and cfg.train.zero_stage == 3 and cfg.train.optimizer_offload == "on"
    assert p.pinned["optimizer (offloaded)"] == 8 * (32 * GIB + 9 * 4 * GIB + 512 * 2**20) == 548 * GIB
    assert p.pageable["optimizer states (offloaded)"] == 8 * 12 * part
    assert round(p.host_total / GIB, 1) == 1360.6 and "with the pinned, 1360.6 GiB of 2048" in p.table()
    # the node must hold it: 1,400 GiB of host memory (90%: 1,260) is refused in one line, before any engine
    with pytest.raises(ConfigError, match=r"needs \d+ GiB of host memory per node \(\d+ GiB of it pinned"):
        plan.dry_run(
            config.load(str(ROOT / "examples" / "recipes" / "qwen2.5-72b-8xh100.yaml"), {}),
            nproc=8,
            nnodes=1,
            gpu_gib=plan.DEFAULT_GPU_GIB,
            host_gib=1400,
        )
    # the 7B reference under ZeRO-2: every rank pins a whole copy, tensor by tensor - 1.9x its bytes
    s7 = shape("Qwen/Qwen2.5-7B-Instruct")
    cfg, p = plan.decide(
        gpu_config("Qwen/Qwen2.5-7B-Instruct", 8, **{"algo.kl_coef": 0.01}),
        s7,
        device=H100,
        host=NODE,
        world=8,
        local=8,
        on_cpu=False,
    )
    assert cfg.train.zero_stage == 2
    assert p.pinned["reference"] == 8 * sum(plan.pinned_bytes(n * 2) for n in s7.tensors())
    assert 1.85 < p.pinned["reference"] / (8 * s7.params * 2) < 1.95


@pytest.mark.fast
def test_plan_respects_what_the_user_set():
    s = shape("Qwen/Qwen2.5-7B-Instruct")
    cfg = gpu_config("Qwen/Qwen2.5-7B-Instruct", 8, **{"model.gradient_checkpointing": True})
    cfg, p = plan.decide(cfg, s, device=H100, host=NODE, world=8, local=8, on_cpu=False)
    assert cfg.train.max_tokens_per_micro_batch == 8192 and not p.choices  # fits with checkpointing: nothing to do
    cfg = gpu_config("Qwen/Qwen2.5-7B-Instruct", 8, **{"train.max_tokens_per_micro_batch": 8192})
    cfg, p = plan.decide(cfg, s, device=H100, host=NODE, world=8, local=8, on_cpu=False)
    assert cfg.model.gradient_checkpointing and cfg.sources["model.gradient_checkpointing"] == "memory plan"
    pinned = {
        "model.gradient_checkpointing": False,
        "train.max_tokens_per_micro_batch": 8192,
        "train.zero_stage": 2,
        "train.optimizer_offload": "off",
        "train.param_offload": "off",
    }
    with pytest.raises(
        ConfigError,
        match="no setting fits: phase train needs .*set model.gradient_checkpointing true, "
        "a smaller train.max_tokens_per_micro_batch, train.zero_stage 3, "
        "train.optimizer_offload on, or",
    ):
        plan.decide(
            gpu_config("Qwen/Qwen2.5-7B-Instruct", 8, **pinned),
            s,
            device=H100,
            host=NODE,
            world=8,
            local=8,
            on_cpu=False,
        )


@pytest.mark.fast
def test_big_models_plan_with_tensor_parallel_or_offload_and_72b_on_one_gpu_is_refused():
    s = shape("Qwen/Qwen2.5-32B-Instruct")
    cfg, p = plan.decide(
        gpu_config("Qwen/Qwen2.5-32B-Instruct", 8), s, device=H100, host=NODE, world=8, local=8, on_cpu=False
    )
    assert p.fits and cfg.rollout.tensor_parallel_size == 2 and cfg.train.optimizer_offload == "on"
    assert p.rows["vLLM weights"]["generate"] == s.vllm_rank_params(2) * 2  # ~ s.params * 2 // 2
    with pytest.raises(ConfigError, match=r"vLLM's weights alone are 135\.4 GiB.*rollout.tensor_parallel_size 2"):
        plan.decide(
            gpu_config("Qwen/Qwen2.5-72B-Instruct", 1),
            shape("Qwen/Qwen2.5-72B-Instruct"),
            device=80 * GIB,
            host=NODE,
            world=1,
            local=1,
            on_cpu=False,
        )
    with pytest.raises(ConfigError, match="pinned host memory"):  # 72B's optimizer in 256 GiB of host memory
        plan.decide(
            gpu_config("Qwen/Qwen2.5-72B-Instruct", 8),
            shape("Qwen/Qwen2.5-72B-Instruct"),
            device=H100,
            host=256 * GIB,
            world=8,
            local=8,
            on_cpu=False,
        )


@pytest.mark.fast
def test_cpu_runs_are_checked_not_decided():
    cfg = recipe.auto_dtype(config.load(None, {}), on_cpu=True)
    s = shape("demo")
    cfg2, p = plan.decide(cfg, s, device=20 * GIB, host=24 * GIB, world=1, local=1, on_cpu=True)
    assert cfg2 is cfg and p.fits and all(v["train"] for k, v in p.rows.items() if k.startswith("vLLM"))
    with pytest.raises(ConfigError, match="GiB of host memory per rank"):
        plan.decide(
            cfg, shape("Qwen/Qwen2.5-72B-Instruct"), device=20 * GIB, host=24 * GIB, world=1, local=1, on_cpu=True
        )


def test_the_plan_counts_sandboxed_programs_and_names_them_when_they_do_not_fit(monkeypatch):
    """code_tests runs a program a reward worker at once, up to sandbox.slots() on the node, each
    holding at most code_tests.ceiling (tests/test_sandbox_hostile.py holds programs to that): the
    plan counts them in the generate phase, beside the engines, and a node they would overfill is
    refused in one line naming the knobs."""
    from hybridrl.data import code_tests

    monkeypatch.setenv("HYBRIDRL_SANDBOX_SLOTS", "2")
    cfg = recipe.auto_dtype(config.load(None, {"reward.fn": "code_tests", "reward.workers": 4}), on_cpu=True)
    _, p = plan.decide(cfg, shape("demo"), device=20 * GIB, host=24 * GIB, world=1, local=1, on_cpu=True)
    assert p.rows["sandboxed programs"] == {"generate": 2 * code_tests.ceiling()}  # 2 slots of 4 workers
    assert (
        "sandboxed programs"
        not in plan.decide(
            recipe.auto_dtype(config.load(None, {}), on_cpu=True),
            shape("demo"),
            device=20 * GIB,
            host=24 * GIB,
            world=1,
            local=1,
            on_cpu=True,
        )[1].rows
    )
    monkeypatch.setenv("HYBRIDRL_SANDBOX_SLOTS", "32")
    with pytest.raises(ConfigError, match="fewer sandboxed programs at once .*HYBRIDRL_SANDBOX_SLOTS, reward.workers"):
        plan.decide(cfg, shape("demo"), device=4 * GIB, host=24 * GIB, world=1, local=1, on_cpu=True)
    # a GPU node: pageable host memory beside the pinned, in the table `hybridrl plan` prints
    gpu = gpu_config("Qwen/Qwen2.5-7B-Instruct", 8, **{"reward.fn": "code_tests", "reward.workers": 4})
    _, p2 = plan.decide(gpu, shape("Qwen/Qwen2.5-7B-Instruct"), device=H100, host=NODE, world=8, local=8, on_cpu=False)
    assert p2.pageable["sandboxed programs"] == 32 * code_tests.ceiling()  # 8 ranks x 4 workers, 32 slots
    assert "sandboxed programs 34.0" in p2.table()


@pytest.mark.vllm
def test_cuda_graph_sizes_are_bounded_by_max_num_seqs():
    """Issue 59: the largest capture is max_num_seqs itself, also where it is not a multiple of 8 (a
    decode step of 20 sequences with captures up to 16 ran eagerly)."""
    assert plan.capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert plan.capture_sizes(3) == [1, 2, 3]
    assert plan.capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert max(plan.capture_sizes(4096)) == plan.GRAPH_SIZES_MAX
    from hybridrl.engines import vllm_compat

    kw = vllm_compat.engine_kwargs(
        on_cpu=False, kv_cache_bytes=1 << 30, gpu_memory_utilization=0.5, max_num_seqs=20, enforce_eager=False
    )
    assert kw["compilation_config"] == {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 20]}
    assert "compilation_config" not in vllm_compat.engine_kwargs(
        on_cpu=False, kv_cache_bytes=0, gpu_memory_utilization=0.5, max_num_seqs=20
    )


@pytest.mark.fast
def test_gpus_decode_with_cuda_graphs_unless_set():
    assert not gpu_config("Qwen/Qwen2.5-7B-Instruct", 8).rollout.enforce_eager
    assert gpu_config("Qwen/Qwen2.5-7B-Instruct", 8, **{"rollout.enforce_eager": True}).rollout.enforce_eager
    assert gpu_config("Qwen/Qwen2.5-7B-Instruct", 8, **{"model.lora_rank": 8}).rollout.enforce_eager


@pytest.mark.fast
def test_optimizer_and_param_offload_reach_deepspeed():
    from hybridrl.engines.zero_engine import ds_config

    cfg = config.load(None, {"train.optimizer_offload": "on", "train.param_offload": "on", "train.zero_stage": 3})
    zero = ds_config(cfg, bf16=True)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    zero = ds_config(config.load(None, {"train.optimizer_offload": "auto"}), bf16=True)["zero_optimization"]
    assert "offload_optimizer" not in zero and "offload_param" not in zero


@pytest.mark.fast
@pytest.mark.parametrize(
    "name",
    [
        "qwen2.5-7b-8xh100",
        "qwen2.5-14b-8xh100",
        "qwen2.5-32b-8xh100",
        "qwen2.5-72b-8xh100",
        "qwen3-30b-a3b-8xh100",
        "qwen2.5-7b-16k-8xh100",
        "qwen2.5-32b-8k-8xh100",
        "qwen3-32b-to-8b-distill-8xh100",
        "qwen2.5-7b-to-1.5b-distill-8xh100",
        "qwen3-30b-a3b-to-4b-distill-8xh100",
        "qwen2.5-vl-7b-8xh100",
        "qwen3-vl-8b-8xh100",
    ],
)
def test_recipes_fit_8xh100(name):
    """`hybridrl plan --config examples/recipes/NAME.yaml --nproc 8`, in process. The long-answer
    recipes (16k, 8k) keep generation to two waves, one full-length sequence per micro-batch."""
    cfg = config.load(str(ROOT / "examples" / "recipes" / f"{name}.yaml"), {})
    cfg, p, lines = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
    assert p.fits, p.table()
    assert p.peak[1] <= H100 and p.pinned_total <= 0.9 * NODE
    assert cfg.rollout.sleep_level == 2 and not cfg.rollout.enforce_eager
    assert p.waves <= 2, p.table()
    if "k-8xh100" in name:  # 16k, 8k
        assert cfg.rollout.max_new_tokens >= 8192 and p.knobs.mb_tokens == cfg.rollout.max_model_len
        assert cfg.model.gradient_checkpointing


@pytest.mark.fast
def test_the_plan_counts_a_teacher_and_refuses_one_that_cannot_fit():
    """algo.teacher's own shape in its own phase: its weights (a layer at a time under ZeRO-3, whole
    under ZeRO-2), its forward's activations, its pinned shards. Qwen3-32B into Qwen3-8B fits 8x80 GiB
    with the teacher sharded; a 235B teacher of a 0.6B student on one GPU is refused naming the teacher."""
    cfg = config.load(str(ROOT / "examples" / "recipes" / "qwen3-32b-to-8b-distill-8xh100.yaml"), {})
    cfg, p, lines = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
    assert p.fits and "teacher" in p.table().splitlines()[1] and p.knobs.teacher.params > 30e9
    assert p.rows["teacher"]["teacher"] == 2 * p.knobs.teacher.layer_params * 2  # ZeRO-3: a layer at a time
    assert p.rows["activations"]["teacher"] > 0 and p.pinned["teacher"] >= p.knobs.teacher.params * 2
    assert set(p.rows["teacher"]) == {"teacher"}  # nothing of it on the device in any other phase
    big = config.load(None, {"model.path": "Qwen/Qwen3-0.6B", "algo.teacher": "Qwen/Qwen3-235B-A22B"})
    with pytest.raises(config.ConfigError, match=r"^no setting fits the teacher: .* smaller algo.teacher$"):
        plan.dry_run(big, nproc=1, nnodes=1, gpu_gib=80, host_gib=plan.DEFAULT_HOST_GIB)


def test_the_full_vocabulary_divergence_plans_the_teachers_head_and_hidden_states():
    """algo.distill_loss full: the teacher's head beside the policy in the train phase with a
    micro-batch of its hidden states, the step's hidden states ([rows, max_model_len, hidden]) in
    host memory. The 32B -> 8B recipe still fits 8x80 GiB."""
    recipe_path = str(ROOT / "examples" / "recipes" / "qwen3-32b-to-8b-distill-8xh100.yaml")
    cfg = config.load(recipe_path, {"algo.distill_loss": "full"})
    cfg, p, _ = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
    ts, k = p.knobs.teacher, p.knobs
    assert p.fits, p.table()
    assert p.rows["teacher head (full KL)"] == {"train": (ts.vocab + k.mb_tokens) * ts.hidden * 2}
    assert p.pageable["teacher hidden states"] == 8 * (64 // 8 * 4) * 4096 * 5120 * 2  # 8 ranks' [32, 4096, 5120]
    assert "teacher hidden states 10.0" in p.table()


def hybridrl(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hybridrl", *args], capture_output=True, text=True, timeout=timeout)


def test_plan_command_prints_the_7b_table_and_refuses_72b_on_one_gpu():
    out = hybridrl("plan", "--model", "Qwen/Qwen2.5-7B-Instruct", "--nproc", "8")
    assert out.returncode == 0, out.stderr
    assert "memory plan per GPU: 79.2 GiB; 8 rank(s), ZeRO-2" in out.stdout and "(fits)" in out.stdout
    assert "memory plan: train.max_tokens_per_micro_batch=4096" in out.stdout  # the recipe says who chose it
    out = hybridrl("plan", "--model", "Qwen/Qwen2.5-72B-Instruct", "--nproc", "1", "--gpu-mem-gib", "80")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "rollout.tensor_parallel_size 2" in out.stderr


def test_a_run_that_cannot_fit_stops_before_any_engine(tmp_path):
    """On CPU the plan checks the node's memory: a 72B config (with the demo's tokenizer, no weights)
    stops `hybridrl train` in one line, before DeepSpeed or vLLM are built."""
    model = tmp_path / "big"
    model.mkdir()
    demo = ROOT / "hybridrl" / "demo_model"
    for f in demo.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (model / f.name).write_bytes(f.read_bytes())
    (model / "config.json").write_text((CONFIGS / "qwen2.5-72b.json").read_text())
    out = hybridrl(
        "train",
        "--model",
        str(model),
        "--data",
        "demo",
        "--reward",
        "arithmetic",
        "--log.run_dir",
        str(tmp_path / "run"),
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "GiB of host memory per rank" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.fast
@pytest.mark.parametrize("name,tp,waves", [("qwen2.5-32b-8xh100", 2, 5), ("qwen2.5-72b-8xh100", 4, 5)])
def test_32b_and_72b_with_8k_answers_plan_in_waves(name, tp, waves):
    """Issue 49: `hybridrl plan --config NAME.yaml --rollout.max_new_tokens 8192 --rollout.max_model_len 9216
    --nproc 8` was refused ("phase generate needs 110.6 of 79.2 GiB") because the KV cache had to hold half
    of the step's sequences at full length. The KV cache is throughput, not fit: it may shrink to a few
    full-length sequences per engine, and the plan says how many waves the step then takes."""
    cfg = config.load(
        str(ROOT / "examples" / "recipes" / f"{name}.yaml"),
        {"rollout.max_new_tokens": 8192, "rollout.max_model_len": 9216},
    )
    cfg, p, _ = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
    assert p.fits and cfg.rollout.tensor_parallel_size == tp, p.table()
    k = p.knobs
    # a rank's share of one 9216-token sequence's KV: 2 (K, V) x layers x its KV heads x 128 x 2 bytes
    s = shape(cfg.model.path)
    assert k.seq_kv == 9216 * 2 * s.layers * (s.kv_heads // tp) * 128 * 2
    # the step's sequences per engine: prompts_per_step over the 8 / tp engines, x 8 samples
    assert k.seqs == cfg.train.prompts_per_step // (8 // tp) * 8
    assert k.kv_floor <= p.kv < k.seqs * k.seq_kv  # between the longest sequences running and all of them
    assert p.waves == waves == -(-k.seqs // (p.kv // k.seq_kv))
    assert f"run in up to {waves} waves of {p.kv // k.seq_kv}" in p.table()


@pytest.mark.fast
def test_the_kv_floor_keeps_the_longest_sequences_running():
    from hybridrl.core import memory

    # at least KV_FLOOR_SEQS full-length sequences, or all of the step's where it has fewer
    assert memory.kv_floor(128, 3 * GIB) == memory.KV_FLOOR_SEQS * 3 * GIB
    assert memory.kv_floor(2, 3 * GIB) == 6 * GIB
    # 128 sequences, 30 at once: 5 waves; all at once: 1, and nothing to say
    assert memory.waves(128, GIB, 30 * GIB) == 5 and memory.waves(128, GIB, 200 * GIB) == 1
    assert memory.describe_waves(128, GIB, 200 * GIB) == ""
    assert "up to 5 waves of 30" in memory.describe_waves(128, GIB, 30 * GIB)
    # a step that fits in two waves keeps the plan it had before (half of its sequences at once, the old
    # floor): 7B with 16k answers on 8 x 80 GiB
    cfg = gpu_config("Qwen/Qwen2.5-7B-Instruct", 8, **{"rollout.max_new_tokens": 16384})
    cfg, p = plan.decide(cfg, shape("Qwen/Qwen2.5-7B-Instruct"), device=H100, host=NODE, world=8, local=8, on_cpu=False)
    assert p.fits and p.waves == 2 and cfg.model.gradient_checkpointing and cfg.train.zero_stage == 2


@pytest.mark.fast
def test_sequence_parallelism_is_planned_where_one_sequence_fits_nowhere_else():
    """72B with 32k-token sequences: one sequence's activations under checkpointing, 69 GiB per GPU,
    fit beside ZeRO-3 and the optimizer in host memory only split over 2 ranks (Ulysses, the
    trainer's train.sequence_parallel_size), before the parameters would go to host memory too. A
    sequence-level loss cannot be split: with the parameters in host memory too, one 32k sequence and
    the LM head's whole-vocabulary weight gradient (7 GiB) need 85 GiB, so the plan refuses in one line."""
    over = {"rollout.max_new_tokens": 31744, "rollout.max_model_len": 32768}
    cfg = config.load(str(ROOT / "examples" / "recipes" / "qwen2.5-72b-8xh100.yaml"), over)
    cfg, p, _ = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
    assert p.fits and cfg.train.sequence_parallel_size == 2 and cfg.train.param_offload == "off", p.table()
    # a rank holds half of the longest sequence: the budget the trainer is given is that half
    assert cfg.train.max_tokens_per_micro_batch == p.knobs.mb_tokens == 16384
    assert "SP 2" in p.table() and "train.sequence_parallel_size=2" in p.table()
    cfg = config.load(
        str(ROOT / "examples" / "recipes" / "qwen2.5-72b-8xh100.yaml"), {**over, "algo.loss_agg": "seq_mean_token_mean"}
    )
    with pytest.raises(ConfigError, match="phase train needs 85.3 of 79.2 GiB per GPU at best"):
        plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
    # a run whose sequences fit one rank keeps SP 1, and is given a budget of its longest sequence
    cfg = config.load(str(ROOT / "examples" / "recipes" / "qwen2.5-7b-16k-8xh100.yaml"), {})
    cfg, p, _ = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
    assert cfg.train.sequence_parallel_size == 1 and cfg.train.max_tokens_per_micro_batch == 17408


# --- mixtures of experts and Qwen3 -------------------------------------------------------------------
QWEN3 = (
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "qwen3-14b",
    "qwen3-32b",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
)


@pytest.mark.fast
def test_moe_counts_every_expert_for_memory_and_top_k_for_activations():
    """Qwen3-30B-A3B by hand (config.json: hidden 2048, 48 layers, 32 query / 4 KV heads of 128, q/k
    norms, 128 experts of width 768, 8 per token, vocabulary 151936, untied). The plan used to read
    intermediate_size (6144) as a dense MLP: 3.34B parameters, 6.2 GiB of bf16 weights."""
    s = shape("Qwen/Qwen3-30B-A3B")
    attention = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128 + 2 * 2048  # q, o; k, v; q/k norms; two RMSNorms
    experts = 128 * 3 * 2048 * 768  # gate, up, down of every expert
    router = 128 * 2048
    assert s.layer_params == attention + experts + router == 623_120_640
    embed = 2 * 151936 * 2048  # embedding and LM head
    assert s.params == embed + 48 * s.layer_params + 2048 == 30_532_122_624  # Qwen's model card: 30.5B
    assert s.active_params == embed + 48 * (attention + 8 * 3 * 2048 * 768 + router) + 2048 == 3_353_032_704  # 3.3B
    # per token and layer, bfloat16: (4 x 2 + 8) x hidden, 2 x 2 x (query width 4096 + KV width 512), the
    # q/k norms' float32 input and output (4 + 2) x (4096 + 512), and for each of the 8 experts its four
    # MLP widths, the gathered input and the expert's output (2 x 2 x hidden) and 32 bytes of int64
    # indices; the router's float32 probabilities
    assert (
        s.layer_activations(2) == 16 * 2048 + 4 * 4608 + 6 * 4608 + 8 * (8 * 768 + 4 * 2048 + 32) + 4 * 128 == 194_304
    )
    assert s.all_layer_activations(2) == 48 * 194_304
    assert s.mlp_width == 8 * 768 and s.describe() == "30.53B parameters, 3.35B active with 8 of 128 experts per token"


@pytest.mark.fast
def test_vllm_weights_per_rank_as_vllm_lays_them_out_under_tp():
    """Qwen3-30B-A3B in a TP engine, by hand: q, o, every expert (on its MLP width: vLLM's default,
    expert parallelism off), the embedding and the LM head split over the ranks; its 4 KV heads split
    at TP 2, one per rank at TP 8 (replicated); norms and router whole on each. P / TP undercounted the
    router and the replicated KV heads; at TP 1 both are every parameter."""
    s = shape("Qwen/Qwen3-30B-A3B")
    assert s.vllm_rank_params(1) == s.params
    h, router, vocab = 2048, 128 * 2048, 151936
    norms = 2 * 128 + 2 * h  # q/k norms (head_dim each), the two RMSNorms
    tp2 = h * 2048 + 2 * h * 256 + 2048 * h + norms + 128 * 3 * h * 768 // 2 + router
    assert s.vllm_rank_params(2) == 48 * tp2 + 2 * vocab * h // 2 + h == 15_272_458_240
    tp8 = h * 512 + 2 * h * 128 + 512 * h + norms + 128 * 3 * h * 768 // 8 + router
    assert s.vllm_rank_params(8) == 48 * tp8 + 2 * vocab * h // 8 + h == 3_840_292_864
    assert s.vllm_rank_params(8) > s.params / 8  # what the plan used to count
    for name in QWEN3:
        assert shape(f"Qwen/{name}").vllm_rank_params(1) == shape(f"Qwen/{name}").params


@pytest.mark.fast
@pytest.mark.parametrize("name", QWEN3)
def test_qwen3_params_match_transformers(name):
    """The shipped Qwen3 configs, dense and MoE, against transformers' own model on the meta device,
    and against the published totals (model cards: 0.6B with tied embeddings ... 235B)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = CONFIGS / f"{name}.json"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)))
    s = Shape.from_config(json.loads(path.read_text()))
    assert s.params == sum(p.numel() for p in model.parameters())
    # what is pinned tensor by tensor (the reference) covers every expert and the q/k norms
    assert (
        sorted(s.tensors()) == sorted(p.numel() for p in model.parameters()) and sum(s.tensors(fused=True)) == s.params
    )
    published = {
        "qwen3-0.6b": 0.6,
        "qwen3-1.7b": 1.7,
        "qwen3-4b": 4.0,
        "qwen3-8b": 8.2,
        "qwen3-14b": 14.8,
        "qwen3-32b": 32.8,
        "qwen3-30b-a3b": 30.5,
        "qwen3-235b-a22b": 235,
    }
    assert s.params / 1e9 == pytest.approx(published[name], abs=0.06 if s.params < 1e11 else 0.5)
    assert s.head_dim == 128 and s.qk_norm == 2 * 128
    if "-a" in name:  # active: 3.3B and 22B
        assert s.active_params / 1e9 == pytest.approx({"qwen3-30b-a3b": 3.3, "qwen3-235b-a22b": 22}[name], abs=0.25)


@pytest.mark.fast
def test_moe_layouts_match_transformers():
    """Qwen2-MoE (a shared expert, dense layers by mlp_only_layers and decoder_sparse_step), Mixtral and
    OLMoE, tiny: the plan's total against transformers', and its active count against the same model
    with only top_k experts (whose router is then smaller by the other experts' rows)."""
    import torch
    import transformers

    cases = [
        transformers.Qwen2MoeConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        ),
        transformers.MixtralConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        transformers.OlmoeConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
        ),
        transformers.Qwen3MoeConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
        ),
    ]
    for conf in cases:
        s = Shape.from_config(conf.to_dict())
        count = {}
        for key, experts in (("all", s.experts), ("active", s.top_k)):
            c = copy.deepcopy(conf)
            setattr(c, "num_local_experts" if conf.model_type == "mixtral" else "num_experts", experts)
            with torch.device("meta"):
                count[key] = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(c).parameters())
        assert s.params == count["all"], conf.model_type
        assert s.active_params == count["active"] + s.moe_layers * (s.experts - s.top_k) * s.hidden, conf.model_type
    assert Shape.from_config(cases[0].to_dict()).moe_layers == 1  # layers 1 and 5 by the step, 3 dense: 1
    assert (
        Shape.from_config(cases[1].to_dict()).describe() == "0.20M parameters, 0.18M active with 2 of 4 "
        "experts per token"
    )
    with pytest.raises(ConfigError, match="does not know the experts of model_type 'deepseek_v3'"):
        Shape.from_config({**cases[0].to_dict(), "model_type": "deepseek_v3", "n_routed_experts": 8})


def test_moe_activations_match_what_autograd_saves():
    """The per-layer coefficient against the bytes autograd saves in transformers' own forward
    (bfloat16, sdpa, the default grouped_mm experts): tiny Qwen3 dense, Qwen3-MoE and Qwen2-MoE with a
    shared expert and a dense layer, the difference a layer makes (what the embedding and the final
    norm save cancels)."""
    import torch
    import transformers

    def saved(conf) -> float:  # bytes per token that autograd keeps for the backward, parameters aside
        torch.manual_seed(0)
        model = transformers.AutoModel.from_config(conf, attn_implementation="sdpa").to(torch.bfloat16).train()
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                kept[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=torch.randint(0, conf.vocab_size, (1, 256)))
        return sum(kept.values()) / 256

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    for cls, kw, layers in (
        (transformers.Qwen3Config, dict(head_dim=64), (1, 2)),
        (transformers.Qwen3MoeConfig, dict(head_dim=64, **moe), (1, 2)),
        (transformers.Qwen2MoeConfig, dict(shared_expert_intermediate_size=96, mlp_only_layers=[1], **moe), (1, 3)),
    ):
        lo, hi = (cls(num_hidden_layers=n, **common, **kw) for n in layers)
        measured = saved(hi) - saved(lo)
        planned = Shape.from_config(hi.to_dict()).all_layer_activations(2) - Shape.from_config(
            lo.to_dict()
        ).all_layer_activations(2)
        assert measured == pytest.approx(planned, rel=0.01), cls.__name__


@pytest.mark.fast
def test_qwen3_30b_a3b_plans_on_8_gpus_and_235b_is_refused():
    """`hybridrl plan --model Qwen/Qwen3-30B-A3B --nproc 8`, in process: vLLM holds every expert (split
    over its TP ranks), the trainer's ZeRO-3 shard all of them too; 235B-A22B does not fit one node."""
    cfg = config.load(None, {"model.path": "Qwen/Qwen3-30B-A3B"})
    cfg, p, lines = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
    s = shape("Qwen/Qwen3-30B-A3B")
    assert p.fits, p.table()
    tp = cfg.rollout.tensor_parallel_size
    assert p.rows["vLLM weights"]["generate"] == s.vllm_rank_params(tp) * 2 > 28 * GIB * 2 // tp
    assert p.rows["trainer params"]["train"] == s.params * 2 // 8 and cfg.train.zero_stage == 3
    assert p.rows["vLLM activations"]["generate"] < 2 * GIB  # by the 3.35B active parameters, not the 30.5B
    assert any("30532.12M parameters" in line for line in lines)
    # TP 2: each rank holds half of every expert (768 / 2 columns), about half of the weights (the
    # router and norms whole on each: test_vllm_weights_per_rank_as_vllm_lays_them_out_under_tp)
    k = plan.knobs(cfg, s, world=8, local=8, on_cpu=False, tp=2)
    assert plan.build(s, k, device=H100, host=NODE).rows["vLLM weights"]["generate"] == 2 * 15_272_458_240
    cfg = config.load(None, {"model.path": "Qwen/Qwen3-235B-A22B"})
    # what binds after the weights (the GPUs, or the optimizer's 3.5 TiB in host memory) is the rest of the line
    with pytest.raises(
        ConfigError,
        match=r"^the weights alone are 437\.9 GiB in bfloat16 \(235\.09B parameters, "
        r"22\.19B active.*held twice .*: use more",
    ):
        plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=80, host_gib=plan.DEFAULT_HOST_GIB)


@pytest.mark.fast
def test_qwen3_dense_plans_with_its_own_head_dim():
    """Qwen3-0.6B: 16 heads of 128 on a hidden size of 1024 (not 1024 / 16 = 64)."""
    s = shape("Qwen/Qwen3-0.6B")
    assert (s.q_dim, s.kv_dim, s.hidden) == (2048, 1024, 1024) and s.tied and s.active_params == s.params
    cfg, p = plan.decide(gpu_config("Qwen/Qwen3-0.6B", 1), s, device=H100, host=NODE, world=1, local=1, on_cpu=False)
    assert p.fits
    kv_per_token = 2 * 28 * 8 * 128 * 2  # K and V, 28 layers, 8 KV heads of 128, bf16
    need = 64 * 8 * 1536 * kv_per_token  # 64 prompts x 8 samples of 1536 tokens, one engine
    assert p.rows["vLLM KV cache"]["generate"] <= 2 * need


@pytest.mark.fast
def test_a_lora_plan_counts_the_base_weights_vllm_keeps_asleep():
    # LoRA hands vLLM the adapter only, so vLLM sleeps at level 1 and pins a host copy of its base
    # weights; the plan (`hybridrl plan` and a run's) must be built at that level, not the default 2
    cfg = config.load(None, {"model.path": "Qwen/Qwen2.5-7B-Instruct", "model.lora_rank": 16})
    cfg, p, _ = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
    assert cfg.rollout.sleep_level == 1 and "model.lora_rank" in cfg.sources["rollout.sleep_level"]
    assert p.pinned.get("vLLM weights (sleep level 1)", 0) > 8 * 14 * GIB  # 7.6B bfloat16 weights per rank
    full = plan.dry_run(
        config.load(None, {"model.path": "Qwen/Qwen2.5-7B-Instruct"}),
        nproc=8,
        nnodes=1,
        gpu_gib=plan.DEFAULT_GPU_GIB,
        host_gib=plan.DEFAULT_HOST_GIB,
    )[1]
    assert "vLLM weights (sleep level 1)" not in full.pinned  # level 2 discards them

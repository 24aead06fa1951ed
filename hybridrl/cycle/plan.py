"""The memory plan: what each phase of a step holds on every GPU, from the model's config alone.

One plan for both engines and every phase of the step (generate, hand-off, reference, critic
values, train), per GPU, and the pinned host memory of the node. It is arithmetic on the model's
config.json (layers, hidden size, MLP width, heads, vocabulary) and the run's settings: no
weights are read and no device is touched, so `hybridrl plan` runs it on any machine and
`hybridrl train` runs it before any engine starts. Where the user left a knob unset, `decide`
picks the cheapest setting that fits, in the order peers reach for them: smaller micro-batches,
gradient checkpointing, ZeRO-3, the optimizer in host memory (DeepSpeed's ZeRO-Offload), the
parameters in host memory (ZeRO-3 only). A run that fits in none stops in one line naming what
to change.

What each term is (per GPU rank; P parameters, T of them trained, b bytes per weight, N ranks
of the trainer's data parallelism, TP vLLM's tensor-parallel size):
- trainer: parameters P b (ZeRO-3: / N), gradients T b / N plus DeepSpeed's reduce bucket (b = 4
  for both under train.precision=amp, which also keeps autocast's P x 2 bytes of weight copies), fp32
  master weights and Adam's two moments 12 T / N, and at the optimizer step a fp32 gradient
  partition and a flattened copy of the gradients (4 + b) T / N (after the backward has freed the
  activations: on CPU at the 134M shape the step, not the backward, was the peak); the optimizer offloaded:
  the last three live in host memory, partly pinned (`build`'s pinned/pageable: what DeepSpeed pins,
  each buffer rounded up to a power of two as torch's pinned allocator does, `pinned_bytes`).
- activations of one micro-batch of `train.max_tokens_per_micro_batch` tokens: per token and
  layer (4 b + 8) hidden + 2 b (query width + KV width) + 4 b MLP width without gradient
  checkpointing (the 8: the RMSNorms' float32 copies; a mixture-of-experts layer: the MLPs of a
  token's top-k experts and the router's probabilities, Shape.layer_activations), b hidden with it
  (each layer's input) plus one layer recomputed;
  one more layer's worth for the backward's working set; the fused LM head's chunk of logits
  (train.logprob_chunk x vocabulary x (b + 8); on CPU the torch path's five buffers, 2 b + 12), never
  the full logits, and the head's weight gradient, whole on every rank (vocabulary x hidden x (4 + b):
  its float32 accumulator and a low-precision copy; from 8k tokens on the 0.5B shape the backward, not
  the step, is the trainer's peak, bench/plan_check.py). These coefficients were
  measured by counting the tensors autograd saves in transformers' Qwen2, Qwen3 and Qwen3-MoE (sdpa
  attention; tests/test_plan.py counts them again);
  bench/plan_check.py compares the whole trainer's measured peak with the plan.
- vLLM: weights ~P b / TP (Shape.vllm_rank_params: every expert split over the TP ranks, the
  router, norms and too few KV heads whole on each), a KV cache for the step's
  sequences (memory.kv_cache_need, / TP),
  activations 1 GiB + 10% of the active weights + the sampler's float32 logits rows, and with CUDA
  graphs their memory pool (an estimate: the largest captured batch's activations and a few
  MiB per captured size, for full and piecewise graphs). The graph pool, the model runner's
  persistent buffers and TP communicators' buffers live outside vLLM's sleep-mode pool: they stay
  through every phase (asleep_bytes).
- ZeRO-3: up to DeepSpeed's stage3_max_live_parameters (1e9) gathered while a forward or backward
  runs, and the hand-off's bucket of gathered parameters.
- reference: under ZeRO-2 a device copy of the weights for the phase (pinned in host memory
  between phases, one copy per rank); under ZeRO-3 its shard in pinned host memory, gathered a
  layer at a time. Critic: a second trainer of the same shape without the LM head.
- a vision-language model's vision tower (shape.Tower): its weights in P (vLLM's split over TP), its
  gradients and Adam states only for the part model.train_vision trains (off: none); its forward on
  a micro-batch's images (at most every token an image token; frozen: without gradients, a block at
  a time) beside the trainer's activations, and vLLM's encoder profile and cache
  (max_num_batched_tokens' image tokens, or one image at max_pixels) beside vLLM's. Image tokens are
  tokens in the KV cache and the micro-batches: data.max_prompt_len counts them.
- the reserve (rollout.memory_margin_mb): CUDA context, NCCL buffers, allocator fragmentation.

On CPU the same arithmetic checks the host: both engines share the node's memory, vLLM never
sleeps and nothing is offloaded, so every term counts in every phase.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hybridrl.algorithms import estimator
from hybridrl.core import memory
from hybridrl.core.config import Config, ConfigError
from hybridrl.core.memory import GRAPH_SIZES_MAX, capture_sizes
from hybridrl.cycle.shape import Shape, info_of, read_config

GIB = memory.GIB
MIB = memory.MIB
REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements), which ds_config keeps
STAGE3_LIVE = 1_000_000_000  # DeepSpeed's default stage3_max_live_parameters: gathered ZeRO-3 parameters kept
SUB_GROUP = 1_000_000_000  # DeepSpeed's default sub_group_size: ZeRO-3 flattens a rank's fp32 partition in these
DEFAULT_GPU_GIB = 79.2  # an 80 GB H100 as CUDA reports it (torch.cuda.mem_get_info's total)
DEFAULT_HOST_GIB = 2048.0  # an 8-GPU H100 node (DGX H100: 2 TiB)


@dataclass
class Knobs:
    """The settings the plan reads, resolved (what `decide` may change is marked)."""

    world: int  # trainer ranks (data parallel)
    local: int  # ranks on this node
    tp: int
    zero: int  # decided
    b: int  # bytes per weight (2: bfloat16, 4: float32)
    ckpt: bool  # decided: gradient checkpointing
    mb_tokens: int  # decided: tokens of one micro-batch
    optimizer_offload: bool  # decided
    param_offload: bool  # decided (ZeRO-3)
    trained: int  # parameters with gradients (LoRA: the adapter's)
    reference: bool
    critic: bool
    sleep_level: int
    graphs: bool  # vLLM decodes with CUDA graphs
    max_num_seqs: int
    kv: int  # vLLM's KV cache bytes per rank: what the step's sequences need, with headroom
    kv_floor: int  # the least it may shrink to where memory is short (vLLM then runs the step in waves)
    chunk: int  # train.logprob_chunk
    bucket: int  # hand-off bucket bytes (ZeRO-3 gathers)
    reserve: int
    on_cpu: bool
    offload_states: str = "auto"  # train.offload_states
    seqs: int = 0  # sequences one vLLM engine generates in a step (0: not planned, CPU)
    seq_kv: int = 0  # KV bytes per rank of one of them at full rollout.max_model_len
    sp: int = 1  # decided: train.sequence_parallel_size (mb_tokens is then one rank's share of a micro-batch)
    wb: int = 0  # bytes per trainer weight and gradient where they differ from b (4: train.precision=amp)
    teacher: Shape | None = None  # algo.teacher's shape: a distillation run's frozen scorer, of its own size
    sandbox: int = 0  # host bytes the node's sandboxed programs may hold at once (rewards.sandbox_bytes)
    teacher_hidden: int = 0  # algo.distill_loss full: bytes of a rank's step of teacher hidden states (host)
    images: int = 0  # a vision-language model: the most image tokens the rank's step holds (a micro-batch: fewer)
    train_vision: str = "off"  # model.train_vision


@dataclass
class MemoryPlan:
    """Bytes per GPU by component and phase, and pinned host memory per node."""

    device: int  # bytes of one GPU (CPU: this rank's share of the node's memory)
    host: int  # bytes of the node's host memory
    rows: dict[str, dict[str, int]]  # component -> phase -> bytes
    pinned: dict[str, int]  # what sits in pinned host memory, per node (as torch's pinned allocator rounds it)
    knobs: Knobs
    choices: list[str] = field(default_factory=list)  # what the plan decided, and why
    pageable: dict[str, int] = field(default_factory=dict)  # offloaded states in ordinary host memory, per node

    PHASES = ("generate", "hand-off", "reference", "teacher", "values", "train")

    def total(self, phase: str) -> int:
        return sum(r.get(phase, 0) for r in self.rows.values())

    @property
    def peak(self) -> tuple[str, int]:
        return max(((p, self.total(p)) for p in self.PHASES), key=lambda x: x[1])

    @property
    def pinned_total(self) -> int:
        return sum(self.pinned.values())

    @property
    def host_total(self) -> int:  # the node's host memory the plan fills: pinned and pageable
        return self.pinned_total + sum(self.pageable.values())

    @property
    def kv(self) -> int:
        """vLLM's KV cache per rank as planned (shrunk towards knobs.kv_floor where memory is short)."""
        return self.rows.get("vLLM KV cache", {}).get("generate", 0)

    @property
    def waves(self) -> int:
        """Rounds of generation the step takes with this KV cache (memory.waves: an upper bound)."""
        return memory.waves(self.knobs.seqs, self.knobs.seq_kv, self.kv)

    @property
    def fits(self) -> bool:
        return self.peak[1] <= self.device and self.host_total <= self.host * 0.9

    def table(self, title: str = "") -> str:
        k = self.knobs
        where = "host (shared by the node's ranks)" if k.on_cpu else "GPU"
        head = (
            f"memory plan per {where}: {self.device / GIB:.1f} GiB; {k.world} rank(s), ZeRO-{k.zero}, TP {k.tp}, "
            + (f"SP {k.sp}, " if k.sp > 1 else "")
            + f"{'bfloat16' if k.b == 2 else 'float32'}"
            + (f" - {title}" if title else "")
        )
        phases = [p for p in self.PHASES if _shown(p, k)]
        width = max(len(n) for n in self.rows) + 2
        lines = [head, " " * width + "".join(f"{p:>11}" for p in phases)]
        for name, row in self.rows.items():
            if any(row.get(p) for p in phases):
                lines.append(f"{name:<{width}}" + "".join(f"{row.get(p, 0) / GIB:>11.2f}" for p in phases))
        lines.append(f"{'total (GiB)':<{width}}" + "".join(f"{self.total(p) / GIB:>11.2f}" for p in phases))
        phase, peak = self.peak
        lines.append(
            f"peak: {phase}, {peak / GIB:.1f} of {self.device / GIB:.1f} GiB "
            f"({'fits' if peak <= self.device else 'DOES NOT FIT'})"
        )
        if not k.on_cpu:  # what engine_cycle.plan_rollout gives vLLM: the engine serves its whole group
            graphs = f", CUDA graphs up to a batch of {max(capture_sizes(k.max_num_seqs))}" if k.graphs else ""
            lines.append(
                f"vLLM: rollout.max_num_seqs={k.max_num_seqs} per engine ({k.world // k.tp} engine(s) of TP "
                f"{k.tp}){graphs}"
            )
        waves = memory.describe_waves(k.seqs, k.seq_kv, self.kv)
        if waves:
            lines.append(
                f"KV cache: {self.kv / GIB:.2f} of the {k.seqs * k.seq_kv / GIB:.2f} GiB per GPU that every "
                f"sequence at full length needs: {waves}"
            )
        if self.pinned:
            parts = ", ".join(f"{n} {v / GIB:.1f}" for n, v in self.pinned.items() if v)
            lines.append(
                f"pinned host memory per node: {self.pinned_total / GIB:.1f} GiB of {self.host / GIB:.0f} "
                f"({parts}; each buffer rounded up to a power of two, as torch pins)"
            )
        if self.pageable:
            parts = ", ".join(f"{n} {v / GIB:.1f}" for n, v in self.pageable.items() if v)
            lines.append(
                f"pageable host memory per node: {sum(self.pageable.values()) / GIB:.1f} GiB ({parts}); "
                f"with the pinned, {self.host_total / GIB:.1f} GiB of {self.host / GIB:.0f}"
            )
        lines += [f"plan chose: {c}" for c in self.choices]
        return "\n".join(lines)


def _shown(phase: str, k: Knobs) -> bool:
    """A phase the run has: the reference's with a KL, the teacher's with algo.teacher, values with a critic."""
    return {"reference": k.reference, "teacher": k.teacher is not None, "values": k.critic}.get(phase, True)


# vLLM's default cudagraph_mode, FULL_AND_PIECEWISE: every size captured as a full and a piecewise graph
GRAPH_MODES = 2
BATCHED_TOKENS = 16384  # vLLM's default max_num_batched_tokens for the offline LLM class on a large GPU
NCCL_COMM = 256 * MIB  # an NCCL communicator's own device buffers (channels x peers x NCCL_BUFFSIZE), estimated


def graph_bytes(shape: Shape, b: int, max_num_seqs: int, tp: int, modes: int = GRAPH_MODES) -> int:
    """vLLM's CUDA-graph pool, estimated: per capture mode (vLLM's default captures full graphs for
    decode batches and piecewise graphs around attention, both into the pool) the largest captured
    batch's activations in one layer (its buffers are reused layer to layer) and a few MiB per
    captured batch size (1, 2, 4, 8, 16, ... every 8 up to min(max_num_seqs, 512))."""
    top = min(max_num_seqs or GRAPH_SIZES_MAX, GRAPH_SIZES_MAX)
    sizes = len(capture_sizes(top))
    per_seq = (shape.q_dim + 2 * shape.kv_dim + shape.hidden + 2 * shape.mlp_width) // tp * b + shape.vocab * 4 // tp
    return 64 * MIB + modes * (2 * MIB * sizes + top * per_seq)


def buffer_bytes(shape: Shape, b: int, tp: int) -> int:
    """What vLLM allocates outside its sleep-mode pool, besides the graphs, and so keeps on the device
    while asleep: the model runner's persistent input buffers (token ids, positions, the input
    embeddings of BATCHED_TOKENS tokens) and, under tensor parallelism, its two NCCL communicators'
    buffers (the group's device group and vLLM's own pynccl; custom and symmetric-memory all-reduce
    are off: vllm_compat.engine_kwargs and all_reduce_env)."""
    return BATCHED_TOKENS * (shape.hidden * b + 24) + (2 * NCCL_COMM if tp > 1 else 0)


def asleep_bytes(shape: Shape, b: int, max_num_seqs: int, tp: int, graphs: bool) -> int:
    """vLLM's device memory that a sleep does not release (graph pool and buffers): in every phase."""
    return (graph_bytes(shape, b, max_num_seqs, tp) if graphs else 0) + buffer_bytes(shape, b, tp)


def build(shape: Shape, k: Knobs, *, device: int, host: int) -> MemoryPlan:
    """The plan for settings `k` (pure arithmetic: tested by hand in tests/test_plan.py)."""
    P, T, b, N = shape.params, k.trained, k.b, k.world
    wb = k.wb or b  # the trainer's weights and gradients (amp: float32 under bfloat16 GEMMs)
    z3 = k.zero == 3
    params = P * wb // N if z3 else P * wb
    if z3 and k.param_offload:  # the shard lives in host memory; a layer or two is gathered at a time
        params = 2 * shape.layer_params * wb
    grads = T * wb // N + min(REDUCE_BUCKET, T) * wb
    states = 12 * T // N  # fp32 master weights + Adam's two moments, this rank's partition
    step_grads = (4 + wb) * T // N  # the step's fp32 gradient partition and flattened copy
    if k.optimizer_offload:  # gradients go to the host partition as they are reduced: only the bucket stays
        grads, states, step_grads = min(REDUCE_BUCKET, T) * wb, 0, 0
    tokens = k.mb_tokens
    per_layer = shape.layer_activations(b)
    fixed = (4 + b) * shape.hidden  # embedding output, final norm
    if k.ckpt:  # each layer's input, and one layer recomputed in the backward
        saved = tokens * (fixed + shape.layers * b * shape.hidden + per_layer)
    else:
        saved = tokens * (fixed + shape.all_layer_activations(b))
    backward = tokens * per_layer + shape.layer_params * b  # a layer's activation and weight gradients
    # a chunk's logits and their gradient; on CPU the torch path's workspace keeps five [chunk, vocab]
    # buffers (float32 log-softmax, softmax and scratch, the low-precision logits and gradient)
    head = min(k.chunk, tokens) * shape.vocab * ((2 * b + 12) if k.on_cpu else (b + 8))
    # the head's weight gradient, whole on every rank whatever the ZeRO stage: the fused path's float32
    # accumulator and one low-precision copy at a time (a chunk's product, then the one backward returns);
    # none where the head is frozen (LoRA; a frozen vision tower leaves it trained)
    vocab_grads = shape.vocab * shape.hidden * (4 + b) if T >= P - shape.vision_params else 0
    # amp: autocast's bfloat16 copies of the weights, which the backward keeps (ZeRO-3: the gathered layers')
    casts = (2 * shape.layer_params if z3 else P) * b if wb != b else 0
    act = saved + backward + head + vocab_grads + casts
    fwd_only = tokens * per_layer + head  # a no-grad forward (log-probs, values): one layer at a time

    vllm_w = shape.vllm_rank_params(k.tp) * b  # every expert split over the TP ranks, the router on each
    # its activations scale with the weights a token runs through: a mixture of experts' active ones
    vllm_act = GIB + shape.active_params * b // k.tp // 10 + memory.sampler_bytes(k.max_num_seqs, shape.vocab)
    v = shape.vision
    if v:
        # the tower runs on the micro-batch's images (at most every token of it an image token) and hands
        # the language model their features; added to its activations, a bound where the tower is frozen
        # (its blocks are freed before the first layer runs)
        img = min(tokens, k.images)
        act += v.activations(img * v.merge, b, k.train_vision, k.ckpt) + img * v.outputs * b
        fwd_only += v.activations(img * v.merge, b) + img * v.outputs * b
        # vLLM's profile encodes its encoder budget's images at once (max_num_batched_tokens' worth, or one
        # image at max_pixels where that is more), and its encoder cache keeps as many tokens' features;
        # the tower whole on each rank (a bound: TP splits its projections)
        enc = max(BATCHED_TOKENS, v.image_tokens)
        vllm_act += v.activations(enc * v.merge, b) + enc * v.outputs * b
    graphs = graph_bytes(shape, b, k.max_num_seqs, k.tp) if k.graphs and not k.on_cpu else 0
    # vLLM while asleep: level 1 keeps its weights in host memory, level 2 drops them; on CPU it never sleeps
    awake = ("generate", "hand-off")
    vllm_phases = MemoryPlan.PHASES if k.on_cpu or k.sleep_level == 0 else awake
    rows: dict[str, dict[str, int]] = {}

    def row(name: str, value: int, phases) -> None:
        if value:
            rows[name] = {p: value for p in phases}

    row("vLLM weights", vllm_w, vllm_phases)
    row("vLLM KV cache", k.kv, ("generate",) if not k.on_cpu and k.sleep_level else MemoryPlan.PHASES)
    row("vLLM activations", vllm_act, ("generate",) if not k.on_cpu else MemoryPlan.PHASES)
    # allocated outside vLLM's sleep-mode pool, so kept through every phase, asleep or not
    row("CUDA graphs", graphs, MemoryPlan.PHASES)
    row("vLLM buffers", buffer_bytes(shape, b, k.tp) if not k.on_cpu else 0, MemoryPlan.PHASES)
    # the trainer: its parameters stay (the hand-off reads them); its states stay beside vLLM when they
    # fit (train.offload_states auto, decided again by measurement at start), else they leave
    everywhere = MemoryPlan.PHASES
    training = ("reference", "teacher", "values", "train") if not k.on_cpu else everywhere
    row("trainer params", params, everywhere)
    row("trainer grads", grads, training)
    row("fp32 master + Adam", states, training)
    # activations are freed by the backward's end, before the optimizer step builds its fp32 gradients
    rows.setdefault("activations", {})["train"] = max(act, step_grads)
    if k.reference:
        rows["activations"]["reference"] = fwd_only
        row(
            "reference",
            P * wb if not z3 else 2 * shape.layer_params * wb,
            ("reference",) if not k.on_cpu else everywhere,
        )
    ts = k.teacher
    if ts is not None:  # as the reference (reference.py), at its own shape: a layer at a time under ZeRO-3
        rows["activations"]["teacher"] = tokens * ts.layer_activations(b) + min(k.chunk, tokens) * ts.vocab * (
            (2 * b + 12) if k.on_cpu else (b + 8)
        )
        teacher_w = ts.params * wb if not z3 else 2 * ts.layer_params * wb
        row("teacher", teacher_w, ("teacher",) if not k.on_cpu else everywhere)
        if k.teacher_hidden:  # algo.distill_loss full: its head beside the policy, a micro-batch of its hidden states
            row("teacher head (full KL)", ts.vocab * ts.hidden * b + tokens * ts.hidden * b, ("train",))
            # the step's hidden states wait in host memory (on CPU beside everything, from the teacher's phase)
            row("teacher hidden states", k.teacher_hidden if k.on_cpu else 0, ("teacher", "train"))
    critic_states = 0
    if k.critic:
        cP = P - shape.vocab * shape.hidden * (0 if shape.tied else 1)  # no LM head: a one-output value head
        critic_states = (cP * wb // N + min(REDUCE_BUCKET, cP) * wb + 12 * cP // N) * (not k.optimizer_offload)
        row(
            "critic",
            (cP * wb // N if z3 else cP * wb) + critic_states,
            ("values", "train") if not k.on_cpu else everywhere,
        )
        rows["activations"]["values"] = fwd_only
    if z3:
        row("hand-off bucket", k.bucket, ("hand-off",))
        # forward and backward gather layers ahead and keep up to STAGE3_LIVE parameters gathered
        row(
            "ZeRO-3 gathered",
            min(STAGE3_LIVE, P) * wb,
            ("reference", "teacher", "values", "train") if not k.on_cpu else everywhere,
        )
    row("reserve", k.reserve, everywhere)
    # sandboxed programs (code_tests, the python tool) run while vLLM generates, in host memory: on
    # CPU beside the engines, a rank's share of the node's; on a GPU node, pageable host memory below
    row("sandboxed programs", k.sandbox // k.local if k.on_cpu else 0, ("generate",))
    plan = MemoryPlan(device, host, rows, {}, k)
    over = plan.total("generate") - device
    if over > 0 and k.kv > k.kv_floor:  # a smaller KV cache: vLLM runs the step in more waves
        rows["vLLM KV cache"] = {p: v - min(over, k.kv - k.kv_floor) for p, v in rows["vLLM KV cache"].items()}
    kept = grads + states if not k.optimizer_offload else 0
    if (
        not k.on_cpu
        and kept
        and k.offload_states != "on"
        and (k.offload_states == "off" or plan.total("generate") + kept <= device)
    ):
        for name in ("trainer grads", "fp32 master + Adam"):
            if name in rows:
                rows[name].update({"generate": rows[name]["train"], "hand-off": rows[name]["train"]})
        kept = 0
    pinned, L = plan.pinned, k.local
    if not k.on_cpu:  # what each rank pins, buffer by buffer (pinned_bytes), times the node's ranks
        part = T // N  # this rank's partition of the trained parameters
        sub = SUB_GROUP if z3 else part  # ZeRO-3 flattens it in sub-groups of this many elements, ZeRO-1/2 in one
        if k.reference:  # tensor by tensor: ZeRO-2 a whole copy per rank (reference.py); ZeRO-3 its shards
            pinned["reference"] = sum(pinned_bytes(-(-n // N) * b if z3 else n * b) for n in shape.tensors()) * L
        if ts is not None:  # the teacher's likewise: its shards (ZeRO-3) or its whole copy per rank (ZeRO-2)
            pinned["teacher"] = sum(pinned_bytes(-(-n // N) * b if z3 else n * b) for n in ts.tensors()) * L
        if k.sleep_level == 1:  # vLLM's sleep backs each of its weight allocations up to pinned memory
            pinned["vLLM weights (sleep level 1)"] = sum(pinned_bytes(n // k.tp * b) for n in shape.tensors(True)) * L
        if k.optimizer_offload:
            if z3:  # one flat low-precision gradient buffer and each sub-group's fp32 gradients
                pinned["optimizer (offloaded)"] = (pinned_bytes(b * part) + _sub_groups(part, sub, 4)) * L
            else:  # fp32 master weights and their gradients, a low-precision copy, a one-parameter gradient buffer
                pinned["optimizer (offloaded)"] = (
                    2 * pinned_bytes(4 * part) + pinned_bytes(b * part) + pinned_bytes(b * max(shape.tensors()))
                ) * L
            # CPU Adam's fp32 master weights (ZeRO-3: a clone, not pinned) and two moments: ordinary pages
            plan.pageable["optimizer states (offloaded)"] = (12 if z3 else 8) * part * L
        if kept:  # offload_states pins the gradients flat, fp32 master weights and Adam's moments per sub-group
            pinned["trainer states while generating"] = (pinned_bytes(b * part) + 3 * _sub_groups(part, sub, 4)) * L
        if k.param_offload:  # one flat buffer of the rank's parameter partition
            pinned["parameters (offloaded)"] = pinned_bytes(P * b // N) * L
        if k.critic and critic_states:
            cpart = cP // N
            pinned["critic while generating"] = (
                pinned_bytes(b * cpart) + 3 * _sub_groups(cpart, SUB_GROUP if z3 else cpart, 4)
            ) * L
        if k.sandbox:
            plan.pageable["sandboxed programs"] = k.sandbox
        if k.teacher_hidden:
            plan.pageable["teacher hidden states"] = k.teacher_hidden * L
    return plan


def pinned_bytes(nbytes: int) -> int:
    """Host memory a pinned buffer of `nbytes` takes: torch's pinned allocator (CachingHostAllocator)
    rounds every allocation up to a power of two (unless pinned_max_round_threshold is set, which
    hybridrl does not), so a 1.09 GB embedding pins 2 GiB."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0


def _sub_groups(numel: int, sub: int, width: int) -> int:
    """Pinned bytes of `numel` elements of `width` bytes flattened in buffers of `sub` elements."""
    full, rest = divmod(numel, max(1, sub))
    return full * pinned_bytes(sub * width) + pinned_bytes(rest * width)


# --- deciding the knobs the user left unset --------------------------------------------------------
def knobs(cfg: Config, shape: Shape, *, world: int, local: int, on_cpu: bool, tp: int = 0) -> Knobs:
    """The plan's inputs from a resolved config; `tp` other than the config's to try another size."""
    from hybridrl.core import recipe
    from hybridrl.data import rewards

    t, r, m = cfg.train, cfg.rollout, cfg.model
    b = 4 if m.dtype == "float32" else 2
    tp = tp or r.tensor_parallel_size
    dp = max(1, world // tp)  # vLLM engines: each generates its group's prompts
    # a rank holds its share of the KV heads (all of one head where there are fewer heads than ranks)
    kv_per_token = 2 * shape.layers * shape.head_dim * b * max(1, shape.kv_heads // tp)
    seqs, seq_kv = (0, 0) if on_cpu else (memory.step_seqs(cfg, dp), r.max_model_len * kv_per_token)
    if on_cpu:
        kv = floor = (r.kv_cache_mb or 64) << 20
    elif r.kv_cache_mb:
        kv = floor = r.kv_cache_mb << 20
    else:  # memory.kv_cache_need for the group's sequences (tp ranks x a rank's share); where memory is
        # short, the longest sequences running (memory.kv_floor): `decide` prefers plans of at most two waves
        need = seqs * seq_kv
        kv, floor = max(memory.KV_HEADROOM * need, memory.KV_MIN), max(memory.kv_floor(seqs, seq_kv), memory.KV_MIN)
    v = shape.vision  # a frozen tower (model.train_vision) has no gradients or optimizer states
    frozen = {"off": v.params, "projector": v.params - v.projector, "all": 0}[m.train_vision] if v else 0
    trained = shape.lora_params(m.lora_rank, m.lora_target_modules) if m.lora_rank else shape.params - frozen
    # a micro-batch holds at most the rank's whole step: its rows at full context (a short step's
    # micro-batch is smaller than the token budget), and at least a rank's share of one sequence
    rows = -(-t.prompts_per_step // world) * r.n
    step_tokens = rows * r.max_model_len
    # each row's images: rollout.images_per_prompt at max_pixels, within data.max_prompt_len (which counts them)
    images = rows * min(r.images_per_prompt * v.image_tokens, cfg.data.max_prompt_len) if v else 0
    mb_tokens = max(min(t.max_tokens_per_micro_batch, step_tokens), -(-r.max_model_len // t.sequence_parallel_size))
    return Knobs(
        world=world,
        local=local,
        tp=tp,
        zero=t.zero_stage,
        b=b,
        ckpt=m.gradient_checkpointing,
        mb_tokens=mb_tokens,
        optimizer_offload=t.optimizer_offload == "on",
        param_offload=t.param_offload == "on",
        trained=trained,
        reference=cfg.algo.kl_coef > 0 and not m.lora_rank,
        critic=estimator(cfg.algo.advantage).critic,
        sleep_level=r.sleep_level,
        graphs=not r.enforce_eager,
        max_num_seqs=r.max_num_seqs or memory.engine_seqs(cfg, world, tp),
        kv=kv,
        kv_floor=floor,
        chunk=t.logprob_chunk,
        bucket=t.sync_bucket_mb << 20,
        reserve=(r.memory_margin_mb << 20) if not on_cpu else 0,
        on_cpu=on_cpu,
        offload_states=t.offload_states,
        seqs=seqs,
        seq_kv=seq_kv,
        sp=t.sequence_parallel_size,
        wb=4 if recipe.amp(cfg, on_cpu) else 0,
        teacher=Shape.from_config(read_config(cfg.algo.teacher)) if cfg.algo.teacher else None,
        sandbox=rewards.sandbox_bytes(cfg, local),
        teacher_hidden=_teacher_hidden(cfg, world, b),
        images=images,
        train_vision=m.train_vision,
    )


def _teacher_hidden(cfg: Config, world: int, b: int) -> int:
    """A rank's step of teacher hidden states ([rows, max_model_len, hidden], Batch.hidden_teacher)."""
    if not (cfg.algo.teacher and cfg.algo.distill_loss == "full"):
        return 0
    rows = -(-cfg.train.prompts_per_step // world) * cfg.rollout.n
    return rows * cfg.rollout.max_model_len * Shape.from_config(read_config(cfg.algo.teacher)).hidden * b


FREE = (
    "rollout.tensor_parallel_size",
    "model.gradient_checkpointing",
    "train.max_tokens_per_micro_batch",
    "train.zero_stage",
    "train.optimizer_offload",
    "train.param_offload",
    "train.sequence_parallel_size",
)


def ladder(cfg: Config, shape: Shape, base: Knobs, world: int, local: int, device: int):
    """Settings to try, cheapest first, varying only what the user left unset (recipe.explicit):
    halved micro-batches, gradient checkpointing, ZeRO-3, a larger vLLM tensor-parallel group, and
    only then the optimizer in host memory; then sequence parallelism, where one sequence's
    activations fit in none of those (its all-to-alls cost every layer, and a sequence-level loss or
    the critic rules it out: config.validate); the parameters in host memory last."""
    from hybridrl.core.config import _sequence_level
    from hybridrl.core.recipe import explicit

    free = {key: not explicit(cfg, key) for key in FREE}
    sps = [base.sp] + [
        s
        for s in (2, 4, 8)
        if free["train.sequence_parallel_size"]
        and s > base.sp
        and world % s == 0
        and shape.heads % s == 0
        and not _sequence_level(cfg)
        and not estimator(cfg.algo.advantage).critic
    ]
    for params in (False, True):
        for sp in sps:
            yield from _ladder_at(cfg, shape, base, world, local, device, free, sp, params)


def _ladder_at(
    cfg: Config, shape: Shape, base: Knobs, world: int, local: int, device: int, free: dict, sp: int, params: bool
):
    """`ladder` at one sequence-parallel size (a rank's micro-batch is at least its share of the longest
    sequence), the parameters offloaded or not."""
    least = -(-cfg.rollout.max_model_len // sp)
    tps = [base.tp] + [
        t
        for t in (2, 4, 8)
        if free["rollout.tensor_parallel_size"]
        and t > base.tp
        and world % t == 0
        and shape.heads % t == 0
        and shape.expert_intermediate % t == 0
        and t <= local
    ]
    tps = [t for t in tps if vllm_fits(shape, base, t, device)]
    budgets = [base.mb_tokens if sp == base.sp else max(cfg.train.max_tokens_per_micro_batch, least)]
    if free["train.max_tokens_per_micro_batch"]:
        while budgets[-1] // 2 >= max(least, 1024):
            budgets.append(budgets[-1] // 2)
    ckpts = [base.ckpt] + [True] * (free["model.gradient_checkpointing"] and not base.ckpt)
    zeros = [base.zero] + [3] * (free["train.zero_stage"] and base.zero != 3 and world > 1)
    offloads = [(base.optimizer_offload, base.param_offload)]
    if free["train.optimizer_offload"] and not base.optimizer_offload:
        offloads.append((True, base.param_offload))
    if params:
        offloads = [(True, True)] if free["train.param_offload"] and not base.param_offload else []
    # parameters on the host take the optimizer with them (DeepSpeed cannot move the states of an engine
    # with offloaded parameters; config.validate refuses the pair the user sets)
    for optimizer_offload, param_offload in [(o or p, p) for o, p in offloads]:
        for tp in tps:
            k = knobs(cfg, shape, world=world, local=local, on_cpu=False, tp=tp) if tp != base.tp else base
            for zero in zeros:
                if param_offload and zero != 3:
                    continue
                for ckpt in ckpts:
                    # full micro-batches before checkpointing: recomputing costs a third more compute
                    for mb in budgets[:2] if ckpt != ckpts[-1] else budgets:
                        yield dataclasses.replace(
                            k,
                            zero=zero,
                            optimizer_offload=optimizer_offload,
                            param_offload=param_offload,
                            ckpt=ckpt,
                            mb_tokens=mb,
                            sp=sp,
                        )


def vllm_fits(shape: Shape, k: Knobs, tp: int, device: int) -> bool:
    """vLLM's weights and a minimal KV cache beside the reserve, at tensor-parallel size `tp`."""
    return shape.params * k.b // tp + memory.KV_MIN + k.reserve <= device * 0.9


def decide(
    cfg: Config, shape: Shape, *, device: int, host: int, world: int, local: int, on_cpu: bool
) -> tuple[Config, MemoryPlan]:
    """The cheapest plan that fits (see `ladder`), its choices written into the config (source
    "memory plan"); ConfigError in one line when none fits. On CPU nothing is decided: the plan
    only checks that the run fits the node's memory."""
    from hybridrl.core.config import explicit, put

    base = knobs(cfg, shape, world=world, local=local, on_cpu=on_cpu)
    first = build(shape, base, device=device, host=host)
    if on_cpu:
        if not first.fits:
            raise ConfigError(
                f"the memory plan needs {first.peak[1] / GIB:.1f} GiB of host memory per rank in "
                f"phase {first.peak[0]} ({local} rank(s) share {device * local / GIB:.1f} GiB "
                "available): use fewer ranks (--nproc), model.gradient_checkpointing, a smaller "
                "train.max_tokens_per_micro_batch"
                + _fewer_programs(base)
                + " or a smaller model (`hybridrl plan` shows the table)"
            )
        return cfg, first
    plans = [
        p
        for p in (build(shape, k, device=device, host=host) for k in ladder(cfg, shape, base, world, local, device))
        if p.fits
    ]
    # the KV cache is throughput, not fit: the cheapest plan whose step takes at most two waves (half of
    # its sequences at once); where none does, the cheapest within twice the fewest waves any plan takes
    # (a ZeRO-2 trainer that leaves vLLM room for a few sequences would cost more than ZeRO-3 saves)
    fewest = min((p.waves for p in plans), default=0)
    p = next((p for p in plans if p.waves <= (2 * fewest if fewest > 2 else 2)), None)
    if p is None:
        raise ConfigError(
            _weights_note(shape, base, device, local) + _refusal(cfg, shape, base, device, host, world, local)
        )
    k = p.knobs
    chosen = {
        "rollout.tensor_parallel_size": (k.tp, base.tp),
        "model.gradient_checkpointing": (k.ckpt, base.ckpt),
        # the budget the plan assumed (at least a rank's share of the longest sequence), which the trainer
        # holds every micro-batch to; the user's own is kept, and so is one a short step never fills
        "train.max_tokens_per_micro_batch": (
            k.mb_tokens,
            base.mb_tokens
            if explicit(cfg, "train.max_tokens_per_micro_batch")
            or base.mb_tokens <= cfg.train.max_tokens_per_micro_batch
            else cfg.train.max_tokens_per_micro_batch,
        ),
        "train.sequence_parallel_size": (k.sp, base.sp),
        "train.zero_stage": (k.zero, base.zero),
        "train.optimizer_offload": ("on" if k.optimizer_offload else "off", cfg.train.optimizer_offload),
        "train.param_offload": ("on" if k.param_offload else "off", cfg.train.param_offload),
    }
    for key, (value, before) in chosen.items():
        if value != before:
            cfg = put(cfg, key, value, "memory plan")
            if value != "off":
                p.choices.append(f"{key}={str(value).lower()}")
    if p.choices:
        p.choices = [
            ", ".join(p.choices) + f" (with the defaults, {first.peak[0]} would need {first.peak[1] / GIB:.1f} GiB)"
        ]
    return cfg, p


def _weights_note(shape: Shape, k: Knobs, device: int, local: int) -> str:
    """Where the weights alone are most of the node's GPU memory, the refusal starts by saying so: a
    colocated run holds them twice (vLLM's copy and the trainer's) beside their optimizer states."""
    weights = shape.params * k.b
    if weights <= local * device // 2 or not any(vllm_fits(shape, k, t, device) for t in (1, 2, 4, 8) if t <= local):
        return ""  # where vLLM's own copy fits no TP group, the refusal says that instead
    return (
        f"the weights alone are {weights / GIB:.1f} GiB in {'bfloat16' if k.b == 2 else 'float32'} "
        f"({shape.describe()}), held twice in a colocated run (vLLM's copy and the trainer's), of "
        f"{local} x {device / GIB:.1f} GiB on the node: "
    )


def _fewer_programs(k: Knobs) -> str:
    """The lever for the sandbox's share, where the run has one (knobs.sandbox)."""
    if not k.sandbox:
        return ","
    return (
        f", fewer sandboxed programs at once (they may hold {k.sandbox / GIB:.1f} GiB: "
        "HYBRIDRL_SANDBOX_SLOTS, reward.workers),"
    )


def _refusal(cfg: Config, shape: Shape, base: Knobs, device: int, host: int, world: int, local: int) -> str:
    """One line: what stops the run, and what would change it."""
    tp = next((t for t in (1, 2, 4, 8) if t >= base.tp and vllm_fits(shape, base, t, device)), None)
    if tp is None or not any(
        vllm_fits(shape, base, t, device) for t in [base.tp] + [t for t in (2, 4, 8) if world % t == 0 and t <= local]
    ):
        need = f"rollout.tensor_parallel_size {tp} over {tp} GPUs (--nproc {tp})" if tp else "more GPUs per engine"
        return (
            f"vLLM's weights alone are {shape.params * base.b / base.tp / GIB:.1f} GiB per GPU at "
            f"rollout.tensor_parallel_size={base.tp}, too much for a {device / GIB:.1f} GiB GPU beside the "
            f"reserve and a KV cache: it needs at least {need}, or a smaller model"
        )
    last = None
    for k in ladder(cfg, shape, base, world, local, device):
        last = k  # the most the user's settings allow
    last = build(shape, last or base, device=device, host=host)
    phase, peak = last.peak
    if last.host_total > host * 0.9 and peak <= device:
        return (
            f"the memory plan needs {last.host_total / GIB:.0f} GiB of host memory per node "
            f"({last.pinned_total / GIB:.0f} GiB of it pinned host memory), more than "
            f"90% of {host / GIB:.0f} GiB: use more nodes, LoRA (model.lora_rank)"
            + _fewer_programs(base)
            + " or a node with more memory (`hybridrl plan` shows the table)"
        )
    from hybridrl.core.recipe import explicit

    k = last.knobs
    levers = [
        fix
        for key, fix, done in (
            ("model.gradient_checkpointing", "model.gradient_checkpointing true", k.ckpt),
            (
                "train.max_tokens_per_micro_batch",
                "a smaller train.max_tokens_per_micro_batch",
                k.mb_tokens <= max(cfg.rollout.max_model_len, 1024),
            ),
            ("train.zero_stage", "train.zero_stage 3", k.zero == 3 or world == 1),
            ("train.optimizer_offload", "train.optimizer_offload on", k.optimizer_offload),
            ("train.param_offload", "train.param_offload on", k.param_offload or k.zero != 3),
        )
        if explicit(cfg, key) and not done
    ]
    if phase == "teacher" and k.teacher is not None:
        return (
            f"no setting fits the teacher: its phase needs {peak / GIB:.1f} of {device / GIB:.1f} GiB per GPU at "
            f"best ({k.teacher.describe()}, {k.teacher.params * (k.wb or k.b) / GIB:.1f} GiB of weights): "
            + (
                "set train.zero_stage 3 (its shards wait in pinned host memory, a layer gathered at a time), "
                if k.zero != 3
                else ""
            )
            + "use more GPUs (--nproc/--nnodes), a shorter rollout.max_model_len or a smaller algo.teacher"
        )
    return (
        f"no setting fits: phase {phase} needs {peak / GIB:.1f} of {device / GIB:.1f} GiB per GPU at best: "
        + (f"set {', '.join(levers)}, or " if levers else "")
        + "use more GPUs (--nproc/--nnodes), rollout.tensor_parallel_size, LoRA (model.lora_rank), a shorter "
        "rollout.max_model_len or a smaller model (`hybridrl plan` shows the table)"
    )


# --- at start, and as a dry run ----------------------------------------------------------------------
def fit(
    cfg: Config, model_dir: str, *, world: int, local: int, device: int, host: int, on_cpu: bool
) -> tuple[Config, MemoryPlan | None]:
    """`decide` for a run about to start (loop.train, before any engine): the model's shape from its
    config.json. A config the plan cannot read (an unusual architecture) is planned by measurement
    alone, as before this plan existed, with a warning."""
    try:
        shape = Shape.from_config(read_config(model_dir))
    except (ConfigError, OSError, ValueError) as e:
        import logging

        logging.getLogger("hybridrl").warning(
            "no memory plan for this model (%s): vLLM is still sized by measurement, the training phase is not checked",
            e,
        )
        return cfg, None
    return decide(cfg, shape, device=device, host=host, world=world, local=local, on_cpu=on_cpu)


def available_gib() -> float:
    """This machine's available memory, what a CPU run's plan may use (memory.plan_budget's)."""
    return (memory.meminfo("MemAvailable") or memory.meminfo("MemTotal")) / GIB


def summary(p: MemoryPlan) -> str:
    """One line for CPU runs, where the table would mostly say 'fits'."""
    phase, peak = p.peak
    return (
        f"memory plan: peak {peak / GIB:.2f} GiB per rank ({phase}) of {p.device / GIB:.1f} GiB available "
        "(`hybridrl plan` prints the table)"
    )


def dry_run(
    cfg: Config, *, nproc: int, nnodes: int, gpu_gib: float, host_gib: float, cpu: bool = False
) -> tuple[Config, MemoryPlan, list[str]]:
    """`hybridrl plan`: the recipe and the plan a run of `cfg` would get on nnodes x nproc GPUs of
    gpu_gib each (cpu: on CPU ranks sharing host_gib), from the model's config.json alone, with the
    context at the data's longest prompt where the model's tokenizer is at hand (as a run's start
    has it: recipe.fit_to_data). Returns (config, plan, recipe lines)."""
    from hybridrl.core import platform, recipe

    conf = read_config(cfg.model.path)
    shape = Shape.from_config(conf)
    info = info_of(cfg.model.path, conf, shape)
    world = nproc * nnodes
    ram = int(host_gib * GIB) if cpu else None
    cfg = recipe.auto_dtype(cfg, on_cpu=cpu)
    cfg = recipe.resolve(
        cfg, info, on_cpu=cpu, world_size=world, free_ram=ram, fast_bf16=cpu and platform.current().amx_bf16
    )
    cfg = recipe.fit_to_data(cfg, info, data_longest(cfg), on_cpu=cpu, world_size=world, free_ram=ram)
    if cfg.train.prompts_per_step % world:
        raise ConfigError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be divisible by the {world} ranks")
    device = int(host_gib * GIB) // nproc if cpu else int(gpu_gib * GIB)
    cfg, p = decide(cfg, shape, device=device, host=int(host_gib * GIB), world=world, local=nproc, on_cpu=cpu)
    return cfg, p, recipe.describe(cfg, info, on_cpu=cpu, planned_ranks=nproc)


def data_longest(cfg: Config) -> int:
    """The longest training or held-out prompt in tokens, as a run encodes them (images as the
    tokens they become); 0 where the model's tokenizer is not on this machine (the plan then counts
    data.max_prompt_len) or for the demo."""
    if cfg.model.path == "demo":
        return 0
    from transformers import AutoTokenizer

    from hybridrl.core.config import UserError
    from hybridrl.data.images import Vision
    from hybridrl.data.prompts import encode, load_rows

    try:  # a recipe planned on another machine than its run's may have neither
        tok = AutoTokenizer.from_pretrained(
            cfg.model.path, trust_remote_code=cfg.model.trust_remote_code, local_files_only=True
        )
        vision = Vision.of(cfg.model.path, tok, local_files_only=True)
        kept = [
            p
            for split in ("train", "heldout")
            for p in encode(load_rows(cfg.data, split), tok, cfg.data, split, vision)[0]
        ]
    except (OSError, ValueError, UserError):
        return 0
    return max((p.length for p in kept), default=0)

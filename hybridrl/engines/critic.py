"""The critic of PPO with GAE (`algo.advantage=gae`): the policy's base model plus a scalar value
head, as a second DeepSpeed ZeRO-2/3 engine on the same device as the policy's.

Verbs, like the trainer's: `values(batch)` (the loop's `values` phase, before the update: the old
values that GAE and value clipping use), `step(batch)` (the `critic` phase: epochs x minibatches
updates on the clipped value loss, `algo.critic_lr`), `save_checkpoint` / `load_checkpoint`.
On GPU its parameters and optimizer states leave the device after each update and come back for
the next `values` call (DeepSpeed's offload_states / reload_states, as the policy's), so it holds
no device memory while vLLM generates; on CPU that is a no-op.

V(s_t) for completion token t is read from the hidden state that predicts token t (position t-1),
so values line up with the policy's log-probs ([B, T], like Batch.loss_mask). It starts from the
policy's weights with a zero value head: V = 0 before the first update. `algo.critic_path` starts it
from another model of the policy's vocabulary instead; when that model has a trained one-output head
(a reward model or a critic saved by transformers, OpenRLHF or TRL: `trained_head`), the value head
starts from it, as OpenRLHF initialises its critic from a reward model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import deepspeed
import torch
from torch import nn

from hybridrl.algorithms import advantages
from hybridrl.core import platform
from hybridrl.core.config import Config, ConfigError, UserError
from hybridrl.core.launch import all_sum, world_size
from hybridrl.core.models import enable_checkpointing, freeze_vision
from hybridrl.data.batch import Batch, per_token
from hybridrl.engines import deepspeed_compat
from hybridrl.engines.policy import module_inputs
from hybridrl.engines.zero_engine import (
    autocast,
    ds_config,
    from_pretrained,
    load_engine_checkpoint,
    lr_scheduler,
    minibatch_updates,
    plan_micro_batches,
    precision,
)

TAG = "critic"  # its DeepSpeed checkpoint's directory inside a hybridrl checkpoint
# where a one-output head sits in a saved model: transformers' sequence/token classification models
# (`score`; `classifier` in some architectures), OpenRLHF's reward model and critic (`value_head`),
# TRL's AutoModelForCausalLMWithValueHead (`v_head.summary`)
HEAD_NAMES = ("score", "value_head", "v_head.summary", "classifier")


class _ValueModel(nn.Module):
    def __init__(self, base: nn.Module, autocast: torch.dtype | None = None):
        super().__init__()
        self.base, self.autocast = base, autocast  # autocast: as the policy's TokenLogprobs
        self.head = nn.Linear(base.config.get_text_config().hidden_size, 1, dtype=base.dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, tokens, attention_mask, loss_mask, position_ids=None, images: dict | None = None) -> torch.Tensor:
        """Values of the masked tokens' states: [N] float32. A vision-language batch's rows come with their
        multimodal positions and images (policy.module_inputs' padded layout)."""
        with autocast(tokens.device.type, self.autocast):
            hidden = self.base(
                input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids, **(images or {})
            ).last_hidden_state
            return self.head(hidden[:, :-1][loss_mask[:, 1:]]).squeeze(-1).float()  # [N]


class Critic:
    def __init__(
        self, cfg: Config, model_path: str, *, device: torch.device, dtype: torch.dtype, attn_implementation: str
    ):
        from transformers import AutoModel

        self.cfg, self.device, self.platform = cfg, device, platform.current()
        dtype, autocast = precision(cfg, dtype)
        conf = ds_config(cfg, dtype == torch.bfloat16, self.platform, lr=cfg.algo.critic_lr)
        base = from_pretrained(
            AutoModel,
            cfg.algo.critic_path or model_path,
            conf,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        freeze_vision(base, cfg.model.train_vision)  # a vision-language model's tower, as the policy's
        if cfg.model.gradient_checkpointing:
            enable_checkpointing(base)
        model = _ValueModel(base, autocast)  # under ZeRO-3 the new head is partitioned by deepspeed.initialize
        if cfg.algo.critic_path:
            _check_vocabulary(cfg.algo.critic_path, base, model_path, cfg.model.trust_remote_code)
            head = trained_head(cfg.algo.critic_path, base.config.hidden_size, base.config.architectures or ())
            if head is not None:
                model.head.load_state_dict({k: v.to(model.head.weight.dtype) for k, v in head.items()})
                if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                    print(f"critic: value head from the trained head in {cfg.algo.critic_path}")
        if cfg.train.zero_stage == 3:
            deepspeed_compat.moe_leaf_modules(base)  # as the trainer: ranks routing differently gather alike
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=conf, lr_scheduler=lr_scheduler(cfg)
        )
        if self.platform.one_pass_zero_step:
            deepspeed_compat.fuse_overflow_check(self.engine.optimizer, world_size())
        self.offload()

    def _plan(self, rows: Batch | None) -> list[torch.Tensor | None]:
        return plan_micro_batches(rows, self.cfg.train.max_tokens_per_micro_batch)  # padded rows

    def _forward(self, mb: Batch) -> torch.Tensor:
        args, kw = module_inputs(mb, packing=False, share=False)  # padded rows (and a VLM's images)
        return self.engine(*args, **kw)

    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """The critic's values of every completion token before this step's update: [B, T]."""
        self.reload()
        return per_token(self._forward, batch, self._plan(batch), self.device)

    def step(self, batch: Batch) -> dict[str, float]:
        """epochs x minibatches updates on the clipped value loss against batch.returns, from the
        old values batch.values; then the states leave the device. Returns mean metrics."""
        sums, grad_norms = {}, []
        for m, norm, scale in minibatch_updates(
            self.engine, batch, self.cfg.train, self._plan, _token_count, self.device, grad_norms, self.platform
        ):
            sel = m.loss_mask
            loss, metrics = advantages.value_loss(
                self._forward(m), m.values[sel], m.returns[sel], clip=self.cfg.algo.value_clip, normalizer=norm
            )
            self.engine.backward(loss * scale, scale_wrt_gas=False)
            if not scale:  # a dummy micro-batch
                continue
            w = float(sel.sum())
            sums["value_loss"] = sums.get("value_loss", 0.0) + float(loss.detach())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
            sums["_w"] = sums.get("_w", 0.0) + w
        n_updates = len(grad_norms)
        sums["critic_grad_norm"] = sum(grad_norms)
        self.offload()
        w = max(sums.pop("_w", 0.0), 1.0)
        per_update = ("value_loss", "critic_grad_norm")
        out = {k: v / w for k, v in sums.items() if k not in per_update}
        out.update({k: sums.get(k, 0.0) / max(n_updates, 1) for k in per_update})
        return out

    # --- checkpoints: a DeepSpeed checkpoint of its own, `critic/` beside the policy's `ds/` -------
    def save_checkpoint(self, path: str) -> None:
        """Saved where the states are: the loop saves after the hand-off, when they sit offloaded in
        host memory and vLLM's KV cache is awake. DeepSpeed's save reads them there (ZeRO-2's
        state_dict and ZeRO-3's _rigid_state_dict take the master weights and Adam moments as
        tensors wherever they live, and the parameters through the module's state_dict); reloading
        first would bring the critic back onto the device beside vLLM, memory the plan never had."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # a non-blocking offload's copies into host memory have landed
        self.engine.save_checkpoint(path, tag=TAG, save_latest=False)

    def load_checkpoint(self, path: str) -> None:
        if not (Path(path) / TAG).is_dir():
            raise UserError(
                f"{path} holds no critic (it was saved without algo.advantage=gae); resume it with "
                "the run's own algo.advantage, or start a new run"
            )
        self.reload()
        load_engine_checkpoint(self.engine, path, TAG)
        self.offload()

    # --- memory ------------------------------------------------------------------------------
    def offload(self) -> None:
        """Parameters and optimizer states to CPU between its phases (GPU only)."""
        # all of it: the critic takes no part in the hand-off (with the optimizer in host memory,
        # train.optimizer_offload, DeepSpeed keeps its states there and moves nothing else)
        if self.device.type == "cuda" and self.cfg.train.optimizer_offload != "on":
            deepspeed_compat.offload_states(self.engine)

    def reload(self) -> None:
        if self.device.type == "cuda":
            deepspeed_compat.reload_states(self.engine)


def _token_count(mini: Batch | None) -> float:
    """The value loss's normaliser: the minibatch's completion tokens over all ranks."""
    return max(all_sum([float(mini.loss_mask.sum()) if mini else 0.0])[0], 1.0)


def _files(path: str, name: str) -> Path | None:
    """`name` in the model directory `path`, or in the hub cache for a hub name (from_pretrained has
    fetched the model just before); None if the model has no such file."""
    if Path(path).expanduser().is_dir():
        f = Path(path).expanduser() / name
        return f if f.exists() else None
    from transformers.utils import cached_file

    found = cached_file(
        path, name, _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False
    )
    return Path(found) if found else None


def trained_head(path: str, hidden_size: int, architectures: Sequence[str] = ()) -> dict[str, torch.Tensor] | None:
    """The one-output head saved with the model at `path` ({"weight": [1, H], "bias": [1]}, a zero
    bias where it has none), read from its safetensors without loading the model; None when it has
    none (a causal LM or a bare base model: the value head starts at zero). A classification model
    (by its config's `architectures`) whose head cannot be read, or a head with more than one
    output, is refused."""
    from safetensors import safe_open

    index = _files(path, "model.safetensors.index.json")
    if index is not None:
        shards = json.loads(index.read_text())["weight_map"]
        where = {k: index.parent / v for k, v in shards.items()}
    else:
        single = _files(path, "model.safetensors")
        where = {}
        if single is not None:
            with safe_open(str(single), "pt") as f:
                where = {k: single for k in f.keys()}
    name = next((n for n in HEAD_NAMES if f"{n}.weight" in where), None)
    if name is None:
        if any(a.endswith(("ForSequenceClassification", "ForTokenClassification")) for a in architectures):
            raise ConfigError(
                f"algo.critic_path={path}: a {architectures[0]} whose head could not be read (no "
                f"{' / '.join(n + '.weight' for n in HEAD_NAMES)} in model.safetensors); save it with "
                "save_pretrained(safe_serialization=True)"
            )
        return None
    with safe_open(str(where[f"{name}.weight"]), "pt") as f:
        weight = f.get_tensor(f"{name}.weight")
    if tuple(weight.shape) != (1, hidden_size):
        raise ConfigError(
            f"algo.critic_path={path}: its head {name}.weight has shape {tuple(weight.shape)}; a value "
            f"head has one output over the {hidden_size} hidden features (num_labels=1)"
        )
    bias = torch.zeros(1, dtype=weight.dtype)
    if f"{name}.bias" in where:
        with safe_open(str(where[f"{name}.bias"]), "pt") as f:
            bias = f.get_tensor(f"{name}.bias").reshape(1)
    return {"weight": weight, "bias": bias}


def _check_vocabulary(path: str, base: nn.Module, model_path: str, trust_remote_code: bool) -> None:
    """The critic reads the policy's token ids: a model with fewer embedding rows than the policy's
    vocabulary would fail on the first token past its end, mid-run."""
    from transformers import AutoConfig

    from hybridrl.core.memory import vocab_size

    policy = vocab_size(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code))
    rows = base.get_input_embeddings().num_embeddings
    if rows < policy:
        raise ConfigError(
            f"algo.critic_path={path} embeds {rows} tokens, the policy's vocabulary has {policy}: the "
            "critic reads the policy's tokens, so give a model with the policy's tokenizer"
        )

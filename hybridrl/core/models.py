"""What the policy model is, checked before any engine starts.

`inspect(path)` turns `model.path` (a local directory, a Hugging Face hub name, or 'demo') into a
`ModelInfo` (architecture, parameter count, vocabulary, context limit, KV-cache bytes per token)
or one line that says what is wrong and how to fix it: a path that is neither a directory nor a
hub name the hub (or, offline, the local cache) knows; a directory without config.json or tokenizer
files; an architecture vLLM cannot serve; a tokenizer without an EOS token. The CLI prints that
line without a traceback, and does so before vLLM or DeepSpeed are built.

Hub names still work as anywhere else in the HF stack: the user's own cache and token (HF_HOME,
HF_TOKEN) are read; with HF_HUB_OFFLINE=1 only the cache is, so a missing model fails at once
instead of waiting on the network.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from hybridrl.core import families
from hybridrl.core.config import UserError

log = logging.getLogger("hybridrl")

DEMO = Path(__file__).resolve().parents[1] / "demo_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


class ModelError(UserError):
    """model.path does not name a model hybridrl can train; the message says why and what to do."""


@dataclass(frozen=True)
class ModelInfo:
    name: str  # model.path as given
    path: str  # what the engines load: a directory, or the hub name
    arch: str
    params: int  # 0 if it could not be counted
    vocab: int
    max_positions: int  # max_position_embeddings (0 = not stated)
    kv_values_per_token: int  # K and V entries per token over all layers: x dtype bytes = KV cache bytes per token
    attn_heads: int = 0  # query heads summed over the layers (0 = not known): the size of eager attention's scores
    # what the trainer's layout needs (policy.layout): the class AutoModelForCausalLM builds is transformers'
    # own (not remote code), and its KV cache grows by concatenation on every layer (plain_cache)
    native: bool = True
    plain_cache: bool = True
    moe: str = ""  # the mixture-of-experts family (its model_type, one of MOE_FAMILIES); "" for a dense model

    def kv_bytes_per_token(self, dtype: str) -> int:
        return self.kv_values_per_token * (4 if dtype == "float32" else 2)


def check_teacher(
    teacher: str, tokenizer, student: str, *, trust_remote_code: bool = False, full: bool = False
) -> None:
    """algo.teacher scores the student's own token ids, so both must read them alike: the same
    token -> id map, and a teacher head with a row for every id (a larger, padded one is fine:
    Qwen2.5-7B has 152064 rows for the 151936-row 0.5B's ids, and rows past the tokenizer are never
    sampled). `full` (algo.distill_loss full) compares the two heads row by row: the teacher's needs a
    row for each of the student's. Raises ModelError in one line naming both."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(teacher, trust_remote_code=trust_remote_code)
        conf = AutoConfig.from_pretrained(teacher, trust_remote_code=trust_remote_code).get_text_config()
    except (OSError, ValueError) as e:
        raise ModelError(f"algo.teacher={teacher}: cannot load its tokenizer and config ({str(e).splitlines()[0]})")
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise ModelError(
            f"algo.teacher={teacher}'s tokenizer ({type(theirs).__name__}, {len(theirs)} tokens) differs from "
            f"model.path={student}'s ({type(tokenizer).__name__}, {len(tokenizer)} tokens): distillation scores the "
            "student's token ids with the teacher, so both need one vocabulary"
        )
    rows = getattr(conf, "vocab_size", None)
    if rows is not None and rows < len(tokenizer):
        raise ModelError(
            f"algo.teacher={teacher}: its head has {rows} rows, fewer than the {len(tokenizer)} ids of "
            f"model.path={student}'s tokenizer"
        )
    mine = getattr(AutoConfig.from_pretrained(student, trust_remote_code=trust_remote_code).get_text_config(),
                   "vocab_size", None) if full else None  # fmt: skip
    if rows is not None and mine is not None and rows < mine:
        raise ModelError(
            f"algo.teacher={teacher}: its head has {rows} rows, fewer than the {mine} of model.path={student}'s, "
            "and algo.distill_loss=full compares the heads row by row: use algo.distill_loss sampled"
        )


def local_path(name: str) -> str:
    return str(DEMO) if name == "demo" else name


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _looks_like_path(name: str) -> bool:
    """A hub name is 'name' or 'org/name'; anything else is meant as a directory."""
    return (
        name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith("/") or os.sep in name.replace("/", "")
    )


def _check_hub(name: str) -> None:
    """Resolve a hub name's config.json through huggingface_hub (the user's cache and token)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        reachable = offline or _hub_reachable()  # huggingface_hub would retry for ~30 s, printing each try
        if not reachable:  # the cache alone, for this lookup and every load after it
            import huggingface_hub.constants

            os.environ["HF_HUB_OFFLINE"] = "1"
            huggingface_hub.constants.HF_HUB_OFFLINE = True
        hf_hub_download(name, "config.json", local_files_only=not reachable)
    except HFValidationError:
        raise ModelError(
            f"model.path {name!r}: no such directory, and not a valid hub name; "
            "pass a model directory or a hub name like Qwen/Qwen2.5-0.5B-Instruct"
        ) from None
    except GatedRepoError:
        raise ModelError(
            f"model.path {name!r} is a gated model: accept its licence on huggingface.co and log in "
            "(`huggingface-cli login` or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"model.path {name!r}: no such directory, and no such model on the Hugging Face hub "
            "(a private one needs `huggingface-cli login`); check the path or the name"
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ModelError(
            f"model.path {name!r}: no such directory, and not in the Hugging Face cache while {why}; "
            f"download it first (`huggingface-cli download {name}`) or pass its directory"
        ) from None
    except OSError as e:  # network errors that huggingface_hub does not wrap
        raise ModelError(
            f"model.path {name!r}: no such directory, and the hub lookup failed ({_one_line(e)}); "
            f"download it first (`huggingface-cli download {name}`) or pass its directory"
        ) from None


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """One TCP connection to the hub's host: no network fails here in milliseconds (a DNS error)
    or in timeout_s, instead of in huggingface_hub's five retries."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s).close()
        return True
    except OSError:
        return False


@functools.lru_cache(maxsize=8)
def inspect(name: str, trust_remote_code: bool = False) -> ModelInfo:
    """Check `model.path` and describe the model; raises ModelError (one line) if it cannot be trained."""
    path = local_path(name)
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(
                f"model.path {name}: no config.json in this directory, so it is not a Hugging Face model; "
                "write one with model.save_pretrained(DIR)"
            )
        if not any((p / f).is_file() for f in TOKENIZER_FILES):
            raise ModelError(
                f"model.path {name}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}) in this "
                "directory; save the tokenizer beside the model: tokenizer.save_pretrained(DIR)"
            )
        path = str(p)
    elif p.exists():
        raise ModelError(f"model.path {name} is a file; pass the model's directory (config.json, weights, tokenizer)")
    elif _looks_like_path(name):
        raise ModelError(
            f"model.path {name}: no such directory; pass a model directory or a hub name "
            "like Qwen/Qwen2.5-0.5B-Instruct"
        )
    else:
        _check_hub(name)

    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        hint = "" if trust_remote_code else " (custom modelling code? set model.trust_remote_code true)"
        raise ModelError(f"model.path {name}: transformers cannot read its config.json: {_one_line(e)}{hint}") from None
    text = getattr(config, "get_text_config", lambda: config)()
    archs = list(getattr(config, "architectures", None) or [])
    arch = _servable(name, archs, getattr(config, "model_type", "?"))
    moe = moe_family(name, text)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(
            f"model.path {name}: its tokenizer does not load: {_one_line(e)}; "
            "save a working one with tokenizer.save_pretrained(DIR)"
        ) from None
    if tok.eos_token_id is None:
        raise ModelError(
            f"model.path {name}: the tokenizer has no EOS token, so no completion could end before "
            "rollout.max_new_tokens; set one (tokenizer.eos_token = '<|endoftext|>' or your end "
            "token) and save the tokenizer again"
        )
    from hybridrl.core.memory import kv_bytes_per_token

    try:
        kv_values = kv_bytes_per_token(text, 1)
    except (AttributeError, TypeError, ZeroDivisionError):  # an unusual attention layout: the KV size is then a guess
        kv_values = 0
    try:
        attn_heads = int(text.num_hidden_layers) * int(text.num_attention_heads)
    except (AttributeError, TypeError, ValueError):
        attn_heads = 0
    params, native = _count_params(config, trust_remote_code)
    return ModelInfo(
        name=name,
        path=path,
        arch=arch,
        params=params,
        vocab=int(getattr(text, "vocab_size", 0) or len(tok)),
        max_positions=int(getattr(text, "max_position_embeddings", 0) or 0),
        kv_values_per_token=kv_values,
        attn_heads=attn_heads,
        native=native,
        plain_cache=plain_cache(config),
        moe=moe,
    )


# the mixture-of-experts families whose hand-off is proven here: core/families.py's table
MOE_FAMILIES = tuple(families.FAMILIES)


def moe_family(name: str, text) -> str:
    """The model_type of a mixture-of-experts config (families.is_moe), "" for a dense one; ModelError
    for a family outside the table."""
    if not families.is_moe(text):
        return ""
    model_type = str(getattr(text, "model_type", "") or "")
    if families.family_of(text) is None:
        raise ModelError(
            f"model.path {name}: mixture-of-experts model type {model_type!r} is not supported "
            f"(hybridrl hands off {', '.join(MOE_FAMILIES)}); pick a model of one of those families"
        )
    return model_type


def plain_cache(config) -> bool:
    """Whether transformers' KV cache for a model of `config` grows by concatenation on every layer
    (no sliding window): what computing a prompt once for its samples needs (policy.share_prompt)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    try:
        return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)
    except Exception:  # a config transformers' cache cannot read: not a standard decoder
        return False


def is_native(model_class: type) -> bool:
    """A model class of transformers' own (remote code's live in transformers_modules)."""
    return model_class.__module__.startswith("transformers.")


def model_class(config):
    """The transformers class the engines load a model of `config` with: a vision-language family's own
    (its row in core/families.py: AutoModelForCausalLM maps none of them), else AutoModelForCausalLM."""
    import transformers

    row = families.vision_family(config)
    return getattr(transformers, row.model_class) if row else transformers.AutoModelForCausalLM


def load_class(path: str, trust_remote_code: bool = False):
    """model_class of the model at `path` (a directory or hub name)."""
    from transformers import AutoConfig

    return model_class(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))


def freeze_vision(hf, train_vision: str) -> int:
    """A vision-language model's frozen part, per model.train_vision: off, the whole tower (its projector
    included); projector, the tower but its projector; all, nothing. Returns the parameters frozen (0
    for a text model). Frozen parameters get no gradient or optimizer state and are not handed off."""
    row = families.vision_family(hf.config)
    if row is None or train_vision == "all":
        return 0
    frozen = 0
    for name, p in hf.named_parameters():
        if vision_frozen(name, row, train_vision):
            p.requires_grad_(False)
            frozen += 1
    return frozen


def vision_frozen(name: str, row: families.VisionFamily, train_vision: str) -> bool:
    """Whether parameter `name` (transformers' naming, a PEFT prefix allowed; or its base model's, the
    critic's, without the leading `model.`) is frozen under train_vision."""
    name = name.removeprefix("base_model.model.")
    name = name if name.startswith(("model.", "lm_head.")) else "model." + name
    if train_vision == "all" or not name.startswith(row.tower):
        return False
    return train_vision == "off" or not name.startswith(row.projector)


def _servable(name: str, archs: list[str], model_type: str) -> str:
    """The first architecture vLLM serves natively, or through its Transformers backend."""
    if not archs:
        raise ModelError(
            f"model.path {name}: config.json names no 'architectures', so vLLM cannot pick a model "
            "class; save the model with model.save_pretrained(DIR)"
        )
    from vllm import ModelRegistry

    native = set(ModelRegistry.get_supported_archs())
    for arch in archs:
        if arch in native:
            return arch
    import transformers

    for arch in archs:  # vLLM's Transformers backend serves models whose class supports its attention
        if getattr(getattr(transformers, arch, None), "_supports_attention_backend", False):
            log.warning("%s is not native to vLLM: it is served through vLLM's Transformers backend (slower)", arch)
            return arch
    import vllm

    raise ModelError(
        f"model.path {name}: vLLM {vllm.__version__} cannot serve model type {model_type!r} "
        f"({', '.join(archs)}); pick a model of an architecture in vLLM's supported-models list"
    )


def meta_model(config, trust_remote_code: bool = False):
    """The model of a transformers `config` built on the meta device (no memory, no weights read): a
    vision-language family's own class (families.VISION_FAMILIES; AutoModelForCausalLM maps none of
    them), else the one AutoModelForCausalLM picks."""
    import torch
    import transformers

    cls = model_class(config)
    with torch.device("meta"):
        if cls is transformers.AutoModelForCausalLM:
            return cls.from_config(config, trust_remote_code=trust_remote_code)
        return cls._from_config(config)


def _count_params(config, trust_remote_code: bool) -> tuple[int, bool]:
    """Parameters of the model built on the meta device (meta_model), 0 if that fails; and whether
    its class is transformers' own (when it fails: unless remote code builds it, as
    AutoModelForCausalLM decides)."""
    try:
        model = meta_model(config, trust_remote_code)
        return sum(p.numel() for p in model.parameters()), is_native(type(model))
    except Exception as e:  # a count for the printed recipe only: never worth stopping a run
        log.debug("could not count the model's parameters: %s", e)
        remote = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
        return 0, not remote


def enable_checkpointing(hf) -> None:
    """transformers' gradient checkpointing, working in eval mode. transformers recomputes a layer in
    backward only while the module that checks it is in training mode (`gradient_checkpointing and
    self.training`: each GradientCheckpointingLayer, or an older model's base model), and hybridrl's
    models run in eval mode (no dropout: the trainer scores what vLLM sampled), so without this the
    knob did nothing and every layer's activations stayed. Only those modules' own flag is set: their
    submodules (attention and any dropout) stay in eval mode."""
    hf.gradient_checkpointing_enable()
    for module in hf.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            module.training = True

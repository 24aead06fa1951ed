"""The DeepSpeed boundary and the platform switch: no module but engines/deepspeed_compat.py reaches
into DeepSpeed's internals or reads its version (read from the source, so it holds for code no test
runs), the GPU's DeepSpeed config is the CPU's without the CPU branch, and (one engine test) ZeRO-3
leaves torch's F.linear in place for the vLLM built after it."""

import ast
import re
from pathlib import Path

from hybridrl.core import config, environ, platform
from hybridrl.engines.deepspeed_compat import cpu_config
from hybridrl.engines.trainer import ds_config

from helpers.memory import four_rows

PACKAGE = Path(__file__).resolve().parents[1] / "hybridrl"
BOUNDARY = PACKAGE / "engines" / "deepspeed_compat.py"
INTERNALS = ("runtime", "ops", "utils", "accelerator")
# code held in a string and run elsewhere (doctor's probes run `python -c CODE`), or a name for importlib
IN_STRING = re.compile(
    rf"\b(?:from|import)\s+deepspeed\.(?:{'|'.join(INTERNALS)})\b|\bdeepspeed\.__version__\b"
    rf"|^deepspeed\.(?:{'|'.join(INTERNALS)})(?:\.|$)",
    re.M,
)


def reaches(source: str) -> list[str]:
    """Where `source` imports from deepspeed.runtime/.ops/.utils/.accelerator, reads them or
    deepspeed.__version__ as attributes (of `deepspeed` or a name it was imported as), or holds
    such an import in a string: 'line: what' each."""
    tree = ast.parse(source)
    names = {"deepspeed"} | {
        a.asname
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for a in n.names
        if a.name == "deepspeed" and a.asname
    }
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            found += [
                f"{n.lineno}: import {a.name}"
                for a in n.names
                if re.match(rf"deepspeed\.(?:{'|'.join(INTERNALS)})(?:\.|$)", a.name)
            ]
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "deepspeed":
            parts = n.module.split(".")
            if len(parts) > 1 and parts[1] in INTERNALS:
                found.append(f"{n.lineno}: from {n.module} import ...")
            elif len(parts) == 1:
                found += [
                    f"{n.lineno}: from deepspeed import {a.name}"
                    for a in n.names
                    if a.name in INTERNALS + ("__version__",)
                ]
        elif (
            isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id in names
            and n.attr in INTERNALS + ("__version__",)
        ):
            found.append(f"{n.lineno}: {n.value.id}.{n.attr}")
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and IN_STRING.search(n.value):
            found.append(f"{n.lineno}: a string with {IN_STRING.search(n.value).group(0)!r}")
    return found


def test_only_deepspeed_compat_reaches_into_deepspeed():
    files = sorted(PACKAGE.rglob("*.py"))
    assert BOUNDARY in files and len(files) > 50
    outside = {
        str(f.relative_to(PACKAGE)): hits for f in files if f != BOUNDARY for hits in [reaches(f.read_text())] if hits
    }
    assert not outside, f"DeepSpeed internals outside engines/deepspeed_compat.py: {outside}"
    assert reaches(BOUNDARY.read_text())  # the boundary itself does reach in: the check sees it


def test_the_check_sees_every_form():
    bad = [
        "import deepspeed.runtime.zero",
        "from deepspeed.utils.zero_to_fp32 import f",
        "from deepspeed import accelerator",
        "from deepspeed import __version__",
        "import deepspeed as ds\nds.ops.adam",
        "import deepspeed\nv = deepspeed.__version__",
        'CODE = """\nfrom deepspeed.accelerator import get_accelerator\n"""',
        'import importlib\nimportlib.import_module("deepspeed.ops.adam")',
    ]
    assert all(reaches(src) for src in bad), [src for src in bad if not reaches(src)]
    ok = [
        "import deepspeed\ndeepspeed.initialize(model=m)",
        "import deepspeed\ndeepspeed.zero.GatheredParameters([])",
        '"""DeepSpeed\'s zero_to_fp32 consolidates the shards (deepspeed.utils)."""',
    ]
    assert not any(reaches(src) for src in ok)


def test_cpu_paths_are_off_on_a_gpu(monkeypatch):
    gpu = platform.Platform.detect(cuda=True)
    assert gpu.cuda and not (gpu.repack_vllm_weights or gpu.amx_bf16 or gpu.fresh_adam_powers or gpu.cpu_ds_config)
    assert gpu.one_pass_zero_step  # measured on both
    for flags, amx in (({"avx512_bf16", "amx_bf16"}, True), ({"avx512_bf16"}, False)):
        monkeypatch.setattr(environ, "cpu_flags", lambda: set(flags))
        cpu = platform.Platform.detect(cuda=False)
        assert not cpu.cuda and cpu.repack_vllm_weights and cpu.fresh_adam_powers and cpu.cpu_ds_config
        assert cpu.amx_bf16 is amx
    assert platform.current() is platform.current()  # built once per process


def test_cpu_branch_of_the_deepspeed_config():
    """On one rank under ZeRO-1/2 the CPU config is the GPU's with the contiguous gradient buffer off
    and nothing pinned; ZeRO-3 keeps its buffer."""
    gpu, cpu = platform.Platform.detect(cuda=True), platform.Platform.detect(cuda=False)
    for zero in (2, 3):
        cfg = config.load(
            None, {"train.zero_stage": zero, "train.optimizer_offload": "on", "train.param_offload": "on"}
        )
        on_gpu, on_cpu = ds_config(cfg, True, gpu), ds_config(cfg, True, cpu)
        assert on_gpu["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
        assert "contiguous_gradients" not in on_gpu["zero_optimization"]
        assert on_cpu == cpu_config(ds_config(cfg, True, gpu), world_size=1)
        z = on_cpu["zero_optimization"]
        assert not z["offload_optimizer"]["pin_memory"] and not z.get("offload_param", {}).get("pin_memory")
        assert z.get("contiguous_gradients", True) is (zero == 3)
    two = cpu_config(ds_config(config.load(None, {}), False, gpu), world_size=2)
    assert "contiguous_gradients" not in two["zero_optimization"]  # several ranks: DeepSpeed's default


def test_zero3_engines_leave_torchs_linear_and_train_as_with_deepspeeds(world_of_one, monkeypatch):
    """Issue 71 item 3: DeepSpeed 0.19's zero.Init replaces torch.nn.functional.linear with its ZeRO-3
    autograd function and never puts it back (partition_parameters.py, `_enable_mem_efficient_linear`),
    and the in-process vLLM is built after the trainer: every vLLM linear layer then ran through
    DeepSpeed inside torch.compile and CUDA-graph capture. Our ZeRO-3 configs turn that linear off:
    after the policy and the reference are built partitioned (zero.Init ran), F.linear is torch's,
    and a ZeRO-3 step trains bit for bit as it did with DeepSpeed's linear."""
    import torch

    from hybridrl.engines import zero_engine
    from hybridrl.engines.reference import Reference
    from hybridrl.engines.trainer import Trainer

    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)  # put back after DeepSpeed's run
    demo = str(PACKAGE / "demo_model")
    kw = dict(device=torch.device("cpu"), dtype=torch.float32, attn_implementation="sdpa")
    batch = four_rows()
    cfg = config.load(None, {"train.zero_stage": 3, "train.lr": 1e-3})

    def trained() -> dict:
        torch.manual_seed(0)
        trainer = Trainer(cfg, demo, **kw)
        assert all(hasattr(p, "ds_id") for p in trainer.hf.parameters())  # partitioned: zero.Init ran
        trainer.step(batch)
        return {n: p.clone() for n, p in trainer.named_parameters_for_sync(1 << 20)}

    ours = trained()
    ref = Reference.load(config.load(None, {"train.zero_stage": 3, "algo.kl_coef": 0.01}), demo, **kw)
    assert all(hasattr(p, "ds_id") for p in ref.module.parameters())
    assert torch.nn.functional.linear is torch._C._nn.linear, torch.nn.functional.linear
    monkeypatch.setitem(zero_engine.ZERO3_SHARED, "memory_efficient_linear", True)  # DeepSpeed's default
    theirs = trained()
    assert torch.nn.functional.linear is not torch._C._nn.linear  # what the configs now keep away
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_cpu_adam_ops_build_and_load_without_debug_info(monkeypatch):
    """The CPU Adam ops compile without `-g` (1.6x the build time, once per fresh machine), and a
    CPU engine's config (what precedes every load) drops it as the setup's build does: the flags are
    in torch's hash of the op, so a mismatch would build it again on the first run."""
    from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

    from hybridrl.engines import deepspeed_compat

    monkeypatch.setattr(CPUOpBuilder, "cxx_args", CPUOpBuilder.cxx_args)  # restored after the test
    if getattr(CPUOpBuilder.cxx_args, "without_debug_info", False):  # this process built an engine already
        monkeypatch.setattr(CPUOpBuilder, "cxx_args", lambda self: ["-O3", "-g", "-fopenmp"])
    builders = [deepspeed_compat.op_builder(name) for name in ("FusedAdamBuilder", "CPUAdamBuilder")]
    assert all("-g" in b.cxx_args() for b in builders)  # DeepSpeed's own flags
    ds_config(config.load(None, {}), True, platform.Platform.detect(cuda=False))
    assert not any("-g" in b.cxx_args() for b in builders) and all("-O3" in b.cxx_args() for b in builders)
    deepspeed_compat.cpu_ops_without_debug_info()  # the build's call, again: once is enough
    assert builders[0].cxx_args().count("-O3") == 1

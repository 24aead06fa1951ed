"""Process environment that must be set before torch/vLLM/DeepSpeed are imported.

Build and compile caches (DeepSpeed's JIT ops, vLLM's, Triton's, Inductor's) go under
$HYBRIDRL_CACHE_DIR (the Makefile points it into the work tree; default ~/.cache/hybridrl), so a
fresh machine builds what it needs in a place the setup controls. Later runs load and execute
what is there, so the directory must be the user's own: it is created 0700, and one owned by
another user or writable by others is refused (a shared /tmp default let one user plant code
for the next). The user's Hugging Face home
(HF_HOME: their token, their downloaded models) is left alone: redirecting it would hide the
token of gated models and download every model again.
The libraries' console output is quiet unless `log.verbose` (logs.py).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """$HYBRIDRL_CACHE_DIR, else this user's: $XDG_CACHE_HOME/hybridrl (~/.cache/hybridrl)."""
    if os.environ.get("HYBRIDRL_CACHE_DIR"):
        return Path(os.environ["HYBRIDRL_CACHE_DIR"])
    try:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:  # no home directory: a per-user name in the temp dir (check_cache_dir guards it)
        return Path(tempfile.gettempdir()) / f"hybridrl-cache-{os.getuid()}"
    return base / "hybridrl"


def check_cache_dir(root: Path) -> None:
    """Create the cache directory (0700) or refuse it, in one line naming the fix, when another
    user owns it or can write to it: the compiled code there runs in this user's processes."""
    from hybridrl.core.config import UserError  # no torch import

    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = root.stat()
    except OSError as e:
        raise UserError(f"cache directory {root}: {e}; point HYBRIDRL_CACHE_DIR at a directory of your own") from None
    if st.st_uid != os.getuid():
        raise UserError(
            f"cache directory {root} belongs to another user (uid {st.st_uid}) and holds code that runs "
            "in your runs: point HYBRIDRL_CACHE_DIR at a directory of your own"
        )
    if st.st_mode & 0o022:
        raise UserError(
            f"cache directory {root} is writable by other users (mode {st.st_mode & 0o777:o}) and holds "
            f"code that runs in your runs: chmod go-w {root} (or point HYBRIDRL_CACHE_DIR elsewhere)"
        )


def has_cuda() -> bool:
    """Cheap CUDA check that does not initialise torch.cuda (forks stay safe)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl"))


def cpu_flags() -> set[str]:
    """The CPU's instruction-set flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def fast_bf16() -> bool:
    """The CPU has AMX-BF16, where a bfloat16 GEMM runs several times faster than float32's.
    AVX512-BF16 alone is no promise: it was faster than float32 on one CPU and slower on another
    (docs/speed.md); without either, torch emulates bfloat16, slower than float32."""
    return "amx_bf16" in cpu_flags()


def host_cores() -> int:
    """The cores this process may run on (its affinity: a job's cgroup or taskset counts)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def optimizer_threads(environ=None, cores: int | None = None) -> int:
    """OpenMP threads for an optimizer step on the host (DeepSpeed's CPU Adam with
    train.optimizer_offload on a GPU): this rank's share of the node's cores. torch's launcher sets
    OMP_NUM_THREADS=1 for every rank when it starts more than one and the variable is unset, which
    leaves CPU Adam, an OpenMP loop over the rank's partition (billions of parameters at 32B/72B),
    on one core while the others idle. An OMP_NUM_THREADS above 1 is the user's and is kept."""
    environ = os.environ if environ is None else environ
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 1:
        return int(omp)
    ranks = int(environ.get("LOCAL_WORLD_SIZE") or 1)  # torchrun's ranks on this node
    return max(1, (cores or host_cores()) // max(ranks, 1))


def _omp_runtimes() -> list:
    """Every OpenMP runtime loaded in this process (ctypes handles): torch's and the one a JIT op
    such as DeepSpeed's CPU Adam was linked against, which are two where the wheel bundles its
    libgomp under another name; torch.set_num_threads reaches torch's alone."""
    import ctypes
    import re

    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if re.search(r"/lib(gomp|iomp5|omp)\b[^/]*\.so", line)})
    except OSError:
        return []
    libs = []
    for path in paths:
        try:  # RTLD_NOLOAD: a handle on the loaded copy, never a second one
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
            lib.omp_get_max_threads, lib.omp_set_num_threads  # noqa: B018 -- both, or not a runtime
        except (OSError, AttributeError):
            continue
        libs.append(lib)
    return libs


@contextlib.contextmanager
def omp_threads(n: int):
    """Run the block with `n` OpenMP threads in every loaded runtime (0: as they are), then put back
    each runtime's own count. OpenMP's count belongs to the calling thread: the block's parallel
    loops started from this thread use it."""
    libs = _omp_runtimes() if n > 0 else []
    before = [lib.omp_get_max_threads() for lib in libs]
    for lib in libs:
        lib.omp_set_num_threads(n)
    try:
        yield
    finally:
        for lib, k in zip(libs, before):
            lib.omp_set_num_threads(k)


_OURS: dict[str, str] = {}  # the logging variables setup() set (logs.environment)
_VERBOSE = False


def setup(verbose: bool | None = None) -> None:
    """Idempotent; only fills variables the user has not set. `verbose` (log.verbose): the
    libraries' own console output as they print it; None keeps the last choice (quiet at first).
    The CLI calls it before parsing (quiet) and again with the config's choice, before anything
    heavy is imported."""
    global _VERBOSE
    from hybridrl.core import logs

    _VERBOSE = _VERBOSE if verbose is None else verbose
    root = cache_dir()
    check_cache_dir(root)
    defaults = {
        "TORCH_EXTENSIONS_DIR": root / "torch_extensions",  # DeepSpeed JIT ops
        "VLLM_CACHE_ROOT": root / "vllm",
        "TRITON_CACHE_DIR": root / "triton",
        "TORCHINDUCTOR_CACHE_DIR": root / "inductor",
        "MPLCONFIGDIR": root / "matplotlib",  # `hybridrl report`'s font cache
        "WANDB_CACHE_DIR": root / "wandb",  # artifacts and staging of log.wandb runs
        "WANDB_DATA_DIR": root / "wandb",
        # rollout.mode=inprocess: one in-process engine per rank, no engine process to start, tensors
        # passed by reference (vllm_compat.engine_env sets it per mode when the engine is built)
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    if not has_cuda():
        defaults["DS_ACCELERATOR"] = "cpu"
    # expandable segments for training, unless the user set the allocator (memory.py switches
    # them off around vLLM's pool at run time)
    from hybridrl.core.memory import training_defaults  # no torch import: this runs before torch is loaded

    defaults.update(training_defaults(os.environ, has_cuda()))
    for key, value in defaults.items():
        os.environ.setdefault(key, str(value))
    if not has_cuda():
        from hybridrl.core.memory import keep_host_pages

        keep_host_pages(os.environ)
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    logs.environment(os.environ, _VERBOSE, _OURS)
    logs.quiet_python(_VERBOSE)


def deepspeed_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's op builder can parse it: it reads every entry as
    numbers, so the architecture-specific suffix CUDA images set ('9.0a', '10.0f') stops its JIT
    build with "invalid literal for int(): '0a'" (seen on an H100 image). '9.0a' -> '9.0';
    '+PTX' stays; order and separators as given, duplicates dropped."""
    import re

    out: list[str] = []
    for entry in re.split(r"[;\s]+", value.strip()):
        m = re.fullmatch(r"(\d+)\.(\d+)[a-z]?(\+PTX)?", entry)
        cc = f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}" if m else entry
        if cc and cc not in out:
            out.append(cc)
    return ";".join(out)


# DeepSpeed's JIT ops a run loads (`python -m hybridrl.env` builds them, `hybridrl doctor` checks them): FusedAdam
# everywhere, CPUAdam for the optimizer in host memory (train.optimizer_offload, which the memory
# plan may turn on), and on CPU the shared-memory collectives DeepSpeed's CPU accelerator uses
DEEPSPEED_OPS = ["FusedAdamBuilder", "CPUAdamBuilder"]
DEEPSPEED_CPU_OPS = ["ShareMemCommBuilder"]


def deepspeed_ops() -> list[str]:
    """The JIT ops a run on this machine loads (after setup(), which sets DS_ACCELERATOR)."""
    return DEEPSPEED_OPS + (DEEPSPEED_CPU_OPS if os.environ.get("DS_ACCELERATOR") == "cpu" else [])

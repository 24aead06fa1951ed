"""Tables made from bench/results/*.jsonl, written into README.md and docs/*.md between markers:

    <!-- bench:NAME [key=value ...] -->
    (generated: do not edit by hand)
    <!-- /bench:NAME -->

    python -m bench.render              # rewrite every marked region from the results
    python -m bench.render --check      # exit 1 if a region is not what the results give (a test runs it)
    python -m bench.render --list       # the renderers

NAME picks a renderer: `peers` (hybridrl against TRL, the newest run per workload, dtype and
machine), `scale` (the same for bench.scale), `demo_curve` (a learning curve: held-out accuracy by
wall time, per seed), `gpu_check` (one GPU self-check's claims), `plan_check` (the memory plan
against the trainer's measured peak), `real` (time to accuracy on a real pretrained model) and
`history:<bench>` (every row of one bench, newest first, one dated line each); `settings` is not a
result but the schema: every config knob, by group (docs/configuration.md). key=value pairs
select rows: a key of the row, its workload or its machine (`kind=amx`, `workload=demo`,
`source=peers-*-amx.txt`, `commit=62971d0`), matched as a shell pattern; the picking renderers
take the newest row left. `every=N` thins a curve's grid to every N seconds. Files: README.md and
docs/*.md, or those given.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import sys
from collections.abc import Callable
from pathlib import Path

from bench import results

REGION = re.compile(r"(<!-- bench:(?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /bench:(?P<end>[^ >]*) -->)", re.S)
OPTIONS = ("every",)  # renderer options, not row filters
RENDERERS: dict[str, Callable[[list[str], dict], str]] = {}
SUMMARIES: dict[str, Callable[[dict], str]] = {}
WORKLOAD_ORDER = {"demo": 0, "134m": 1, "0.5b": 2, "1.5b": 3}


class RenderError(ValueError):
    pass


def renderer(name: str):
    def put(fn):
        RENDERERS[name] = fn
        return fn

    return put


def summary(bench: str):
    def put(fn):
        SUMMARIES[bench] = fn
        return fn

    return put


# --- rows --------------------------------------------------------------------------------------------
def select(rows: list[dict], filters: dict[str, str]) -> list[dict]:
    def value(r, key):
        for where in (r, r.get("workload") or {}, r.get("machine") or {}):
            if key in where:
                return where[key]
        if key == "source":
            return r.get("text_source")
        return None

    def match(r, key, pattern):
        v = value(r, key)
        if key == "source" and r.get("text_source") and fnmatch.fnmatch(r["text_source"], pattern):
            return True
        return v is not None and fnmatch.fnmatch(str(v), pattern)

    return [r for r in rows if all(match(r, k, p) for k, p in filters.items() if k not in OPTIONS)]


def newest(rows: list[dict]) -> dict | None:
    return max(rows, key=lambda r: r.get("date") or "", default=None)


def when(r: dict) -> str:
    d = r.get("date") or "?"
    return d.replace("T", " ")[:16].removesuffix("Z")


def machine_label(m: dict | None) -> str:
    m = m or {}
    if m.get("gpu"):
        return m["gpu"].replace("NVIDIA ", "")
    cpu = m.get("cpu") or ""
    name = "Xeon" if "Xeon" in cpu else "EPYC" if "EPYC" in cpu else "CPU"
    return f"{name} {m['kind']}" if m.get("kind") not in (None, "cpu") else name


def commit(r: dict) -> str:
    return r.get("commit") or "-"


def cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def secs(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 1 else f"{v:.2f}"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def table(head: list[str], align: str, rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# --- peers and scale ------------------------------------------------------------------------------
TRL_GEN, TRL_VLLM = "TRL transformers generate", "TRL vLLM colocate"


def _shape(w: dict) -> str:
    return f"{w.get('workload') or w.get('shape')}, {w.get('prompts')} x {w.get('n')} x {w.get('tokens')}"


@renderer("peers")
def render_peers(args: list[str], filters: dict) -> str:
    """hybridrl against TRL: the newest run with both per workload, dtype and machine."""
    rows = [
        r
        for r in select(results.load("peers"), filters)
        if "hybridrl" in r["figures"].get("trainers", {}) and r["figures"].get("speedup")
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        w = r["workload"]
        groups.setdefault(
            (
                w.get("workload"),
                w.get("prompts"),
                w.get("n"),
                w.get("tokens"),
                w.get("dtype"),
                machine_label(r["machine"]),
            ),
            [],
        ).append(r)
    picked = sorted(
        (newest(g) for g in groups.values()),
        key=lambda r: (
            WORKLOAD_ORDER.get(r["workload"].get("workload"), 9),
            r["workload"].get("prompts") or 0,
            r["workload"].get("dtype") or "",
            machine_label(r["machine"]),
        ),
    )
    out = []
    for r in picked:
        f, t = r["figures"], r["figures"]["trainers"]
        out.append(
            [
                _shape(r["workload"]),
                r["workload"].get("dtype") or "-",
                machine_label(r["machine"]),
                when(r),
                commit(r),
                secs(t["hybridrl"]["step_s"]),
                secs(t.get(TRL_GEN, {}).get("step_s")),
                secs(t.get(TRL_VLLM, {}).get("step_s")),
                f"**{f['speedup']:.2f}x**",
                f"{f['target']:g}x",
            ]
        )
    if not out:
        raise RenderError(f"peers: no run with hybridrl and TRL matches {filters or 'the results'}")
    return (
        table(
            [
                "workload (prompts x samples x tokens)",
                "dtype",
                "machine",
                "date (UTC)",
                "commit",
                "hybridrl s/step",
                "TRL generate s/step",
                "TRL vLLM s/step",
                "hybridrl / TRL's faster",
                "target",
            ],
            "lllllrrrrr",
            out,
        )
        + "\n\nThe newest run per workload, dtype and machine in `bench/results/peers.jsonl` "
        "(`python -m bench.peers`; tables: `python -m bench.render`)."
    )


def _overhead(f: dict) -> float:
    """The hand-off's and the probe's share of the step, as bench.scale printed it."""
    if f.get("hand_off_probe_share") is not None:
        return f["hand_off_probe_share"]
    return (f.get("hand_off_share") or 0) + (f.get("probe_share") or 0)


@renderer("scale")
def render_scale(args: list[str], filters: dict) -> str:
    """bench.scale: the newest run per shape, dtype and machine."""
    groups: dict[tuple, list[dict]] = {}
    for r in select(results.load("scale"), filters):
        w = r["workload"]
        groups.setdefault((w.get("shape"), w.get("dtype"), machine_label(r["machine"])), []).append(r)
    out = []
    for r in sorted(
        (newest(g) for g in groups.values()),
        key=lambda r: (
            WORKLOAD_ORDER.get(r["workload"].get("shape"), 9),
            r["workload"].get("dtype") or "",
            machine_label(r["machine"]),
        ),
    ):
        f = r["figures"]
        ph = f.get("phases", {})
        out.append(
            [
                _shape(r["workload"]),
                r["workload"].get("dtype"),
                machine_label(r["machine"]),
                when(r),
                commit(r),
                secs(f.get("step_s")),
                secs(ph.get("train")),
                secs(ph.get("generate")),
                f"{f['rollout_tok_s'].get('hybridrl loop', 0):.0f}",
                f"{f.get('rollout_vs_standalone', 0):.2f}x",
                pct(_overhead(f)),
            ]
        )
    if not out:
        raise RenderError(f"scale: no run matches {filters or 'the results'}")
    return (
        table(
            [
                "shape (prompts x samples x tokens)",
                "dtype",
                "machine",
                "date (UTC)",
                "commit",
                "s/step",
                "train s",
                "generate s",
                "rollout tok/s",
                "vs vLLM alone",
                "hand-off + probe",
            ],
            "lllllrrrrrr",
            out,
        )
        + "\n\nThe newest run per shape, dtype and machine in `bench/results/scale.jsonl` "
        "(`python -m bench.scale`)."
    )


# --- one run's tables -------------------------------------------------------------------------------
def _one(bench: str, filters: dict, need: str) -> dict:
    r = newest([r for r in select(results.load(bench), filters) if r["figures"].get(need)])
    if r is None:
        raise RenderError(f"{bench}: no row with {need} matches {filters or 'the results'}")
    return r


def _about(r: dict, bench: str) -> str:
    src = f"; from `{r['source']}`" if r.get("source") else ""
    return f"{machine_label(r['machine'])}, {when(r)} UTC, commit {commit(r)} (`bench/results/{bench}.jsonl`{src})"


@renderer("demo_curve")
def render_demo_curve(args: list[str], filters: dict) -> str:
    """The newest learning curve: held-out greedy accuracy at each time after engine start, per seed."""
    r = _one("demo_curve", filters, "grid_s")
    f = r["figures"]
    seeds = list(f["acc"])
    every = int(filters.get("every", 0) or 0)
    out = []
    for i, t in enumerate(f["grid_s"]):
        if every and t % every:
            continue
        out.append([t, *(pct(f["acc"][s][i]) for s in seeds), pct(f["mean"][i])])
    if f.get("final"):
        out.append(["final", *(pct(f["final"].get(s)) for s in seeds), f"**{pct(f.get('final_mean'))}**"])
    lines = [table(["t (s)", *(f"seed {s}" for s in seeds), "mean"], "r" * (len(seeds) + 2), out), "", ""]
    t75, t50 = f.get("time_to_75", {}), f.get("time_to_50", {})
    fmt = lambda d: " / ".join("not reached" if d.get(s) is None else f"{d[s]:.0f}" for s in seeds)  # noqa: E731
    mean75 = f.get("mean_time_to_75")
    about = [
        f"Time to 50%: {fmt(t50)} s; to 75%: {fmt(t75)} s"
        + (f", **{mean75:.0f} s mean**" if mean75 else ", not reached by every seed")
    ]
    if f.get("step_ms"):
        ph = ", ".join(
            f"{k} {v:.0f}" for k, v in sorted(f.get("phases_ms", {}).items(), key=lambda kv: -kv[1]) if v >= 0.5
        )
        about.append(f"{f['step_ms']:.0f} ms per step ({ph} ms)")
    sets = r["workload"].get("set") or []
    about.append(("Overrides " + ", ".join(sets) if sets else "The default recipe") + "; " + _about(r, "demo_curve"))
    return "\n".join(lines) + ". ".join(about) + "."


@renderer("gpu_check")
def render_gpu_check(args: list[str], filters: dict) -> str:
    """The newest GPU self-check matching the filters: its claims, figures, targets and verdicts."""
    r = _one("gpu_check", filters, "rows")
    f = r["figures"]
    out = [
        [x.get("check", ""), x["claim"], x["value"], x.get("target", ""), x["verdict"]]
        for x in f["rows"]
        if not x["claim"].endswith(": wall time")
    ]
    return (
        table(["check", "claim", "measured", "target", "verdict"], "lllll", out)
        + f"\n\n{f.get('passed', 0)} passed, {f.get('failed', 0)} failed, {f.get('unmeasured', 0)} unmeasured; "
        + _about(r, "gpu_check")
        + "."
    )


@renderer("plan_check")
def render_plan_check(args: list[str], filters: dict) -> str:
    """The newest plan check: the memory plan's training phase against the trainer's measured peak."""
    r = _one("plan_check", filters, "rows")
    gib = 2.0**30
    w = r["workload"]
    long = w.get("seqs") == 1  # one sequence per micro-batch, of each row's token count
    out = [
        [x["shape"], x["ranks"], x["zero"], "on" if x["ckpt"] else "off"]
        + ([x["tokens"]] if long else [])
        + [f"{x['plan'] / gib:.2f}", f"{x['measured'] / gib:.2f}", f"{x['measured'] / x['plan']:.2f}"]
        for x in r["figures"]["rows"]
        if x.get("measured")
    ]  # rows whose worker failed say so in the results
    head = (
        ["shape", "ranks", "ZeRO", "gradient checkpointing"]
        + (["sequence tokens"] if long else [])
        + ["plan GiB", "measured GiB", "measured / plan"]
    )
    what = "one sequence per micro-batch" if long else f"one micro-batch of {w.get('tokens')} tokens"
    if w.get("replanned"):  # bench.plan_check --replan: this commit's plan, each row's newest measurement
        what += (
            "; the plan of the commit below against each row's newest measurement (measured at "
            + ", ".join(f"{x['measured_commit']} {x['measured_date'][:10]}" for x in r["figures"]["rows"])
            + ")"
        )
    note = f" ({r['note']})" if long and r.get("note") else ""
    return (
        table(head, "lrrl" + "r" * (len(head) - 4), out)
        + f"\n\n{w.get('dtype')}, {what}; "
        + _about(r, "plan_check")
        + note
        + "."
    )


@renderer("real")
def render_real(args: list[str], filters: dict) -> str:
    """Time to accuracy on the real pretrained model (bench.real): held-out accuracy by step, the
    training seconds to the target per seed, and the ratio."""
    r = _one("real", filters, "trainers")
    f, w = r["figures"], r["workload"]
    target = f["target"]
    out = []
    for name, t in f["trainers"].items():
        steps = [p[0] for p in t["curves"][0]]
        mean = [sum(c[i][2] for c in t["curves"]) / len(t["curves"]) for i in range(len(steps))]
        end = sorted(c[-1][1] for c in t["curves"])[len(t["curves"]) // 2]
        per = ", ".join("-" if x is None else f"{x:.0f}" for x in t["to_target_s"])
        out.append([name, " / ".join(pct(m) for m in mean), f"{end:.0f}", per])
    ratio = (
        f"**{f['ratio']:.2f}x**"
        if f.get("ratio")
        else f"at least **{f['ratio_at_least']:.2f}x** (TRL short of it)"
        if f.get("ratio_at_least")
        else "-"
    )
    head = [
        "trainer",
        "held-out at step "
        + " / ".join(str(p[0]) for p in next(iter(f["trainers"].values()))["curves"][0])
        + " (mean of seeds)",
        f"training s to step {w['steps']} (median)",
        f"s to {target:.0%} per seed",
    ]
    return (
        table(head, "lrrr", out) + f"\n\nTime to {target:.0%}, TRL's over hybridrl's (median seconds; above 1: "
        f"hybridrl sooner): {ratio}, TRL {w.get('trl', '').split('==')[-1]}. {w['model']}, "
        f"{w['prompts']} x {w['n']} x {w['tokens']} tokens, lr {w['lr']:g}, "
        f"{w['dtype']}, seeds {', '.join(map(str, w['seeds']))}; " + _about(r, "real") + "."
    )


# --- the plan of long answers ------------------------------------------------------------------------
# model or recipe, answer tokens, context (0: the recipe's), on 8 x 80 GiB
PLAN_LONG = [
    ("Qwen/Qwen2.5-7B-Instruct", 16384, 0),
    ("Qwen/Qwen2.5-7B-Instruct", 32256, 0),
    ("examples/recipes/qwen2.5-7b-16k-8xh100.yaml", 0, 0),
    ("examples/recipes/qwen2.5-32b-8xh100.yaml", 8192, 9216),
    ("examples/recipes/qwen2.5-32b-8k-8xh100.yaml", 0, 0),
    ("examples/recipes/qwen2.5-72b-8xh100.yaml", 8192, 9216),
    ("examples/recipes/qwen2.5-72b-8xh100.yaml", 31744, 32768),
]


@renderer("settings")
def render_settings(args: list[str], filters: dict) -> str:
    """every config knob by group, from the schema (docs/configuration.md)"""
    from hybridrl.core.reference import settings_markdown

    return settings_markdown()


@renderer("plan_long")
def render_plan_long(args: list[str], filters: dict) -> str:
    """What `hybridrl plan --nproc 8` says of long answers on 8 x 80 GiB (the plan itself, run now: no results file)."""
    from hybridrl.core import config
    from hybridrl.cycle import plan

    gib = 2.0**30
    out = []
    for what, tokens, context in PLAN_LONG:
        recipe = what.endswith(".yaml")
        over = {"rollout.max_new_tokens": tokens} if tokens else {}
        over.update({"rollout.max_model_len": context} if context else {})
        cfg = config.load(str(results.ROOT / what), over) if recipe else config.load(None, {"model.path": what, **over})
        cfg, p, _ = plan.dry_run(cfg, nproc=8, nnodes=1, gpu_gib=plan.DEFAULT_GPU_GIB, host_gib=plan.DEFAULT_HOST_GIB)
        k, r, t = p.knobs, cfg.rollout, cfg.train
        flags = " ".join(f"{key.split('.')[-1]} {v}" for key, v in over.items())
        trainer = (
            f"ZeRO-{k.zero}"
            + ", checkpointing" * k.ckpt
            + ", optimizer offload" * k.optimizer_offload
            + ", parameter offload" * k.param_offload
            + f", sequence parallel {k.sp}" * (k.sp > 1)
            + f", {k.mb_tokens}-token micro-batches"
        )
        name = f"`{Path(what).name}`" if recipe else what.split("/")[-1]
        out.append(
            [
                name + (f" {flags}" if flags else ""),
                f"{t.prompts_per_step} x {r.n}",
                f"{r.max_new_tokens} / {r.max_model_len}",
                k.tp,
                trainer,
                f"{p.kv / gib:.1f} of {k.seqs * k.seq_kv / gib:.1f}",
                f"{p.waves} ({p.kv // k.seq_kv} of {k.seqs})",
                f"{p.peak[1] / gib:.1f} {'fits' if p.fits else 'DOES NOT FIT'}",
            ]
        )
    return (
        table(
            [
                "model or recipe, flags",
                "prompts x samples",
                "answer / context tokens",
                "vLLM TP",
                "trainer",
                "KV cache GiB per GPU (of all at full length)",
                "waves (at once of per engine)",
                "peak GiB",
            ],
            "llrrlrrl",
            out,
        )
        + "\n\n`hybridrl plan` with `--nproc 8`: 8 x 79.2 GiB GPUs, 2 TiB of host memory; waves count every "
        "answer at its longest (`python -m bench.render` reruns the plan)."
    )


# --- history ---------------------------------------------------------------------------------------
@summary("peers")
def _sum_peers(r: dict) -> str:
    w, f = r["workload"], r["figures"]
    t = f.get("trainers") or {}
    if not t:
        return ""
    parts = [
        f"{name.replace('TRL transformers generate', 'TRL generate').replace('TRL vLLM colocate', 'TRL vLLM')} "
        f"{secs(x['step_s'])}"
        for name, x in t.items()
    ]
    s = f"{_shape(w)}, {w.get('dtype') or 'dtype not recorded'}: " + ", ".join(parts) + " s/step"
    if f.get("speedup"):
        s += f"; **{f['speedup']:.2f}x** TRL's faster (target {f['target']:g}x)"
    return s


@summary("scale")
def _sum_scale(r: dict) -> str:
    w, f = r["workload"], r["figures"]
    return (
        f"{_shape(w)}, {w.get('dtype')}: {secs(f.get('step_s'))} s/step, rollout "
        f"{f['rollout_tok_s'].get('hybridrl loop', 0):.0f} tok/s ({f.get('rollout_vs_standalone', 0):.2f}x vLLM "
        f"alone), hand-off + probe {pct(_overhead(f))}"
    )


@summary("demo_curve")
def _sum_demo_curve(r: dict) -> str:
    f = r["figures"]
    t75 = f.get("mean_time_to_75")
    sets = r["workload"].get("set") or []
    return (
        f"seeds {', '.join(f.get('acc', {}))}"
        + (f" ({', '.join(sets)})" if sets else "")
        + f": final {pct(f.get('final_mean'))} mean, "
        + (f"75% at {t75:.0f} s mean" if t75 else "75% not reached by every seed")
    )


@summary("gpu_check")
def _sum_gpu_check(r: dict) -> str:
    f = r["figures"]
    return (
        f"{', '.join(r['workload'].get('checks', []))}: {f.get('passed', 0)} passed, {f.get('failed', 0)} failed, "
        f"{f.get('unmeasured', 0)} unmeasured"
    )


@summary("plan_check")
def _sum_plan_check(r: dict) -> str:
    ratios = [x["measured"] / x["plan"] for x in r["figures"]["rows"] if x.get("measured")]
    return f"{len(ratios)} cases, measured / plan {min(ratios):.2f} to {max(ratios):.2f}"


@summary("real")
def _sum_real(r: dict) -> str:
    f = r["figures"]
    ratio = f.get("ratio") or f.get("ratio_at_least")
    return f"to {f['target']:.0%} held-out: " + ("-" if ratio is None else f"{ratio:.2f}x sooner than TRL")


@summary("step")
def _sum_step(r: dict) -> str:
    f = r["figures"]
    return (
        f"{f['step_ms']:.0f} ms/step, rollout {f.get('loop_vs_standalone', 0):.2f}x vLLM alone, "
        f"hand-off {pct(f.get('sync_share'))} of the step"
    )


@summary("learn_scale")
def _sum_learn_scale(r: dict) -> str:
    wins = r["figures"].get("windows", {})
    return ", ".join(
        f"{d} held-out {pct(w[0]['heldout'])} -> {pct(w[-1]['heldout'])} at step {w[-1]['step']}"
        for d, w in wins.items()
    )


@summary("lora_handoff")
def _sum_lora_handoff(r: dict) -> str:
    f = r["figures"]
    if "generate" in f:
        return "generate with vs without the adapter: " + ", ".join(
            f"{x['model']} r={x['lora_rank']} {x['adapter_ms'] / x['base_ms']:.2f}x" for x in f["generate"]
        )
    return "hand-off: " + ", ".join(
        f"{x['model']} {'r=' + str(x['lora_rank']) if x['lora_rank'] else 'full'} {x['bytes'] / 2**20:.2f} MiB in "
        f"{x['sync_ms']:.1f} ms"
        for x in f.get("rows", [])
    )


@summary("tool_demo_curve")
def _sum_tool_demo_curve(r: dict) -> str:
    acc = [x for x in r["figures"].get("records", []) if "heldout_acc" in x]
    if not acc:
        return ""
    return (
        f"held-out {pct(acc[0]['heldout_acc'])} at step {acc[0]['step']} -> {pct(acc[-1]['heldout_acc'])} at step "
        f"{acc[-1]['step']}"
    )


def _generic(r: dict) -> str:
    w = r.get("workload") or {}
    knobs = ", ".join(f"{k} {v}" for k, v in w.items() if not isinstance(v, (dict, list)) and v not in (None, ""))
    scalars = ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in (r.get("figures") or {}).items()
        if isinstance(v, (int, float, str))
    )
    return "; ".join(x for x in (knobs, scalars) if x)


@renderer("history")
def render_history(args: list[str], filters: dict) -> str:
    """Every row of one bench (history:<bench>), newest first: date, machine, commit, what it measured."""
    if not args:
        raise RenderError("history needs a bench: history:<bench>")
    bench = args[0]
    rows = sorted(select(results.load(bench), filters), key=lambda r: r.get("date") or "", reverse=True)
    if not rows:
        raise RenderError(f"history:{bench}: no rows in {results.path_of(bench)}")
    lines = []
    for r in rows:
        what = SUMMARIES.get(bench, _generic)(r) or _generic(r)
        if r.get("text") and not r.get("text_source"):
            first = next((x.strip("# ") for x in r["text"].splitlines() if x.strip()), "")
            what = (what + "; " if what else "") + f"notes: {first[:160]}"
        src = f" (`{r['source']}`)" if r.get("source") else ""
        lines.append(f"- {when(r)}, {machine_label(r.get('machine'))}, commit {commit(r)}: {what}{src}")
    return "\n".join(lines) + (
        f"\n\nEvery row of `bench/results/{bench}.jsonl`, newest first "
        f"(`python -m bench.results {bench}` prints them whole)."
    )


# --- the files ---------------------------------------------------------------------------------------
def render(spec: str) -> str:
    words = spec.split()
    if not words:
        raise RenderError("an empty bench marker")
    name, *args = words[0].split(":")
    if name not in RENDERERS:
        raise RenderError(f"unknown renderer {words[0]!r}: {', '.join(sorted(RENDERERS))} (history:<bench>)")
    opts = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    return RENDERERS[name](args, opts).strip("\n")


def rewrite(text: str) -> tuple[str, list[str]]:
    """The text with every marked region rendered, and the specs of the regions that changed."""
    changed = []

    def one(m: re.Match) -> str:
        spec = m.group("spec").strip()
        if m.group("end") != spec.split()[0]:
            raise RenderError(f"<!-- bench:{spec} --> is closed by <!-- /bench:{m.group('end')} -->")
        body = "\n" + render(spec) + "\n\n"
        if body != m.group("body"):
            changed.append(spec)
        return m.group(1) + body + m.group(4)

    return REGION.sub(one, text), changed


def default_files() -> list[Path]:
    return [results.ROOT / "README.md", *sorted((results.ROOT / "docs").glob("*.md"))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path, help="markdown files (default: README.md and docs/*.md)")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a region is stale")
    ap.add_argument("--list", action="store_true", help="the renderers")
    a = ap.parse_args()
    if a.list:
        for name, fn in RENDERERS.items():
            print(f"{name + (':<bench>' if name == 'history' else ''):<18} {(fn.__doc__ or '').strip()}")
        return 0
    stale = []
    for path in a.files or default_files():
        if not path.exists():
            continue
        text = path.read_text()
        try:
            new, changed = rewrite(text)
        except RenderError as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 2
        stale += [f"{path}: <!-- bench:{s} -->" for s in changed]
        if changed and not a.check:
            path.write_text(new)
    for s in stale:
        print(("stale: " if a.check else "rendered: ") + s)
    return 1 if a.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())

"""`hybridrl report RUN_DIR`: where a run's time and memory went, and whether it was healthy.

Reads RUN_DIR/metrics.jsonl (what progress.RunLog writes) and renders RUN_DIR/report.png and
RUN_DIR/report.html (the PNG embedded, a table of summary numbers, the canaries' warnings and
the run's config). Works on a run that crashed or is still going: it plots what is there.

    hybridrl report runs/20261122-091500
    from hybridrl.observe import report; fig = report.figure("runs/...")   # a matplotlib Figure
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, median


@dataclass
class Run:
    steps: list[dict] = field(default_factory=list)  # one per training step
    evals: list[dict] = field(default_factory=list)  # {"step", "heldout_acc"}
    warnings: list[dict] = field(default_factory=list)  # {"step", "warning"}
    summary: dict = field(default_factory=dict)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the steps that logged `key`."""
        pts = [(r["step"], r[key]) for r in self.steps if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pts], [p[1] for p in pts]

    def has(self, key: str) -> bool:
        return any(key in r for r in self.steps)


def load(run_dir: str | Path) -> Run:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: pass the run directory a `hybridrl train` wrote")
    run = Run()
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)  # Python's json reads the NaN/Infinity it wrote
        except ValueError:  # a row cut short by a full disk or a crash (journal.py)
            continue
        if "summary" in r:
            run.summary = r["summary"]
        elif "warning" in r:
            run.warnings.append(r)
        elif "heldout_acc" in r:
            run.evals.append(r)
        else:
            run.steps.append(r)
    return run


def phase_names(run: Run) -> list[str]:
    """The phases a run timed, in the loop's order (progress.PHASES)."""
    from hybridrl.observe.progress import (  # here, not at the top: progress imports torch, `report` alone needs none
        PHASES,
    )

    seen = {k.split("/", 1)[1] for r in run.steps for k in r if k.startswith("time/")}
    return [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))  # a phase added since: last


def memory_table(run: Run) -> dict[str, dict[str, float]]:
    """{phase: {what: max GB over the run}} from `mem/<phase>/<what>_gb` metrics."""
    out: dict[str, dict[str, float]] = {}
    for r in run.steps:
        for k, v in r.items():
            if k.startswith("mem/") and isinstance(v, (int, float)):
                _, phase, what = k.split("/", 2)
                slot = out.setdefault(phase, {})
                slot[what] = max(slot.get(what, 0.0), v)
    return out


# --- the figure --------------------------------------------------------------------------------
def _lines(ax, run: Run, keys: list[str], title: str, ylabel: str = "", log: bool = False, hline=None):
    for k in keys:
        x, y = run.series(k)
        if x:
            if log:  # exact zeros (fp32 on-policy gaps) would vanish from a log axis
                y = [max(v, 1e-10) for v in y]
            ax.plot(x, y, label=k, lw=1.2)
    if hline is not None:
        ax.axhline(hline[0], color="red", ls="--", lw=0.8, label=hline[1])
    if log:
        ax.set_yscale("log")
    if not ax.lines:
        ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
    elif len(ax.lines) > 1:
        ax.legend(fontsize=7, loc="best")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)


def _band(ax, run: Run, name: str):
    """p10-p90 band and p50 of a distribution metric, when the run logged them."""
    x, lo = run.series(f"{name}/p10")
    _, hi = run.series(f"{name}/p90")
    if x and len(lo) == len(hi):
        ax.fill_between(x, lo, hi, alpha=0.25, label=f"{name} p10-p90")


def time_axis(step_s: list[float]) -> tuple[float, int]:
    """(top of the y axis, number of warm-up steps) for the time-per-step panel.

    The first steps pay for engine warm-up (vLLM's first batch, DeepSpeed's first step, kernel
    caches): on the demo many times a steady step, which scaled the axis so the steady state
    was a flat line at zero. Warm-up = the leading steps (at most 10) longer than 2x the median;
    they are drawn hatched and named, and the axis fits the rest: 1.15x their largest step that
    is at most 3x their median (a rarer spike is cut, not scaled to)."""
    if not step_s:
        return 1.0, 0
    med = median(step_s)
    warm = 0
    while warm < min(10, len(step_s) - 1) and step_s[warm] > 2 * med:
        warm += 1
    steady = step_s[warm:]
    m = median(steady)
    top = max([t for t in steady if t <= 3 * m] or [m])
    return (1.15 * top) or 1.0, warm


def _phase_bars(ax, run: Run):
    bottom = [0.0] * len(run.steps)
    x = [r["step"] for r in run.steps]
    top, warm = time_axis([sum(v for k, v in r.items() if k.startswith("time/")) for r in run.steps])
    for p in phase_names(run):
        h = [r.get(f"time/{p}", 0.0) for r in run.steps]
        bars = ax.bar(x, h, bottom=bottom, width=1.0, label=p, linewidth=0)
        for bar in list(bars)[:warm]:  # warm-up: drawn, marked, off the scale
            bar.set_hatch("//")
            bar.set_edgecolor("white")
        bottom = [b + v for b, v in zip(bottom, h)]
    for w in run.warnings:  # where the canaries fired
        ax.axvline(w["step"], color="red", lw=0.6, alpha=0.5)
    warm_note = ""
    if warm:
        warm_note = (
            f" (hatched: warm-up, step{'s' if warm > 1 else ''} {x[0]}{f'-{x[warm - 1]}' if warm > 1 else ''}"
            f" took {', '.join(f'{b:.1f}' for b in bottom[:warm])} s, off the scale)"
        )
    if x:
        ax.set_ylim(0, top)
    ax.set_title("time per step by phase (red: canary warnings)", fontsize=10)
    ax.set_xlabel("step" + warm_note, fontsize=8)
    ax.set_ylabel("seconds", fontsize=8)
    if x:
        ax.legend(fontsize=7, loc="upper right")


def reward_kind(run: Run) -> str:
    """'binary' when every sample's reward was 0 or 1 (the quantiles say so: a verifier's pass or
    fail), else 'continuous' (a shaped, weighted or learned reward)."""
    for r in run.steps:
        for q in ("p10", "p50", "p90"):
            v = r.get(f"reward/{q}")
            if isinstance(v, (int, float)) and v not in (0.0, 1.0):
                return "continuous"
    return "binary" if any("reward/p50" in r for r in run.steps) else "continuous"


def _reward(ax, run: Run):
    """Binary rewards: the mean is the fraction of samples solved, and a p10-p90 band would only
    say 0-1; so the panel shows that fraction, the share of samples that carried a gradient
    (groups neither all right nor all wrong) and held-out accuracy on one 0-1 axis. Continuous
    rewards: mean, median and the p10-p90 band, held-out accuracy on its own axis."""
    if reward_kind(run) == "binary":
        _lines(ax, run, ["reward", "signal_frac"], "reward and held-out accuracy", "fraction of samples")
        if run.evals:
            ax.plot(
                [e["step"] for e in run.evals],
                [e["heldout_acc"] for e in run.evals],
                "o-",
                color="black",
                label="held-out accuracy",
                lw=1.2,
                ms=3,
            )
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7, loc="best")
        return
    _band(ax, run, "reward")
    _lines(ax, run, ["reward", "reward/p50"], "reward and held-out accuracy", "reward")
    if run.evals:
        twin = ax.twinx()
        twin.plot(
            [e["step"] for e in run.evals],
            [e["heldout_acc"] for e in run.evals],
            "o-",
            color="black",
            label="held-out accuracy",
            lw=1.2,
            ms=3,
        )
        twin.set_ylabel("held-out accuracy", fontsize=8)
        twin.set_ylim(0, 1)
        twin.legend(fontsize=7, loc="lower right")


def _memory(ax, run: Run):
    table = memory_table(run)
    ax.set_title("device memory by phase (max over the run)", fontsize=10)
    if not table:
        ax.text(
            0.5,
            0.5,
            "no GPU memory recorded\n(a CPU run records none)",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="gray",
        )
        ax.set_xticks([])
        ax.set_yticks([])
        return
    phases = [p for p in phase_names(run) if p in table] + sorted(set(table) - set(phase_names(run)))
    kinds = sorted({k for v in table.values() for k in v})
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        ax.bar(
            [j + i * width for j in range(len(phases))],
            [table[p].get(kind, 0.0) for p in phases],
            width=width,
            label=kind.removesuffix("_gb"),
        )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(phases))], phases, fontsize=8)
    ax.set_ylabel("GiB", fontsize=8)
    ax.legend(fontsize=7)


def figure(run: Run | str | Path):
    """The report's panels as a matplotlib Figure (no pyplot: no global state, no display)."""
    from matplotlib.figure import Figure

    run = run if isinstance(run, Run) else load(run)
    fig = Figure(figsize=(14, 19), layout="constrained")
    ax = fig.subplots(5, 2).ravel()
    _phase_bars(ax[0], run)
    _reward(ax[1], run)
    _memory(ax[2], run)
    _lines(ax[3], run, ["rollout_tok_s", "train_tok_s"], "throughput", "tokens/s")
    _lines(
        ax[4],
        run,
        ["clip_frac_low", "clip_frac_high"],
        "clipped token fraction",
        "fraction",
        hline=(0.3, "canary: 0.3 (low + high)"),
    )
    _band(ax[5], run, "ratio")
    _band(ax[5], run, "rollout_ratio")  # trainer / vLLM: skew or wide tails = the engines disagree
    _lines(ax[5], run, ["ratio_mean", "ratio_min", "ratio_max"], "importance ratios (pi/pi_old; trainer/vLLM)", "ratio")
    _lines(
        ax[6],
        run,
        ["logp_gap_mean", "logp_gap_max", "probe_gap"],
        "trainer vs vLLM log-prob gap (sampled tokens; probe batch)",
        "|delta logp|",
        log=True,
    )
    # a distillation run's teacher KL (per-token reverse KL to algo.teacher) beside the policy's entropy
    _lines(ax[7], run, ["entropy_mean", "teacher_kl", "teacher_kl_max"], "entropy; teacher KL (nats/token)", "nats")
    _lines(ax[8], run, ["grad_norm"], "gradient norm (before clipping)", "L2 norm")
    _band(ax[9], run, "response_len")
    _lines(ax[9], run, ["response_len"], "response length (tokens)", "tokens")
    fig.suptitle(f"hybridrl run: {len(run.steps)} steps", fontsize=12)
    return fig


# --- the numbers -------------------------------------------------------------------------------
def _fmt(v, spec=".3g") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def summary_rows(run: Run) -> list[tuple[str, str]]:
    """(label, value) pairs for the HTML table."""

    def col(k, rows=run.steps):
        return [r[k] for r in rows if isinstance(r.get(k), (int, float))]

    s = run.summary
    if s:
        acc = f"{_fmt(s.get('heldout_acc_before'), '.1%')} -> {_fmt(s.get('heldout_acc_after'), '.1%')}"
    else:  # a crashed or running job: first and latest evaluation
        acc = " -> ".join(f"{e['heldout_acc']:.1%}" for e in run.evals[:1] + run.evals[-1:]) or "-"
    last = col("reward", run.steps[-10:])
    rows = [
        ("steps", str(len(run.steps))),
        ("minutes", _fmt(s.get("minutes"), ".1f")),
        ("held-out accuracy", acc),
        ("reward, mean of the last 10 steps", _fmt(mean(last) if last else None)),
    ]
    step_s = [sum(v for k, v in r.items() if k.startswith("time/")) for r in run.steps]
    if step_s:
        rows.append(("step time, median (s)", _fmt(median(step_s))))
        total = sum(step_s) or 1.0
        for p in phase_names(run):
            t = col(f"time/{p}")
            rows.append((f"  {p}: median s, share of all step time", f"{_fmt(median(t))}  ({sum(t) / total:.0%})"))
    for k, label in [("rollout_tok_s", "rollout tokens/s, median"), ("train_tok_s", "train tokens/s, median")]:
        rows.append((label, _fmt(median(col(k)), ".0f") if col(k) else "-"))
    if col("teacher_kl"):
        rows.append(
            (
                "teacher KL, mean of the first and the last 10 steps",
                " -> ".join(_fmt(mean(col("teacher_kl", r))) for r in (run.steps[:10], run.steps[-10:])),
            )
        )
    for k in ("logp_gap_max", "probe_gap", "grad_norm"):
        rows.append((f"{k}, max", _fmt(max(col(k))) if col(k) else "-"))
    for phase, kinds in memory_table(run).items():
        gib = ", ".join(f"{k.removesuffix('_gb')} {v:.2f}" for k, v in kinds.items())
        rows.append((f"memory in {phase} (GiB, max)", gib))
    rows.append(("canary warnings", str(len(run.warnings))))
    return rows


def render(run_dir: str | Path) -> tuple[Path, Path]:
    """Write report.png and report.html into the run dir; returns their paths."""
    run_dir = Path(run_dir)
    run = load(run_dir)
    buf = io.BytesIO()
    figure(run).savefig(buf, format="png", dpi=90)
    png = run_dir / "report.png"
    png.write_bytes(buf.getvalue())
    table = "\n".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in summary_rows(run))
    warnings = "\n".join(f"<li>{html.escape(w['warning'])}</li>" for w in run.warnings) or "<li>none</li>"
    cfg = run_dir / "config.yaml"
    cfg_text = html.escape(cfg.read_text()) if cfg.exists() else "(no config.yaml)"
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>hybridrl report: {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:1300px;margin:auto}} td{{padding:2px 12px}}
tr:nth-child(even){{background:#f3f3f3}} img{{max-width:100%}}</style></head><body>
<h1>hybridrl report: {html.escape(str(run_dir))}</h1>
<table>{table}</table>
<h2>Canary warnings</h2><ul>{warnings}</ul>
<img alt="run report" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">
<details><summary>config.yaml</summary><pre>{cfg_text}</pre></details>
</body></html>
"""
    out = run_dir / "report.html"
    out.write_text(page)
    return png, out

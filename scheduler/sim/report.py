"""The experiment as Markdown for people, JSON for machines and PNG plots.

matplotlib is imported only inside `write_plots` (the `sim` extra), so the simulator
itself needs nothing beyond the standard library.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

from scheduler.sim.metrics import RunStats
from scheduler.sim.targets import (
    ATTAINMENTS,
    LATENCY_TIERS,
    Experiment,
    goodput_at_90,
    latency_goodput,
    refusal_split,
)


def _text(text: str) -> str:
    """Free text (a preset's description) on one Markdown line: a newline ended the
    list item it stood in, and a "|" would end a table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    """`text` as inline code on one line, fenced by more backticks than it holds."""
    text = " ".join(text.split())
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    fence = "`" * (longest + 1)
    return f"{fence}{pad}{text}{pad}{fence}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _codes(counts: dict[str, int]) -> str:
    return ", ".join(f"{c} {n}" for c, n in sorted(counts.items())) or "–"


def _tier_rows(policy: str, load: float, stats: RunStats) -> list[str]:
    rows = []
    for name, t in sorted(stats.tiers.items(), key=lambda kv: kv[0]):
        rows.append(
            f"| {policy} | {load:g}x | {name} | {t.num_offered} | {t.num_admitted} | "
            f"{_pct(t.attainment)} | {_pct(t.admitted_attainment)} | {t.goodput_per_s:.2f} | "
            f"{_ms(t.ttft_p50_ms)} | {_ms(t.ttft_p99_ms)} | {_ms(t.tpot_p50_ms)} | "
            f"{_ms(t.tpot_p99_ms)} | {_codes(t.rejections)} | {_codes(t.dropped)} |"
        )
    return rows


def _limits_lines(experiment: Experiment) -> list[str]:
    rate = experiment.capacity_rate_per_s
    spec = experiment.config.workload(rate, rate)
    seen: dict[str, str] = {}
    for tenant in spec.tenants:
        if tenant.tier in seen:
            continue
        lim = tenant.effective_limits(spec.tier(tenant.tier))
        parts = [
            f"{value} {name}"
            for name, value in (
                ("rpm", lim.rpm),
                ("tpm", lim.tpm),
                ("concurrent", lim.max_concurrency),
            )
            if value is not None
        ]
        seen[tenant.tier] = f"{tenant.tier} {', '.join(parts) or 'unlimited'}"
    return list(seen.values())


def render_markdown(experiment: Experiment, *, command: str = "") -> str:
    config = experiment.config
    params = config.params
    lines = [
        "# tiergate simulate: policy comparison",
        "",
        f"- Preset: {_code(params.name)} ({_text(params.description) or 'custom'}), "
        f"{config.num_engines} engine(s)",
        f"- Workload: three-tier mix (priority / interactive / batch), {config.duration_s:g} s of "
        f"arrivals + {config.drain_s:g} s drain, seed {config.seed}",
        f"- 1.0x load = {experiment.capacity_rate_per_s:.2f} requests/s, "
        + (
            "given with --capacity (not checked against FCFS here)"
            if config.capacity_rate_per_s is not None
            else "the rate at which FCFS keeps 90% interactive attainment"
        ),
        "- Per-tenant limits (the gateway's, for every policy): the seeded tier defaults, raised "
        "to twice what a tenant's share of 1.0x needs: " + "; ".join(_limits_lines(experiment)),
    ]
    if command:
        lines += ["", "Reproduce with:", "", "```bash", command, "```"]
    if experiment.targets:
        lines += [
            "",
            "## Targets",
            "",
            "| # | target | obtained | threshold | result |",
            "|---|---|---|---|---|",
        ]
        for t in experiment.targets:
            verdict = f"**{t.verdict}**" + (f" ({t.reason})" if t.reason else "")
            lines.append(f"| {t.number} | {t.name} | {t.value} | {t.threshold} | {verdict} |")
    lines += [
        "",
        "## Load sweep",
        "",
        "Attainment counts refused requests as misses; goodput is requests/s of priority + "
        "interactive finishing within SLO. Tokens/s is steady-state throughput: output "
        "tokens generated while requests arrived (by engine steps ending by the last "
        "arrival time), over the arrival time; tokens of the drain are not in it.",
        "",
        "| policy | load | priority attainment | interactive attainment | batch attainment | "
        "latency goodput (req/s) | output tokens/s while arrivals ran | preemptions | "
        "recomputed tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, points in experiment.sweep.items():
        for load, stats in sorted(points.items()):
            att = {
                t: stats.tiers[t].attainment if t in stats.tiers else None
                for t in ("priority", "interactive", "batch")
            }
            lines.append(
                f"| {policy} | {load:g}x | {_pct(att['priority'])} | {_pct(att['interactive'])} | "
                f"{_pct(att['batch'])} | {latency_goodput(stats):.2f} | "
                f"{stats.output_tokens_per_s:.0f} | {stats.num_preemptions} | "
                f"{stats.num_recomputed_tokens} |"
            )
    lines += [
        "",
        "Goodput of priority + interactive at the highest load where both keep 90% "
        'attainment (grid, then bisection; "≥" when the highest swept load still does). '
        "Target 4 counts attainment of the offered load (refusals are misses); the same "
        "search on attainment of admitted requests is shown beside it.",
        "",
        "| policy | offered: load | offered: goodput (req/s) | admitted: load | "
        "admitted: goodput (req/s) |",
        "|---|---|---|---|---|",
    ]
    for policy, points in experiment.sweep.items():
        found = experiment.goodput.get(policy)
        cells = []
        for kind in ATTAINMENTS:
            if found is not None:
                g = found[kind]
                load, good, bound = g.load, g.goodput_per_s, g.is_lower_bound
            else:
                load, good = goodput_at_90(points, kind)
                bound = load == max(points)
            cells += [f"{'≥ ' if bound else ''}{load:g}x", f"{good:.2f}"]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Refusals at 1.5x (admission refusals by code). Queue timeouts are drops of admitted "
        "requests: SLO violations, not refusals, so they are counted apart:",
        "",
        "| policy | refused | on batch or over quota | by tier and code | "
        "dropped after admission |",
        "|---|---|---|---|---|",
    ]
    for policy, points in experiment.sweep.items():
        if 1.5 not in points:
            continue
        total, accepted = refusal_split(points[1.5])
        tiers = sorted(points[1.5].tiers.items())
        refused = "; ".join(f"{name}: {_codes(t.rejections)}" for name, t in tiers if t.rejections)
        dropped = "; ".join(f"{name}: {_codes(t.dropped)}" for name, t in tiers if t.dropped)
        lines.append(f"| {policy} | {total} | {accepted} | {refused or '–'} | {dropped or '–'} |")
    lines += [
        "",
        "## Per tier at 1.0x and 1.5x",
        "",
        "Admitted is offered less refused; a request dropped after admission (queue "
        "timeout, or too long for the engine) is admitted and a miss.",
        "",
        "| policy | load | tier | offered | admitted | attainment | admitted attainment | "
        "goodput (req/s) | TTFT P50 ms | TTFT P99 ms | TPOT P50 ms | TPOT P99 ms | refused | "
        "dropped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for policy, points in experiment.sweep.items():
        for load in (1.0, 1.5):
            if load in points:
                lines += _tier_rows(policy, load, points[load])
    lines += [
        "",
        "## Fairness among backlogged tenants of a tier (three-tier mix at 1.5x)",
        "",
        "| policy | tier | tenants | Jain's index | largest weighted service gap (tokens) |",
        "|---|---|---|---|---|",
    ]
    for policy, points in experiment.sweep.items():
        if 1.5 not in points:
            continue
        for tier, f in sorted(points[1.5].fairness.items()):
            jain = "–" if f.jain_index is None else f"{f.jain_index:.4f}"
            lines.append(
                f"| {policy} | {tier} | {len(f.tenants)} | {jain} | {f.max_gap_tokens:.0f} |"
            )
    if experiment.suites:
        lines += [
            "",
            "## Fairness suites",
            "",
            "| suite | policy | metric | value | target | result |",
            "|---|---|---|---|---|---|",
        ]
        for s in experiment.suites:
            verdict = "pass" if s.passed else "fail"
            lines.append(
                f"| {s.suite} | {s.policy} | {s.metric} | {s.value:.4f} | {s.target} | {verdict} |"
            )
    lines.append("")
    return "\n".join(lines)


def to_json(experiment: Experiment) -> str:
    data = {
        "preset": experiment.config.params.to_dict(),
        "num_engines": experiment.config.num_engines,
        "duration_s": experiment.config.duration_s,
        # The drain changes every attainment (what is unfinished at its end is missed).
        "drain_s": experiment.config.drain_s,
        "suite_duration_s": experiment.config.suite_duration_s,
        "load_factors": list(experiment.config.load_factors),
        "policies": list(experiment.config.policies),
        "seed": experiment.config.seed,
        "capacity_rate_per_s": experiment.capacity_rate_per_s,
        "targets": [asdict(t) for t in experiment.targets],
        "goodput_at_90": {
            policy: {kind: asdict(g) for kind, g in found.items()}
            for policy, found in experiment.goodput.items()
        },
        "sweep": {
            policy: {f"{load:g}": stats.to_dict() for load, stats in sorted(points.items())}
            for policy, points in experiment.sweep.items()
        },
        "suites": [asdict(s) for s in experiment.suites],
    }
    return json.dumps(data, indent=2)


def write_plots(experiment: Experiment, out_dir: Path) -> list[Path]:
    """attainment.png (priority and interactive attainment) and goodput.png against
    load, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    from matplotlib import pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(1, len(LATENCY_TIERS), figsize=(11, 4), sharey=True)
    for ax, tier in zip(axes, LATENCY_TIERS, strict=True):
        for policy, points in experiment.sweep.items():
            loads = sorted(points)
            values = [
                points[x].tiers[tier].attainment if tier in points[x].tiers else None for x in loads
            ]
            ax.plot(loads, values, marker="o", label=policy)
        ax.axhline(0.9, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{tier} SLO attainment")
        ax.set_xlabel("load (x FCFS 90% capacity)")
        ax.set_ylim(0, 1.02)
    axes[0].set_ylabel("attainment of offered requests")
    axes[0].legend()
    fig.tight_layout()
    path = out_dir / "attainment.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, points in experiment.sweep.items():
        loads = sorted(points)
        ax.plot(loads, [latency_goodput(points[x]) for x in loads], marker="o", label=policy)
    ax.set_title("goodput of priority + interactive")
    ax.set_xlabel("load (x FCFS 90% capacity)")
    ax.set_ylabel("requests/s within SLO")
    ax.legend()
    fig.tight_layout()
    path = out_dir / "goodput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


PLOT_NAMES = ("attainment.png", "goodput.png")


def report_paths(out_dir: Path, *, plots: bool = True) -> list[Path]:
    """The files write_report writes in out_dir."""
    names = ["report.md", "report.json"] + (list(PLOT_NAMES) if plots else [])
    return [out_dir / name for name in names]


def write_report(
    experiment: Experiment, out_dir: Path, *, command: str = "", plots: bool = True
) -> list[Path]:
    """report.md, report.json and (with plots) the PNGs in out_dir: report_paths.
    Without plots, the PNGs of an earlier report in out_dir are removed: left beside
    the new report they would read as its plots."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if not plots:
        for name in PLOT_NAMES:
            (out_dir / name).unlink(missing_ok=True)
    md = out_dir / "report.md"
    md.write_text(render_markdown(experiment, command=command), encoding="utf-8")
    js = out_dir / "report.json"
    js.write_text(to_json(experiment) + "\n", encoding="utf-8")
    paths = [md, js]
    if plots:
        paths += write_plots(experiment, out_dir)
    return paths

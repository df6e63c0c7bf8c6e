"""Tables and plots from the suite's JSON records (benchmarks/results/suite*.json).

Run: python -m benchmarks.report [--results benchmarks/results] [--scaling-tokens 256] [--smoke]
(``--smoke``: the smoke records instead, from the smoke runs' temporary directory, written as
``suite_smoke_*`` there)

Records of runs at different world sizes (or of different workloads / token counts at one world
size) combine: for every (world size, workload, tokens, system) the newest record holding it
wins. Writes, next to the records:

- ``suite_latency_w<N>.png``: median latency against tokens, one line per system, one panel per
  workload (log-log), for every world size N with a record;
- ``suite_scaling.png``: median latency against world size at ``--scaling-tokens`` tokens;
- ``suite_scaling.md``: the same numbers as a table.

``suite.py`` imports the table functions (``group_table``, ``markdown``, ``summary``) from here.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Any

from benchmarks._common import out_path

BASELINES = (("dtensor inductor", "DTensor compiled"), ("dtensor eager", "DTensor eager"), ("bound", "bound"))


def _ratio(ms: float, by_name: dict[str, float], base: str) -> str:
    return f"{ms / by_name[base]:.2f}" if base in by_name else "n/a"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _timed(r: dict[str, Any]) -> bool:
    """A result with timings: not a failed system, nor one the workload cannot run ("not_applicable")."""
    return "median_ms" in r


def group_table(group: list[dict[str, Any]], world: int) -> str:
    """One workload at one token count: every system, ratios against the baselines."""
    first = next((r for r in group if r.get("loadavg")), group[0])
    ok = [r for r in group if _timed(r)]
    by_name = {r["system"]: r["median_ms"] for r in ok}
    iters = len(ok[0]["per_rank"][0]["times_s"]) if ok else 0
    lines = [
        f"### {first['workload']}, {first['tokens']} tokens, world {world} "
        f"(median of {iters} interleaved calls, slowest rank)",
        "",
        *([f"Load average (1 min, all processes on the machine): {first['loadavg'][0]:.1f} before building, "
           f"{first['loadavg'][1]:.1f} before timing, {first['loadavg'][2]:.1f} after.", ""]
          if first.get("loadavg") else []),
        "| system | median ms | min ms | vs DTensor compiled | vs DTensor eager | vs bound | first call s "
        "| recompile s | held MiB/rank | RSS / peak MiB | max abs diff | collectives per call |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in group:
        if "error" in r:
            lines.append(f"| {r['system']} | failed: {r['error'].splitlines()[0][:200]} |" + " |" * 10)
            continue
        if "not_applicable" in r:
            lines.append(f"| {r['system']} | n/a: {r['not_applicable']} |" + " |" * 10)
            continue
        ms = r["median_ms"]
        diff = "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}" + ("" if r["ok"] else " (FAIL)")
        lines.append(
            f"| {r['system']} | {ms:.2f} | {r['min_ms']:.2f} | "
            + " | ".join(_ratio(ms, by_name, b) for b, _ in BASELINES)
            + f" | {_s(r['first_call_s'])} | {_s(r['recompile_s'])} | {_mib(r['held_param_bytes'])} "
            f"| {_mib(r['rss_bytes'])} / {_mib(r['peak_rss_bytes'])} | {diff} | {r['collectives']} |"
        )
    if "bound compute" in by_name and "bound comm" in by_name:
        c, m = by_name["bound compute"], by_name["bound comm"]
        lines += ["", f"bound compute + bound comm (medians measured apart): {c:.2f} + {m:.2f} = {c + m:.2f} ms"]
    return "\n".join(lines) + "\n"


def _groups(rec: dict[str, Any]) -> list[list[dict[str, Any]]]:
    keyed: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rec["results"]:
        keyed.setdefault((r["workload"], r["tokens"]), []).append(r)
    return list(keyed.values())


def summary(rec: dict[str, Any]) -> str:
    """dynashard (Inductor) against the baselines, one row per workload and token count."""
    lines = [
        f"### dynashard inductor, world {rec['world_size']}: latency ratios (lower is faster)",
        "",
        "| workload | tokens | dynashard inductor ms | vs DTensor compiled | vs DTensor eager | vs bound "
        "| vs bound compute + comm | collectives per call |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for group in _groups(rec):
        by_name = {r["system"]: r["median_ms"] for r in group if _timed(r)}
        mine = next((r for r in group if r["system"] == "dynashard inductor" and _timed(r)), None)
        if mine is None:
            continue
        ms = by_name["dynashard inductor"]
        parts = ("bound compute", "bound comm")
        split = f"{ms / sum(by_name[p] for p in parts):.2f}" if all(p in by_name for p in parts) else "n/a"
        lines.append(
            f"| {mine['workload']} | {mine['tokens']} | {ms:.2f} | "
            + " | ".join(_ratio(ms, by_name, b) for b, _ in BASELINES)
            + f" | {split} | {mine['collectives']} |"
        )
    return "\n".join(lines) + "\n"


def markdown(rec: dict[str, Any]) -> str:
    cfg, hw = rec["config"], rec["hardware"]
    head = (
        f"## Suite, world {rec['world_size']}\n\n"
        f"{hw['cpu_model'] or hw['machine']} ({hw['cpu_count']} cores), {rec['threads_per_rank']} thread(s) per "
        f"rank, torch {rec['torch']}, gloo, {rec['date']}; {cfg['iters']} timed rounds after {cfg['warmup']} "
        f"warm-up rounds; ratio = this system's median / the baseline's (lower is faster)."
        + ("" if cfg.get("compiler", "inductor") == "inductor" else
           f" The 'inductor' systems and the bound were compiled with {cfg['compiler']!r}, not Inductor.")
        + "\n"
    )
    return "\n".join([head, summary(rec), *(group_table(g, rec["world_size"]) for g in _groups(rec))])


# --- combining records and plotting ----------------------------------------------------------------


def load(results_dir: str, smoke: bool) -> dict[tuple[int, str, int, str], dict[str, Any]]:
    """(world, workload, tokens, system) -> result, the newest record winning; in the suite's order."""
    records = []
    for path in glob.glob(os.path.join(results_dir, "suite*.json")):
        with open(path) as f:
            rec = json.load(f)
        if "plans" in rec.get("config", {}) and bool(rec["config"].get("smoke")) == smoke:
            records.append(rec)
    best: dict[tuple[int, str, int, str], dict[str, Any]] = {}
    for rec in sorted(records, key=lambda r: r["date"]):
        for r in rec["results"]:
            if _timed(r):
                best[(rec["world_size"], r["workload"], r["tokens"], r["system"])] = r
    systems = list(dict.fromkeys(s for rec in records for s in rec["config"]["systems"]))
    workloads = list(dict.fromkeys(w for rec in records for w in rec["config"]["workloads"]))
    return dict(sorted(best.items(), key=lambda kv: (kv[0][0], workloads.index(kv[0][1]), kv[0][2],
                                                     systems.index(kv[0][3]))))


def _style(system: str) -> dict[str, Any]:
    """dynashard bold, eager systems dashed, the bound's parts dotted."""
    if system.startswith("bound "):
        return {"linestyle": ":"}
    return {"linestyle": "--" if system.endswith("eager") else "-", "linewidth": 2.5 if "dynashard" in system else 1.5}


def _panels(plt: Any, workloads: list[str]) -> tuple[Any, list[Any]]:
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.5), squeeze=False)
    return fig, list(axes[0])


def plot(best: dict[tuple[int, str, int, str], dict[str, Any]], out_dir: str, scaling_tokens: int,
         prefix: str = "suite") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    worlds = sorted({k[0] for k in best})
    workloads = list(dict.fromkeys(k[1] for k in best))
    systems = list(dict.fromkeys(k[3] for k in best))
    for world in worlds:
        fig, axes = _panels(plt, workloads)
        for ax, wl in zip(axes, workloads):
            for system in systems:
                key = (world, wl, system)
                pts = sorted((k[2], r["median_ms"]) for k, r in best.items() if (k[0], k[1], k[3]) == key)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=system, **_style(system))
            ax.set(title=f"{wl}, world {world}", xlabel="tokens", ylabel="median ms (slowest rank)")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=8)
        path = os.path.join(out_dir, f"{prefix}_latency_w{world}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    fig, axes = _panels(plt, workloads)
    for ax, wl in zip(axes, workloads):
        for system in systems:
            pts = sorted((k[0], r["median_ms"]) for k, r in best.items() if k[1:] == (wl, scaling_tokens, system))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system, **_style(system))
        ax.set(title=f"{wl}, {scaling_tokens} tokens", xlabel="world size", ylabel="median ms (slowest rank)")
        ax.set_xticks(worlds)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    path = os.path.join(out_dir, f"{prefix}_scaling.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [*written, path]


def scaling_table(best: dict[tuple[int, str, int, str], dict[str, Any]], tokens: int) -> str:
    worlds = sorted({k[0] for k in best})
    lines = [
        f"### Scaling at {tokens} tokens: median ms (slowest rank) per world size",
        "",
        "| workload | system | " + " | ".join(f"world {w}" for w in worlds) + " |",
        "|---|---|" + "---:|" * len(worlds),
    ]
    rows = list(dict.fromkeys((k[1], k[3]) for k in best if k[2] == tokens))
    for wl, system in rows:
        cells = [best.get((w, wl, tokens, system)) for w in worlds]
        text = ("-" if c is None else f"{c['median_ms']:.2f}" for c in cells)
        lines.append(f"| {wl} | {system} | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=None,
                    help="records directory (default: benchmarks/results; --smoke: the smoke runs' one)")
    ap.add_argument("--scaling-tokens", type=int, default=256, help="token count of the scaling plot and table")
    ap.add_argument("--smoke", action="store_true", help="use the smoke records instead of the real ones")
    args = ap.parse_args()
    args.results = args.results or os.path.dirname(out_path(None, "suite", args.smoke))
    best = load(args.results, args.smoke)
    if not best:
        raise SystemExit(f"no suite records in {args.results} (run python -m benchmarks.suite first)")
    prefix = "suite_smoke" if args.smoke else "suite"
    table = scaling_table(best, args.scaling_tokens)
    with open(os.path.join(args.results, f"{prefix}_scaling.md"), "w") as f:
        f.write(table)
    print(table)
    for path in plot(best, args.results, args.scaling_tokens, prefix):
        print("wrote", path)


if __name__ == "__main__":
    main()

"""Plots of a results JSON: time and peak working memory vs tokens N and vs vocabulary V.

    python -m benchmarks.plot benchmarks/results/cpu-quick.json

One PNG per (op, case, dtype) next to the JSON: rows = fwd, fwd+bwd; columns = time vs N, memory vs
N (at the V with the most N values), time vs V, memory vs V (at the N with the most V values).
One line per implementation; the error bars are p20..p80.
"""

import json
import os
import sys
from collections import Counter, defaultdict
from typing import List


def plot_file(path: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        data = json.load(f)
    ok = [r for r in data["results"] if r.get("status") == "ok"]
    env = data.get("environment", {})
    where = env.get("gpu") or env.get("cpu_model", "?")
    stem = os.path.splitext(path)[0]
    groups = defaultdict(list)
    for r in ok:
        groups[(r["op"], r["case"], r["dtype"])].append(r)
    written = []
    for (op, case, dtype), rows in sorted(groups.items(), key=lambda kv: str(kv[0])):
        shapes = {(r["N"], r["V"]) for r in rows}
        v_star = Counter(v for _, v in shapes).most_common(1)[0][0]
        n_star = Counter(n for n, _ in shapes).most_common(1)[0][0]
        modes = [m for m in ("fwd", "fwdbwd") if any(r["mode"] == m for r in rows)]
        fig, axes = plt.subplots(len(modes), 4, figsize=(20, 4.2 * len(modes)), squeeze=False)
        for i, mode in enumerate(modes):
            sel = [r for r in rows if r["mode"] == mode]
            panels = [("N", "V", v_star, "time"), ("N", "V", v_star, "mem"),
                      ("V", "N", n_star, "time"), ("V", "N", n_star, "mem")]
            for j, (xkey, fixkey, fixval, what) in enumerate(panels):
                ax = axes[i][j]
                for provider in sorted({r["provider"] for r in sel}):
                    pts = sorted((r[xkey], r) for r in sel if r["provider"] == provider and r[fixkey] == fixval)
                    if not pts:
                        continue
                    xs = [p[0] for p in pts]
                    if what == "time":
                        ys = [p[1]["time_ms"]["median"] for p in pts]
                        lo = [y - p[1]["time_ms"]["p20"] for y, p in zip(ys, pts)]
                        hi = [p[1]["time_ms"]["p80"] - y for y, p in zip(ys, pts)]
                        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=provider)
                    else:
                        ys = [max(p[1]["peak_mem_bytes"], 0) / 2**20 for p in pts]
                        ax.plot(xs, ys, marker="o", label=provider)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel(f"{xkey} ({fixkey} = {fixval})")
                ax.set_ylabel("median time [ms]" if what == "time" else "peak working memory [MiB]")
                quantity = "time" if what == "time" else "memory"
                ax.set_title(f"{op}{'/' + case if case else ''} {dtype} {mode}: {quantity} vs {xkey}")
                ax.grid(True, which="both", alpha=0.3)
                if ax.lines:
                    ax.legend(fontsize=8)
        commit = str(env.get("git_commit"))[:10]
        fig.suptitle(f"{os.path.basename(path)} - {where} - torch {env.get('torch')} - commit {commit}")
        fig.tight_layout()
        out = f"{stem}-{op}{'-' + case if case else ''}-{dtype}.png"
        fig.savefig(out, dpi=90)
        plt.close(fig)
        written.append(out)
    return written


def main(argv=None) -> int:
    paths = argv if argv is not None else sys.argv[1:]
    if not paths:
        print(__doc__)
        return 2
    for p in paths:
        for out in plot_file(p):
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

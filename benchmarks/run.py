"""The benchmark CLI: every provider on every problem of a suite, in one run.

    python -m benchmarks.run --device cpu --suite quick [--out benchmarks/results]
    python -m benchmarks.run --device cuda --suite full --peak-gbps 4800

CPU: each (provider, problem) runs in a fresh subprocess (benchmarks.worker) so its peak RSS is its
own. CUDA: everything runs in this process; peak memory comes from the caching allocator.
Writes <out>/<device>-<suite>.json (results + environment) and prints a table; plots with
`python -m benchmarks.plot <json>`.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from typing import List, Optional

from .worker import MARKER

# (op, case, N, V, dtype); op "logprobs" has no case
SUITES = {
    ("cpu", "quick"): [
        *[("ppo", "seq_mis", N, V, "fp32") for N, V in ((1024, 32768), (4096, 32768), (512, 151936))],
        *[("logprobs", None, N, V, "fp32") for N, V in ((1024, 32768), (4096, 32768), (512, 151936))],
        ("ppo", "token_tis", 1024, 4096, "fp32"),  # the size at which Liger's CPU path (identity lm_head) runs
    ],
    ("cpu", "full"): [
        *[("ppo", "seq_mis", N, V, "fp32") for V in (32768, 128256, 151936, 262144) for N in (1024, 4096)],
        *[("ppo", "geo_rs_token_tis", 4096, 32768, "fp32")],
        *[("logprobs", None, N, V, "fp32") for V in (32768, 128256, 151936, 262144) for N in (1024, 4096)],
        ("ppo", "token_tis", 1024, 4096, "fp32"),
        ("ppo", "token_tis", 4096, 8192, "fp32"),
    ],
    ("cuda", "quick"): [
        *[("ppo", "seq_mis", N, V, "bf16") for N, V in ((4096, 32768), (8192, 151936))],
        *[("logprobs", None, N, V, "bf16") for N, V in ((4096, 32768), (8192, 151936))],
        ("ppo", "token_tis", 8192, 151936, "bf16"),
    ],
    ("cuda", "full"): [
        *[("ppo", "seq_mis", N, V, "bf16") for V in (32768, 128256, 151936, 262144) for N in (1024, 4096, 8192, 16384)],
        *[("ppo", "geo_rs_token_tis", 8192, 151936, "bf16")],
        *[("logprobs", None, N, V, "bf16") for V in (32768, 128256, 151936, 262144) for N in (1024, 4096, 8192, 16384)],
        *[("ppo", "token_tis", N, 151936, "bf16") for N in (4096, 8192, 16384)],
        ("ppo", "seq_mis", 8192, 151936, "fp32"),
    ],
}
DEFAULTS = {("cpu", "quick"): (1, 3, 15.0), ("cpu", "full"): (1, 5, 30.0),
            ("cuda", "quick"): (3, 20, 5.0), ("cuda", "full"): (5, 50, 10.0)}  # warmup, reps, seconds cap
TOLERANCE = {"value": 1e-4, "grad_abs_sum": 1e-3}  # relative, against rlkernels[torch]


def _jobs(suite_rows, providers: List[str]):
    for op, case, N, V, dtype in suite_rows:
        for p in providers:
            yield {"provider": p, "op": op, "case": case, "N": N, "V": V, "dtype": dtype}


def _run_subprocess(spec: dict, timeout: float) -> List[dict]:
    cmd = [sys.executable, "-m", "benchmarks.worker", json.dumps(spec)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [dict(spec, mode=m, status="error", reason=f"timed out after {timeout:.0f} s") for m in spec["modes"]]
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    reason = f"worker exit {proc.returncode}: {tail[0][:300]}"
    return [dict(spec, mode=m, status="error", reason=reason) for m in spec["modes"]]


def check_agreement(records: List[dict]) -> List[dict]:
    """Every provider's loss (and |grad| sum) against rlkernels[torch] on the same inputs."""
    from .providers import REFERENCE

    refs = {}
    for r in records:
        if r["provider"] == REFERENCE and r.get("status") == "ok":
            refs[(r["op"], r["case"], r["N"], r["V"], r["dtype"], r["mode"])] = r
    checks = []
    for r in records:
        key = (r["op"], r["case"], r["N"], r["V"], r["dtype"], r["mode"])
        if r["provider"] == REFERENCE or r.get("status") != "ok" or key not in refs:
            continue
        for field, tol in TOLERANCE.items():
            if field not in r or field not in refs[key]:
                continue
            ref = refs[key][field]
            rel = abs(r[field] - ref) / max(abs(ref), 1e-12)
            checks.append({"op": r["op"], "case": r["case"], "N": r["N"], "V": r["V"], "dtype": r["dtype"],
                           "mode": r["mode"], "provider": r["provider"], "reference": REFERENCE, "field": field,
                           "value": r[field], "ref_value": ref, "rel_err": rel, "tol": tol, "ok": rel <= tol})
    return checks


def headline(records: List[dict], N: int, V: int, dtype: str, op="ppo", case="seq_mis", mode="fwdbwd") -> List[dict]:
    rows = [r for r in records if r["op"] == op and r["case"] == case and r["N"] == N and r["V"] == V
            and r["dtype"] == dtype and r["mode"] == mode and r.get("status") == "ok"]
    naive = next((r for r in rows if r["provider"] == "naive"), None)
    out = []
    for r in rows:
        row = {"provider": r["provider"], "time_ms": r["time_ms"]["median"], "p20": r["time_ms"]["p20"],
               "p80": r["time_ms"]["p80"], "peak_mem_MiB": r["peak_mem_bytes"] / 2**20}
        if naive:
            row["time_vs_naive"] = r["time_ms"]["median"] / naive["time_ms"]["median"]
            row["mem_vs_naive"] = r["peak_mem_bytes"] / max(naive["peak_mem_bytes"], 1)
        out.append(row)
    return out


def format_table(records: List[dict]) -> str:
    lines = [f"{'op':9} {'case':16} {'N':>6} {'V':>7} {'dt':4} {'mode':6} {'provider':17} {'median ms':>10} "
             f"{'p20':>9} {'p80':>9} {'peak MiB':>9} {'GB/s':>7}  note"]
    for r in records:
        if r.get("status") == "ok":
            t = r["time_ms"]
            pct = f" ({r['pct_peak']:.0f}%)" if "pct_peak" in r else ""
            lines.append(f"{r['op']:9} {str(r['case']):16} {r['N']:>6} {r['V']:>7} {r['dtype']:4} {r['mode']:6} "
                         f"{r['provider']:17} {t['median']:>10.2f} {t['p20']:>9.2f} {t['p80']:>9.2f} "
                         f"{r['peak_mem_bytes'] / 2**20:>9.1f} {r['gbps']:>7.2f}{pct}")
        else:
            lines.append(f"{r['op']:9} {str(r['case']):16} {r['N']:>6} {r['V']:>7} {r['dtype']:4} {r['mode']:6} "
                         f"{r['provider']:17} {'-':>10} {'':>9} {'':>9} {'':>9} {'':>7}  "
                         f"{r['status']}: {r.get('reason', '')[:110]}")
    return "\n".join(lines)


def default_tag(device: str, suite: str, shapes: Optional[List[str]]) -> str:
    """The results file's stem: the suite's (`cpu-quick`), or with --shape one named after the shapes, so that a
    one-off shape never overwrites a suite's (committed) results."""
    if not shapes:
        return f"{device}-{suite}"
    names = ["-".join(part for part in shape.replace("-", "").split(":") if part) for shape in shapes]
    return f"{device}-shapes-" + "_".join(names)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--suite", choices=("quick", "full", "tiny"), default="quick")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--peak-gbps", type=float, default=4800.0,
                        help="peak memory bandwidth for %% of peak (H200: 4800)")
    parser.add_argument("--providers", default=None, help="comma list (default: all); e.g. naive,rlkernels[torch]")
    parser.add_argument("--shape", action="append", default=None,
                        help="OP:CASE:N:V:DTYPE instead of a suite (CASE '-' for logprobs), repeatable")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--max-seconds", type=float, default=None, help="time cap per (provider, problem, mode)")
    parser.add_argument("--timeout", type=float, default=900.0, help="CPU: seconds before a worker is killed")
    parser.add_argument("--tag", default=None, help="file name stem (default: <device>-<suite>, or with --shape "
                                                   "<device>-<the shapes>: never a suite's file)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--in-process", action="store_true",
                        help="CPU: measure in this process instead of one fresh subprocess per job (faster; "
                             "peak RSS then also carries what earlier jobs left behind)")
    args = parser.parse_args(argv)

    import torch
    from tqdm import tqdm

    from .harness import environment, measure
    from .problems import CASES
    from .providers import PROVIDERS, REFERENCE

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device in this process", file=sys.stderr)
        return 2
    if args.shape:
        rows = []
        for s in args.shape:
            op, case, N, V, dt = s.split(":")
            rows.append((op, None if case in ("-", "") else case, int(N), int(V), dt))
    elif args.suite == "tiny":
        rows = [("ppo", "seq_mis", 256, 2048, "fp32")]
    else:
        rows = SUITES[(args.device, args.suite)]
    warmup, reps, cap = DEFAULTS.get((args.device, args.suite), (1, 3, 5.0))
    warmup = args.warmup if args.warmup is not None else warmup
    reps = args.reps if args.reps is not None else reps
    cap = args.max_seconds if args.max_seconds is not None else cap
    providers = args.providers.split(",") if args.providers else list(PROVIDERS)
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        parser.error(f"unknown provider(s) {unknown}; known: {list(PROVIDERS)}")

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.tag or default_tag(args.device, args.suite, args.shape)}.json")
    started = time.time()
    records: List[dict] = []
    N0, V0, dt0 = (4096, 32768, "fp32") if args.device == "cpu" else (8192, 151936, "bf16")

    def save(partial: bool) -> dict:
        result = {
            "schema": "rlkernels-bench/1",
            "partial": partial,
            "environment": environment(args.device),
            "settings": {
                "device": args.device, "suite": args.suite, "warmup": warmup, "reps": reps, "max_seconds": cap,
                "peak_gbps": args.peak_gbps if args.device == "cuda" else None,
                "command": " ".join(["python -m benchmarks.run", *(argv if argv is not None else sys.argv[1:])]),
                "wall_seconds": time.time() - started,
                "bytes_model": "fwd: 1 read of N*V logits; fwdbwd: 2 reads + 1 write",
                "memory": "peak working memory above the inputs and the gradient buffer",
                "isolation": "in-process" if (args.in_process or args.device == "cuda") else "subprocess per job",
            },
            "results": records,
            "checks": check_agreement(records),
            "headline": {"N": N0, "V": V0, "dtype": dt0, "op": "ppo", "case": "seq_mis", "mode": "fwdbwd",
                         "rows": headline(records, N0, V0, dt0)},
        }
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)
        return result

    jobs = list(_jobs(rows, providers))
    peak = args.peak_gbps if args.device == "cuda" else None
    common = {"device": args.device, "warmup": warmup, "reps": reps, "max_seconds": cap, "peak_gbps": peak,
              "modes": ["fwd", "fwdbwd"]}
    for job in tqdm(jobs, desc=f"{args.device}/{args.suite}", unit="job", file=sys.stderr):
        spec = dict(job, **common)
        case = CASES[job["case"]] if job["case"] else None
        reason = PROVIDERS[job["provider"]].skip_reason(job["op"], case, job["V"], args.device)
        if reason:  # decided here, without paying for a subprocess
            recs = [dict(job, kind=PROVIDERS[job["provider"]].kind, device=args.device, mode=m, status="skipped",
                         reason=reason, layout=case.layout if case else "mixed") for m in common["modes"]]
        elif args.device == "cpu" and not args.in_process:
            recs = _run_subprocess(spec, args.timeout)
        else:
            recs = measure(PROVIDERS[job["provider"]], job["op"], CASES[job["case"]] if job["case"] else None,
                           job["N"], job["V"], job["dtype"], args.device, warmup=warmup, reps=reps, max_seconds=cap,
                           peak_gbps=peak)
            if args.device == "cuda":
                torch.cuda.empty_cache()
        for r in recs:
            if r.get("status") != "ok":
                tqdm.write(f"  {r['provider']} {r['op']} N={r['N']} V={r['V']} {r['mode']}: "
                           f"{r['status']}: {r.get('reason')}",
                           file=sys.stderr)
        records.extend(recs)
        save(partial=True)  # a run killed by a time limit still leaves what it measured

    result = save(partial=False)
    checks = result["checks"]
    print(format_table(records))
    bad = [c for c in checks if not c["ok"]]
    if checks:
        print(f"\nagreement with {REFERENCE}: {len(checks) - len(bad)}/{len(checks)} within tolerance "
              f"(loss 1e-4 rel, |grad| sum 1e-3 rel)")
    else:
        print(f"\nagreement: not checked ({REFERENCE}, the reference, "
              f"{'was not among the providers' if REFERENCE not in providers else 'measured nothing'})")
    for c in bad:
        print(f"  MISMATCH {c['provider']} {c['op']} {c['case']} N={c['N']} V={c['V']} {c['mode']} {c['field']}: "
              f"{c['value']:.8g} vs {c['ref_value']:.8g} (rel {c['rel_err']:.2e})")
    if result["headline"]["rows"]:
        print(f"\nheadline: ppo/seq_mis N={N0} V={V0} {dt0} fwd+bwd")
        for row in result["headline"]["rows"]:
            ratios = (f"  time x{row['time_vs_naive']:.2f}  mem x{row['mem_vs_naive']:.3f} vs naive"
                      if "time_vs_naive" in row else "")
            print(f"  {row['provider']:17} {row['time_ms']:>9.1f} ms  {row['peak_mem_MiB']:>8.1f} MiB{ratios}")
    print(f"\nwrote {path}")
    if not args.no_plot:
        try:
            from .plot import plot_file

            for png in plot_file(path):
                print(f"wrote {png}")
        except Exception as exc:  # noqa: BLE001 - plots are optional (matplotlib missing, no data)
            print(f"plots skipped: {type(exc).__name__}: {exc}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

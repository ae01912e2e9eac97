"""One measurement in a fresh process (so that its peak RSS belongs to one provider on one shape).

    python -m benchmarks.worker '{"provider": "naive", "op": "ppo", "case": "seq_mis", "N": 1024, ...}'

Prints one line `@@RESULT@@ <json list of records>` on stdout.
"""

import json
import sys

MARKER = "@@RESULT@@"


def main(argv=None) -> int:
    spec = json.loads((argv or sys.argv[1:])[0])
    from .harness import measure
    from .problems import CASES
    from .providers import PROVIDERS

    case = CASES[spec["case"]] if spec.get("case") else None
    records = measure(
        PROVIDERS[spec["provider"]], spec["op"], case, spec["N"], spec["V"], spec["dtype"], spec["device"],
        modes=tuple(spec.get("modes", ("fwd", "fwdbwd"))), warmup=spec.get("warmup", 1), reps=spec.get("reps", 5),
        max_seconds=spec.get("max_seconds", 20.0), peak_gbps=spec.get("peak_gbps"), seed=spec.get("seed", 0),
    )
    print(MARKER, json.dumps(records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

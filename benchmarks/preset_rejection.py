"""What each `RolloutCorrection` preset rejects at its default bounds, on a synthetic train-inference mismatch.

    python -m benchmarks.preset_rejection            # prints the table; writes benchmarks/results/preset-rejection.json

Each token's IS log-ratio log pi_old - log mu is drawn independently from N(0, sigma^2), the per-token noise of a
bf16 / FP8 sampler (docs/study.md measured about 0.03 on its FP8 path); every sequence has T response tokens. The
table gives the share of sequences the preset drops (no token left in the final mask), through
`rlkernels.rollout_correction` itself. A real mismatch is heavier-tailed and correlated along a sequence, so the
table is a floor: the point is the order of magnitude, which for verl's geo_rs band (0.999, 1.001) is "almost
everything" (its bound on the mean log-ratio, 0.001, is below sigma / sqrt(T) for every T here but the longest).
"""

import argparse
import json
from pathlib import Path

import torch

import rlkernels
from rlkernels import RolloutCorrection

PRESETS = {  # the presets that reject, at their defaults (token_tis, seq_tis and icepop never drop a sequence)
    "seq_mis": RolloutCorrection.seq_mis(),
    "geo_rs": RolloutCorrection.geo_rs(),
    "geo_rs_token_tis": RolloutCorrection.geo_rs_token_tis(),
    "k3_rs": RolloutCorrection.k3_rs(),
}
SIGMAS = (0.01, 0.03, 0.05)
LENGTHS = (16, 256, 4096)
RESULTS = Path(__file__).resolve().parent / "results" / "preset-rejection.json"


def rejected_share(rc: RolloutCorrection, sigma: float, length: int, sequences: int, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(sequences, length, generator=gen, dtype=torch.float64) * sigma
    rollout = -torch.rand(sequences, length, generator=gen, dtype=torch.float64) * 3
    mask = torch.ones(sequences, length, dtype=torch.bool)
    out = rlkernels.rollout_correction(rollout + log_ratio, rollout, mask, config=rc)
    return float((~out.mask.any(1)).double().mean())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.preset_rejection", description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=512, help="sequences per cell (default 512)")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="the JSON written (default benchmarks/results/preset-rejection.json)")
    args = parser.parse_args(argv)
    table = {name: {f"sigma={s:g}": {f"T={t}": rejected_share(rc, s, t, args.sequences) for t in LENGTHS}
                    for s in SIGMAS} for name, rc in PRESETS.items()}
    cells = [(s, t) for s in SIGMAS for t in LENGTHS]
    print("| preset | " + " | ".join(f"σ = {s:g}, T = {t}" for s, t in cells) + " |")
    print("|---|" + "---:|" * len(cells))
    for name, row in table.items():
        print(f"| `{name}` | " + " | ".join(f"{row[f'sigma={s:g}'][f'T={t}']:.0%}" for s, t in cells) + " |")
    record = {"what": "share of sequences each preset rejects at its default bounds; per-token log-ratio ~ "
                      "N(0, sigma^2), T tokens per sequence", "sequences": args.sequences, "rejected": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return record


if __name__ == "__main__":
    main()

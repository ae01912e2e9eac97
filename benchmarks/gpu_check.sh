#!/usr/bin/env bash
# One script for a GPU machine (H200; torch 2.11, Triton 3.6, nvcc 13.0; no internet; repo copied, nothing installed).
# Runs in under 10 minutes (step limits 80 + 170 + 50 + 25 + 25 + 20 + 70 + 20 + 20 + 15 + 30 + 25 + 15 + 15 + 15 s = 9.92 min;
# tests/test_gpu_check.py holds the sum under 600 s), correctness first, then the timings:
#   - versions, the CUDA extension built in place for the GPU's own target (sm_90 on an H200);
#   - every `gpu` test (the CUDA kernels, the Triton kernels compiled at real vocabularies and past 2^31 elements,
#     the Triton parity against the float64 oracle, the stage and the split batch on the device);
#   - the 8192 x 151936 bf16 head-to-head (triton vs cuda vs torch backend vs naive, GB/s vs the bytes model), the
#     passes alone beside the machine's read and copy ceilings (kernel-only, validate on and off, a CUDA graph),
#     compute-sanitizer's memcheck and racecheck on one launch of every kernel, the
#     trainer-vs-sampler divergences (top-k and full form), the fused-linear loss against the GEMM alone, the
#     per-sequence stage eager vs compiled (Inductor kernel count, no recompilation over a hyperparameter
#     schedule), the sampler replay (kept set K = 50 / V, per-token temperature), the optimal token baseline
#     against verl's (where verl is installed), the loss family's options in one compiled stage, the fused stage
#     against the torch stage eager, compiled and graphed, the CPU kernels on the host.
# Logs and JSON go to $OUT (default benchmarks/results/gpu).
#   BUILD_CUDA=0 benchmarks/gpu_check.sh             # skip the extension build
#   STEPS="build_cuda gpu_tests" benchmarks/gpu_check.sh   # only the named steps
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"  # the GPU image has python3 only
PEAK_GBPS="${PEAK_GBPS:-4800}"
declare -A STATUS
step() {  # step NAME TIMEOUT_S CMD...: run with a time limit, log to $OUT/NAME.log, remember the exit code
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  STATUS[$name]="rc=$rc $((SECONDS - t0))s"
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
}

{ nvidia-smi; nvcc --version; $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; } 2>&1 | tee "$OUT/versions.log"

if [ "${BUILD_CUDA:-1}" = "1" ]; then
  # in place (rlkernels/_C*.so beside the sources), for this GPU's target only: the sm_80 + sm_90 + PTX default
  # triples nvcc's time, and the other targets are the compile matrix's (tests/backends/test_cuda_compile.py)
  step build_cuda 80 env RLKERNELS_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
    MAX_JOBS="${MAX_JOBS:-16}" $PY setup.py build_ext --inplace
fi
$PY -c "from rlkernels import backends; print('backends available:', backends.available())" 2>&1 | tee "$OUT/backends.log"
# Liger-Kernel for the fused-linear comparison, from a wheel carried in .whl/ (the machine has no internet; fetch it
# with `pip download --no-deps liger-kernel==0.8.5 -d .whl` and carry ".whl"); without it its provider reports so
ls .whl/liger_kernel-*.whl >/dev/null 2>&1 && $PY -m pip install -q --no-deps --no-index .whl/liger_kernel-*.whl

# every failure, not the first (-x would hide the rest of a first run), each test named as it ends (-v: a step cut
# at its limit still says which failed); the peers' tests fail to collect where their packages are absent (this
# image has none), which is not what this step checks
# a hung test fails alone after 60 s where pytest-timeout is installed (the image has it), not the whole step
TEST_TIMEOUT=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout=60")
step gpu_tests 170 $PY -m pytest tests -m gpu -v -p no:cacheprovider -n 8 --continue-on-collection-errors -rfE \
  --durations=15 --junitxml "$OUT/gpu-tests.xml" $TEST_TIMEOUT

# ---- timings, the most telling first (a run stopped early keeps those)
# head-to-head at the size that matters: 8192 x 151936 bf16 = 2.49 GB of logits
step headline 50 $PY -m benchmarks.run --device cuda --peak-gbps "$PEAK_GBPS" --out "$OUT" --tag h200-8192x151936 \
  --providers "naive,rlkernels[torch],rlkernels[triton],rlkernels[cuda]" --warmup 3 --reps 20 --max-seconds 4 --no-plot \
  --shape ppo:seq_mis:8192:151936:bf16 --shape logprobs:-:8192:151936:bf16

# the passes alone (the launchers, no validation) and the public call with validate on and off, beside the read and
# copy ceilings measured in the same run, and token_logprobs(validate=False) replayed from a CUDA graph (issue 44)
step kernels 25 $PY -m benchmarks.kernels --device cuda --N 8192 --V 151936 --dtype bf16 --rounds 5 \
  --json "$OUT/kernels.json"

# compute-sanitizer on one launch of every kernel (Triton and CUDA) at V = 151,936: memcheck (out-of-bounds and
# misaligned accesses the interpreter's bounds check cannot see compiled), then racecheck (shared-memory hazards);
# the kernels come from the Triton cache the tests filled, so the time is the sanitizer's
step sanitizer 25 bash -c "compute-sanitizer --tool memcheck --error-exitcode 1 $PY -m benchmarks.sanitize \
  --device cuda && compute-sanitizer --tool racecheck --error-exitcode 1 $PY -m benchmarks.sanitize --device cuda --N 4"

# SPEC §9: the sampler's top-k (k = 128) and logits against the plain log-prob pass and the naive composition at
# 8192 x 151936 bf16; the goals: the top-k form <= 1.1x the log-prob pass, the full form <= 2.2x
step divergences 20 $PY -m benchmarks.divergences --device cuda --N 8192 --V 151936 --dtype bf16 --k 128 --reps 5 \
  --no-memory --json "$OUT/divergences.json"

# the fused-linear loss at 8192 x 4096 x 151936 bf16, decoupled PPO with seq-MIS, half the rows in the loss, against
# the GEMM alone (t_GEMM, all N rows): the one-pass form (3 GEMMs of the f N loss rows) reported against
# (1 + 2f) t_GEMM, the two-pass form (4) against (1 + 3f) t_GEMM, both beside naive and the logits path; and the
# one-pass form with a float32 and a TF32 head (head_dtype: the cost of the float32 GEMMs on bf16 operands) and with
# numerics="batch_invariant" (the head GEMMs in fixed 64-row blocks)
step linear 70 $PY -m benchmarks.linear --device cuda --N 8192 --H 4096 --V 151936 --dtype bf16 --fractions 0.5 \
  --case seq_mis --reps 10 \
  --providers "naive,rlkernels[logits],rlkernels[linear],rlkernels[linear-two-pass],rlkernels[linear-sync-free],liger[ppo-logprobs],rlkernels[linear-fp32-head],rlkernels[linear-tf32-head],rlkernels[linear-invariant]" \
  --out "$OUT" --tag h200-linear-8192x4096x151936

# numerics="vllm" and "batch_invariant" (docs/numerics.md): bitwise matches against vLLM's V1 (ATen on the device)
# and V2 kernels (only where $RLKERNELS_CACHE carries its two sampler files, peers/vllm-0.33.0/, fetched on a machine
# with internet by tests/peers/test_vllm_sampler.py: the GPU machine has none), and the modes' cost against "default"
step numerics 20 $PY -m benchmarks.numerics --device cuda --N 1024 --V 151936 --reps 5 --json "$OUT/numerics.json"

# what one call launches (validate=False): ATen ops, host syncs, CUDA kernels per forward + backward (profiler), and
# the decoupled PPO step's time eager (the stage compiled) against its replay from a CUDA graph; the top-k form's
# launches over the plain pass's
step launches 20 $PY -m benchmarks.launches --device cuda --N 8192 --V 151936 --H 4096 --S 128 --k 128 --dtype bf16 \
  --reps 10 --json "$OUT/launches.json"

# the loss alone (metrics="loss_only") of seq-MIS + KL + entropy, and of verl's GSPO with seq-MIS, at 8192 tokens in
# 128 sequences: the torch stage eager and replayed from a CUDA graph against the fused stage's two Triton launches
# (goal <= 0.1 ms); the compiled stage's time is the stage step's (its first call compiles for longer than this
# step's limit)
step stage_fused 15 $PY -m benchmarks.stage --device cuda --tokens 8192 --seqs 128 --reps 30 --fused-only \
  --no-compiled --case seq_mis+kl+entropy --case gspo_seq_mis --json "$OUT/stage-fused.json"

# the one per-sequence stage: ~100 small ops eager (one launch each) vs torch.compile(dynamic=True), and
# what a (one-rank, NCCL) dp_group adds to it: packing, merging, two all_gathers, graph breaks
step stage 30 $PY -m benchmarks.stage --device cuda --tokens 8192 --seqs 128 --reps 50 --split --json "$OUT/stage.json" \
  --case seq_mis+kl+entropy --case geo_rs_token_tis

# sampler replay: the kept set (K = 50, and every id) and a per-token temperature against the full pass
step sampler 25 $PY -m benchmarks.sampler --device cuda --N 1024 --V 151936 --dtype bf16 --K 50 --K 151936 --reps 5 \
  --json "$OUT/sampler.json"

# the optimal token baseline (SPEC §10) at B x T = 1024 x 2048 in groups of 8 and 4096 x 512 in groups of 4:
# rlkernels eager and compiled against verl's per-group loop (its host syncs), or alone where verl is absent
step baseline 15 $PY -m benchmarks.baseline --device cuda --variant otb --reps 5 --json "$OUT/baseline.json"

# the loss family's options (sequence ratio, bias-corrected k3, OPSM, M2PO's sort) in one compiled stage, and the
# 2026 trust regions on the sampler (IPO, VACO's sequence mask, the Kimi-K2.5 term) in another
step stage_family 15 $PY -m benchmarks.stage --device cuda --tokens 8192 --seqs 128 --reps 20 --case family \
  --case rollout_trust_regions \
  --json "$OUT/stage-family.json"


# the CPU kernels on this machine's host CPU (a second CPU and compiler besides the development VM)
step cpu_kernels 15 $PY -m benchmarks.cpu --N 1024 --reps 3 --no-contended --json "$OUT/cpu-kernels.json"

# ---- summary, last
echo
echo "================ SUMMARY ================"
for k in "${!STATUS[@]}"; do printf '%-22s %s\n' "$k" "${STATUS[$k]}"; done
$PY - "$OUT" "$PEAK_GBPS" <<'PYEOF'
import json, os, sys
import xml.etree.ElementTree as ET
out, peak = sys.argv[1], float(sys.argv[2])
# every failed or erroring gpu test by its id (a log's tail can lose them; the JUnit XML keeps each one)
junit = os.path.join(out, "gpu-tests.xml")
if os.path.exists(junit):
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    bad = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    print(f"\ngpu tests: {len(cases) - len(bad)} of {len(cases)} passed or skipped")
    for c in bad:
        what = c.find("failure") if c.find("failure") is not None else c.find("error")
        print(f"  FAILED {c.get('classname')}::{c.get('name')}: {(what.get('message') or '').splitlines()[0][:150] if what.get('message') else ''}")
else:
    print("\ngpu tests: no JUnit XML (the step did not run or was cut before pytest wrote it)")
for tag in ("h200-8192x151936",):
    path = os.path.join(out, tag + ".json")
    if not os.path.exists(path):
        print(f"{tag}: no JSON"); continue
    data = json.load(open(path))
    print(f"\n{tag}{' (partial: stopped by the time limit)' if data.get('partial') else ''}; bytes model: fwd 1 read, fwd+bwd 2 reads + 1 write of N*V; % of {peak:.0f} GB/s")
    print(f"{'op':9} {'N':>6} {'V':>7} {'mode':6} {'provider':18} {'median ms':>10} {'GB/s':>8} {'%peak':>6} {'peak MiB':>9}")
    for r in data["results"]:
        if r.get("status") == "ok":
            print(f"{r['op']:9} {r['N']:>6} {r['V']:>7} {r['mode']:6} {r['provider']:18} {r['time_ms']['median']:>10.3f} "
                  f"{r['gbps']:>8.0f} {r.get('pct_peak', 0):>6.1f} {r['peak_mem_bytes'] / 2**20:>9.0f}")
        else:
            print(f"{r['op']:9} {r['N']:>6} {r['V']:>7} {r['mode']:6} {r['provider']:18} {r['status']}: {r.get('reason', '')[:70]}")
    bad = [c for c in data.get("checks", []) if not c["ok"]]
    print(f"agreement vs rlkernels[torch]: {len(data.get('checks', [])) - len(bad)}/{len(data.get('checks', []))} ok")
    for c in bad:
        print(f"  MISMATCH {c['provider']} {c['op']} N={c['N']} V={c['V']} {c['mode']} {c['field']} rel {c['rel_err']:.2e}")
PYEOF

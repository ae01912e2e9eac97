// Forward vocabulary pass (SPEC §2): row_max, log_norm, logprob and, on request, entropy and sum p^2.
#include "common.cuh"

namespace rlkernels {
namespace {

// One row per warp (V <= kWarpRowMaxV: 8 rows per block) or per block, rows on grid x.
// Reads each valid row once in 16-byte vectors (N*V*sizeof(T) bytes), writes up to 5 floats per row.
// The main loop is software-pipelined: each thread issues its next batch of kUnroll vectors before it
// reduces the current one, and the first batch goes out before the row's label is known (the label's
// load would otherwise stall every block before it streams).
// Hazards: -inf is the max identity and never meets -inf in a subtraction; row offsets are int64
// (N*V > 2^31); a row whose label is outside [0, V) gets zeros and no more of it is read than that
// first batch (inside the row: pid_n < N), except a kForeignTarget row (tensor parallelism), which
// gets its statistics and a log-prob of 0.
template <typename T, int THREADS_PER_ROW, bool HAS_ENTROPY, bool HAS_SUM_SQ>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocksPerSm) token_stats_fwd_kernel(
    // data ptrs
    const T* __restrict__ logits_ptr,       // (N, V) with stride_logits_n
    const int64_t* __restrict__ labels_ptr,  // (N,)
    float* __restrict__ row_max_ptr,         // (N,) max_v z_v, unscaled
    float* __restrict__ log_norm_ptr,        // (N,) log sum_v exp((z_v - row_max) / T)
    float* __restrict__ logprobs_ptr,        // (N,)
    float* __restrict__ entropy_ptr,         // (N,) when HAS_ENTROPY
    float* __restrict__ sum_pi_squared_ptr,  // (N,) when HAS_SUM_SQ
    // shapes
    int64_t N, int64_t V,
    // strides
    int64_t stride_logits_n,
    // scalars
    float scale2_all, float inv_temperature_all,  // log2(e) / T, 1 / T
    const float* __restrict__ inv_t_rows) {        // (N,) 1 / T_row for a per-token temperature, or null
  constexpr int kRowsPerBlock = kBlockThreads / THREADS_PER_ROW;
  constexpr int kVec = Elem<T>::kVec;
  using State = SoftmaxState<HAS_ENTROPY, HAS_SUM_SQ>;

  const int64_t pid_n = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / THREADS_PER_ROW;
  const int lane = threadIdx.x % THREADS_PER_ROW;
  if (pid_n >= N) return;  // a whole warp (warp rows) or never (block rows: grid = N)
  const float inv_temperature = inv_t_rows != nullptr ? inv_t_rows[pid_n] : inv_temperature_all;
  const float scale2 = inv_t_rows != nullptr ? inv_temperature * kLog2e : scale2_all;

  const T* row = logits_ptr + pid_n * stride_logits_n;
  const RowSplit split = split_row<T>(row, row, V);
  const uint4* body = reinterpret_cast<const uint4*>(row + split.head);
  // with both entropy sums the state leaves room for two batches of 2 vectors at kMinBlocksPerSm (sm_100 spilled)
  constexpr int kUnrollRow = HAS_ENTROPY && HAS_SUM_SQ ? 2 : kUnroll;
  constexpr int64_t kBatch = static_cast<int64_t>(kUnrollRow) * THREADS_PER_ROW;  // vectors of a row per batch
  int64_t i = lane;
  bool full = i + (kUnrollRow - 1) * THREADS_PER_ROW < split.nvec;  // a whole batch of this thread's vectors
  uint4 raw[kUnrollRow];
  if (full) {
#pragma unroll
    for (int u = 0; u < kUnrollRow; ++u) raw[u] = __ldg(body + i + u * THREADS_PER_ROW);
  }

  const int64_t y = labels_ptr[pid_n];
  const bool has_target = y >= 0 && y < V;
  if (!has_target && y != kForeignTarget) {  // uniform over the row's threads: the exit skips no barrier
    if (lane == 0) {
      row_max_ptr[pid_n] = 0.f;
      log_norm_ptr[pid_n] = 0.f;
      logprobs_ptr[pid_n] = 0.f;
      if (HAS_ENTROPY) entropy_ptr[pid_n] = 0.f;
      if (HAS_SUM_SQ) sum_pi_squared_ptr[pid_n] = 0.f;
    }
    return;
  }
  // the target logit, loaded before the loop so that its latency hides behind it
  const float z_y = (lane == 0 && has_target) ? Elem<T>::to_float(row[y]) : 0.f;

  State s = State::identity();
  for (int64_t j = lane; j < split.head; j += THREADS_PER_ROW) {
    const float z[1] = {Elem<T>::to_float(row[j])};
    s.add(z, scale2);
  }

  while (full) {
    // the next batch goes out before this one is reduced: two batches in flight per thread
    const bool next_full = i + kBatch + (kUnrollRow - 1) * THREADS_PER_ROW < split.nvec;
    uint4 next[kUnrollRow];
    if (next_full) {
#pragma unroll
      for (int u = 0; u < kUnrollRow; ++u) next[u] = __ldg(body + i + kBatch + u * THREADS_PER_ROW);
    }
    float z[kUnrollRow * kVec];
#pragma unroll
    for (int u = 0; u < kUnrollRow; ++u) {
      float zu[kVec];
      Elem<T>::unpack(raw[u], zu);
#pragma unroll
      for (int j = 0; j < kVec; ++j) z[u * kVec + j] = zu[j];
    }
    s.add(z, scale2);
#pragma unroll
    for (int u = 0; u < kUnrollRow; ++u) raw[u] = next[u];
    i += kBatch;
    full = next_full;
  }
  for (; i < split.nvec; i += THREADS_PER_ROW) {
    float z[kVec];
    Elem<T>::unpack(__ldg(body + i), z);
    s.add(z, scale2);
  }

  for (int64_t j = split.head + split.nvec * kVec + lane; j < V; j += THREADS_PER_ROW) {
    const float z[1] = {Elem<T>::to_float(row[j])};
    s.add(z, scale2);
  }

  if (THREADS_PER_ROW == kWarpSize) {
    s = warp_reduce(s, scale2);
  } else {
    s = block_reduce(s, scale2);
  }
  if (lane != 0) return;

  float row_max, log_norm, logprob, entropy = 0.f, sum_sq = 0.f;
  if (s.s1 == 0.f) {
    // every logit is -inf: no distribution. row_max = 0 (as for skipped rows), log_norm = -inf
    // (the backward then takes p = 0), logprob = -inf, and no mass for H or sum p^2. A NaN
    // logit makes s1 NaN and takes the NaN-propagating branch below instead.
    row_max = 0.f;
    log_norm = -INFINITY;
    logprob = has_target ? -INFINITY : 0.f;
  } else {
    // s1 >= 1 (the max contributes 2^0) and s1 - 1 is exact: log1p keeps log_norm accurate to
    // fp32's resolution of s1 when p_max -> 1, where the fast lg2.approx would add ~1e-7 absolute
    row_max = s.m;
    log_norm = log1pf(s.s1 - 1.f);
    // z_y - m is exact near the max; a foreign target's log-prob is the owner shard's to give
    logprob = has_target ? fmaf(z_y - s.m, inv_temperature, -log_norm) : 0.f;
    if (HAS_ENTROPY) entropy = fmaf(-kLn2, s.sx / s.s1, log_norm);
    if (HAS_SUM_SQ) sum_sq = s.s2 / (s.s1 * s.s1);
  }
  row_max_ptr[pid_n] = row_max;
  log_norm_ptr[pid_n] = log_norm;
  logprobs_ptr[pid_n] = logprob;
  if (HAS_ENTROPY) entropy_ptr[pid_n] = entropy;
  if (HAS_SUM_SQ) sum_pi_squared_ptr[pid_n] = sum_sq;
}

// The launch arguments, as the kernel takes them (dtype-erased pointers).
struct FwdArgs {
  const void* logits;
  const int64_t* labels;
  float *row_max, *log_norm, *logprobs, *entropy, *sum_pi_squared;
  int64_t N, V, stride_logits_n;
  float scale2, inv_temperature;
  const float* inv_t_rows;
};

template <typename T, int THREADS_PER_ROW, bool HAS_ENTROPY, bool HAS_SUM_SQ>
void launch(const FwdArgs& a, cudaStream_t stream) {
  token_stats_fwd_kernel<T, THREADS_PER_ROW, HAS_ENTROPY, HAS_SUM_SQ>
      <<<row_grid(a.N, kBlockThreads / THREADS_PER_ROW), kBlockThreads, 0, stream>>>(
          static_cast<const T*>(a.logits), a.labels, a.row_max, a.log_norm, a.logprobs, a.entropy,
          a.sum_pi_squared, a.N, a.V, a.stride_logits_n, a.scale2, a.inv_temperature, a.inv_t_rows);
}

template <typename T, int THREADS_PER_ROW>
void launch_outputs(const FwdArgs& a, cudaStream_t stream) {
  if (a.entropy != nullptr && a.sum_pi_squared != nullptr) {
    launch<T, THREADS_PER_ROW, true, true>(a, stream);
  } else if (a.entropy != nullptr) {
    launch<T, THREADS_PER_ROW, true, false>(a, stream);
  } else if (a.sum_pi_squared != nullptr) {
    launch<T, THREADS_PER_ROW, false, true>(a, stream);
  } else {
    launch<T, THREADS_PER_ROW, false, false>(a, stream);
  }
}

template <typename T>
void launch_rows(const FwdArgs& a, cudaStream_t stream) {
  if (a.V <= kWarpRowMaxV) {
    launch_outputs<T, kWarpSize>(a, stream);
  } else {
    launch_outputs<T, kBlockThreads>(a, stream);
  }
}

}  // namespace

const char* token_stats_fwd_launch(const void* logits, const int64_t* labels, float* row_max, float* log_norm,
                                   float* logprobs, float* entropy, float* sum_pi_squared, int64_t N, int64_t V,
                                   int64_t stride_logits_n, double temperature, const float* inv_t_rows,
                                   LogitsDtype dtype, void* stream) {
  if (N == 0) return nullptr;
  const FwdArgs a{logits, labels, row_max, log_norm, logprobs, entropy, sum_pi_squared, N, V, stride_logits_n,
                  static_cast<float>(1.4426950408889634 / temperature),  // each rounded once, from double
                  static_cast<float>(1.0 / temperature), inv_t_rows};
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  dispatch_logits_dtype(dtype, [&](auto zero) { launch_rows<decltype(zero)>(a, s); });
  return launch_status();
}

}  // namespace rlkernels

// Backward vocabulary pass (SPEC §2): dlogits = (c*(onehot - p) + e*(-p*(log p + H))) / T.
#include "common.cuh"

namespace rlkernels {
namespace {

// Per-row constants of g_v = p_v * (k0 + k1 * log2 p_v) (v != y), all in fp32, 1/T folded in.
struct GradCoefs {
  float row_max;   // log2 p = (z - row_max) * scale2 - log_norm2
  float log_norm2; // log_norm * log2(e); +inf for a row with no mass, so that p = 0 everywhere
  float k0;        // -(c + e*H) / T
  float k1;        // -e * ln2 / T
  float c_over_t;  // c / T
  float eh_over_t; // -e * H / T
};

template <bool HAS_ENTROPY>
__device__ __forceinline__ float grad_of(float z, float scale2, const GradCoefs& k) {
  const float lp2 = fmaf(z - k.row_max, scale2, -k.log_norm2);  // log2 p; z - row_max is exact near the max
  const float p = exp2f(lp2);
  if (!HAS_ENTROPY) return p * k.k0;
  // p = 0 (a -inf logit) contributes 0: lp2 = -inf would turn k1 * lp2 into inf or NaN
  return p > 0.f ? p * fmaf(k.k1, lp2, k.k0) : 0.f;
}

// The target column: c*(1 - p_y) with 1 - p_y = -expm1(log p_y), formed in fp32 (never 1 - p_y
// rounded to bf16, which cancels as p_y -> 1), plus the entropy term; rounded once by the caller.
template <bool HAS_ENTROPY>
__device__ __forceinline__ float grad_of_target(float z, float scale2, const GradCoefs& k) {
  const float lp2 = fmaf(z - k.row_max, scale2, -k.log_norm2);
  float g = k.c_over_t * -expm1f(lp2 * kLn2);
  if (HAS_ENTROPY) {
    const float p = exp2f(lp2);
    if (p > 0.f) g = fmaf(p, fmaf(k.k1, lp2, k.eh_over_t), g);
  }
  return g;
}

// Writes zeros over [0, V) of a row, vectorised; nothing is read.
template <typename T, int THREADS_PER_ROW>
__device__ __forceinline__ void zero_row(T* row, int64_t V, int lane) {
  constexpr int kVec = Elem<T>::kVec;
  const RowSplit split = split_row<T>(row, row, V);
  const T zero = Elem<T>::from_float(0.f);
  for (int64_t j = lane; j < split.head; j += THREADS_PER_ROW) row[j] = zero;
  uint4* body = reinterpret_cast<uint4*>(row + split.head);
  for (int64_t i = lane; i < split.nvec; i += THREADS_PER_ROW) body[i] = make_uint4(0u, 0u, 0u, 0u);
  for (int64_t j = split.head + split.nvec * kVec + lane; j < V; j += THREADS_PER_ROW) row[j] = zero;
}

// One row per warp (V <= kWarpRowMaxV: 8 rows per block) or per block, rows on grid x.
// Reads each active row once and writes every row once, in 16-byte vectors (2*N*V*sizeof(T) bytes).
// Rows with an invalid label or c = e = 0 are written with zeros; of them only the first batch of the
// pipelined main loop is read, issued before the label and coefficients arrive (inside the row). Each
// thread issues its next batch before it forms and stores the current one. Each element is read and
// written by the same thread (a prefetched vector is one the thread has not written yet), so dlogits
// may alias logits (in place).
template <typename T, int THREADS_PER_ROW, bool HAS_ENTROPY>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocksPerSm) token_grad_bwd_kernel(
    // data ptrs (logits and dlogits may alias: no __restrict__, no read-only cache loads)
    const T* logits_ptr,                          // (N, V) with stride_logits_n
    const int64_t* __restrict__ labels_ptr,       // (N,)
    const float* __restrict__ row_max_ptr,        // (N,) max_v z_v, unscaled
    const float* __restrict__ log_norm_ptr,       // (N,) log sum_v exp((z_v - row_max) / T)
    const float* __restrict__ entropy_ptr,        // (N,) when HAS_ENTROPY
    const float* __restrict__ coef_logprob_ptr,   // (N,) c = dLoss/dlogprob
    const float* __restrict__ coef_entropy_ptr,   // (N,) e = dLoss/dentropy, when HAS_ENTROPY
    T* dlogits_ptr,                               // (N, V) with stride_dlogits_n
    // shapes
    int64_t N, int64_t V,
    // strides
    int64_t stride_logits_n, int64_t stride_dlogits_n,
    // scalars
    float scale2_all, float inv_temperature_all,  // log2(e) / T, 1 / T
    const float* __restrict__ inv_t_rows) {        // (N,) 1 / T_row for a per-token temperature, or null
  constexpr int kRowsPerBlock = kBlockThreads / THREADS_PER_ROW;
  constexpr int kVec = Elem<T>::kVec;

  const int64_t pid_n = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / THREADS_PER_ROW;
  const int lane = threadIdx.x % THREADS_PER_ROW;
  if (pid_n >= N) return;
  const float inv_temperature = inv_t_rows != nullptr ? inv_t_rows[pid_n] : inv_temperature_all;
  const float scale2 = inv_t_rows != nullptr ? inv_temperature * kLog2e : scale2_all;

  T* out = dlogits_ptr + pid_n * stride_dlogits_n;
  const T* row = logits_ptr + pid_n * stride_logits_n;
  const RowSplit split = split_row<T>(row, out, V);
  const uint4* body_in = reinterpret_cast<const uint4*>(row + split.head);
  uint4* body_out = reinterpret_cast<uint4*>(out + split.head);
  // the entropy term's registers leave room for two batches of 2 vectors at kMinBlocksPerSm, not of 4 (spills)
  constexpr int kUnrollRow = HAS_ENTROPY ? 2 : kUnroll;
  constexpr int64_t kBatch = static_cast<int64_t>(kUnrollRow) * THREADS_PER_ROW;  // vectors of a row per batch
  int64_t i = lane;
  bool full = i + (kUnrollRow - 1) * THREADS_PER_ROW < split.nvec;
  uint4 raw[kUnrollRow];
  if (full) {
#pragma unroll
    for (int u = 0; u < kUnrollRow; ++u) raw[u] = body_in[i + u * THREADS_PER_ROW];
  }

  const int64_t y = labels_ptr[pid_n];
  const float c = coef_logprob_ptr[pid_n];
  const float e = HAS_ENTROPY ? coef_entropy_ptr[pid_n] : 0.f;
  // a foreign target (kForeignTarget) is a live row whose target column is elsewhere: y never matches
  // a column below, in the head loop or the unsigned vector compare
  if (((y < 0 || y >= V) && y != kForeignTarget) || (c == 0.f && e == 0.f)) {
    zero_row<T, THREADS_PER_ROW>(out, V, lane);
    return;
  }

  GradCoefs k;
  k.row_max = row_max_ptr[pid_n];
  const float log_norm = log_norm_ptr[pid_n];
  k.log_norm2 = log_norm == -INFINITY ? INFINITY : log_norm * kLog2e;  // no mass (all -inf logits): p = 0
  const float H = HAS_ENTROPY ? entropy_ptr[pid_n] : 0.f;
  k.k0 = -fmaf(e, H, c) * inv_temperature;
  k.k1 = -e * kLn2 * inv_temperature;
  k.c_over_t = c * inv_temperature;
  k.eh_over_t = -e * H * inv_temperature;

  for (int64_t j = lane; j < split.head; j += THREADS_PER_ROW) {
    const float z = Elem<T>::to_float(row[j]);
    out[j] = Elem<T>::from_float(j == y ? grad_of_target<HAS_ENTROPY>(z, scale2, k) : grad_of<HAS_ENTROPY>(z, scale2, k));
  }

  // the target's position relative to the body; one unsigned compare per vector finds it
  const int64_t y_body = y - split.head;
  while (full) {
    const bool next_full = i + kBatch + (kUnrollRow - 1) * THREADS_PER_ROW < split.nvec;
    uint4 next[kUnrollRow];
    if (next_full) {
#pragma unroll
      for (int u = 0; u < kUnrollRow; ++u) next[u] = body_in[i + kBatch + u * THREADS_PER_ROW];
    }
#pragma unroll
    for (int u = 0; u < kUnrollRow; ++u) {
      const int64_t v = i + u * THREADS_PER_ROW;
      float z[kVec], g[kVec];
      Elem<T>::unpack(raw[u], z);
#pragma unroll
      for (int j = 0; j < kVec; ++j) g[j] = grad_of<HAS_ENTROPY>(z[j], scale2, k);
      if (static_cast<uint64_t>(y_body - v * kVec) < static_cast<uint64_t>(kVec)) {
#pragma unroll
        for (int j = 0; j < kVec; ++j)  // static indices keep z and g in registers
          if (v * kVec + j == y_body) g[j] = grad_of_target<HAS_ENTROPY>(z[j], scale2, k);
      }
      body_out[v] = Elem<T>::pack(g);
    }
#pragma unroll
    for (int u = 0; u < kUnrollRow; ++u) raw[u] = next[u];
    i += kBatch;
    full = next_full;
  }
  for (; i < split.nvec; i += THREADS_PER_ROW) {
    float z[kVec], g[kVec];
    Elem<T>::unpack(body_in[i], z);
#pragma unroll
    for (int j = 0; j < kVec; ++j) g[j] = grad_of<HAS_ENTROPY>(z[j], scale2, k);
    if (static_cast<uint64_t>(y_body - i * kVec) < static_cast<uint64_t>(kVec)) {
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        if (i * kVec + j == y_body) g[j] = grad_of_target<HAS_ENTROPY>(z[j], scale2, k);
    }
    body_out[i] = Elem<T>::pack(g);
  }

  for (int64_t j = split.head + split.nvec * kVec + lane; j < V; j += THREADS_PER_ROW) {
    const float z = Elem<T>::to_float(row[j]);
    out[j] = Elem<T>::from_float(j == y ? grad_of_target<HAS_ENTROPY>(z, scale2, k) : grad_of<HAS_ENTROPY>(z, scale2, k));
  }
}

// The launch arguments, as the kernel takes them (dtype-erased pointers).
struct BwdArgs {
  const void* logits;
  const int64_t* labels;
  const float *row_max, *log_norm, *entropy, *coef_logprob, *coef_entropy;
  void* dlogits;
  int64_t N, V, stride_logits_n, stride_dlogits_n;
  float scale2, inv_temperature;
  const float* inv_t_rows;
};

template <typename T, int THREADS_PER_ROW, bool HAS_ENTROPY>
void launch(const BwdArgs& a, cudaStream_t stream) {
  token_grad_bwd_kernel<T, THREADS_PER_ROW, HAS_ENTROPY>
      <<<row_grid(a.N, kBlockThreads / THREADS_PER_ROW), kBlockThreads, 0, stream>>>(
          static_cast<const T*>(a.logits), a.labels, a.row_max, a.log_norm, a.entropy, a.coef_logprob,
          a.coef_entropy, static_cast<T*>(a.dlogits), a.N, a.V, a.stride_logits_n, a.stride_dlogits_n, a.scale2,
          a.inv_temperature, a.inv_t_rows);
}

template <typename T>
void launch_rows(const BwdArgs& a, cudaStream_t stream) {
  const bool has_entropy = a.coef_entropy != nullptr;
  if (a.V <= kWarpRowMaxV) {
    has_entropy ? launch<T, kWarpSize, true>(a, stream) : launch<T, kWarpSize, false>(a, stream);
  } else {
    has_entropy ? launch<T, kBlockThreads, true>(a, stream) : launch<T, kBlockThreads, false>(a, stream);
  }
}

}  // namespace

const char* token_grad_bwd_launch(const void* logits, const int64_t* labels, const float* row_max,
                                  const float* log_norm, const float* entropy, const float* coef_logprob,
                                  const float* coef_entropy, void* dlogits, int64_t N, int64_t V,
                                  int64_t stride_logits_n, int64_t stride_dlogits_n, double temperature,
                                  const float* inv_t_rows, LogitsDtype dtype, void* stream) {
  if (N == 0) return nullptr;
  const BwdArgs a{logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, dlogits, N, V,
                  stride_logits_n, stride_dlogits_n,
                  static_cast<float>(1.4426950408889634 / temperature),  // each rounded once, from double
                  static_cast<float>(1.0 / temperature), inv_t_rows};
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  dispatch_logits_dtype(dtype, [&](auto zero) { launch_rows<decltype(zero)>(a, s); });
  return launch_status();
}

}  // namespace rlkernels

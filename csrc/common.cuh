// Shared by the two vocabulary passes (SPEC §2).
//
// The first part is plain C++ (no CUDA types): the launcher entry points that bindings.cpp calls,
// so that bindings.cpp needs no CUDA header and each .cu needs no torch header (measured: a file
// including <torch/extension.h> takes about a minute to compile). The second part, compiled only
// by nvcc, holds the device helpers: 16-byte vector loads/stores, the online-softmax row state and
// its warp/block reductions.
#pragma once

#include <cstdint>

namespace rlkernels {

// A row's label when its target lies in another vocabulary shard (tensor parallelism; see
// rlkernels/backends/base.py FOREIGN_TARGET): every statistic but the log-prob (0), and the gradient
// without the + c column. Any other label outside [0, V) skips the row.
constexpr int64_t kForeignTarget = -2;

enum class LogitsDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Each launcher returns nullptr on success, else the CUDA error string of the launch.
// `stream` is a cudaStream_t. Shapes: logits [N, V] with unit stride along V; labels, row_max, log_norm, entropy,
// coefficients [N] contiguous; statistics are float32.
// inv_t_rows: null (one temperature, `temperature`), or [N] float32 1 / T per row (a per-token temperature).
// Forward outputs (see rlkernels/backends/base.py, RowStats): row_max = max_v z_v (unscaled),
// log_norm = log sum_v exp((z_v - row_max) / T), logprobs = (z_y - row_max) / T - log_norm.
const char* token_stats_fwd_launch(
    const void* logits, const int64_t* labels, float* row_max, float* log_norm, float* logprobs, float* entropy,
    float* sum_pi_squared, int64_t N, int64_t V, int64_t stride_logits_n, double temperature,
    const float* inv_t_rows, LogitsDtype dtype, void* stream);

// dlogits may alias logits (in place): then stride_dlogits_n == stride_logits_n.
// entropy and coef_entropy are both null or both set.
const char* token_grad_bwd_launch(
    const void* logits, const int64_t* labels, const float* row_max, const float* log_norm, const float* entropy,
    const float* coef_logprob, const float* coef_entropy, void* dlogits, int64_t N, int64_t V,
    int64_t stride_logits_n, int64_t stride_dlogits_n, double temperature, const float* inv_t_rows,
    LogitsDtype dtype, void* stream);

}  // namespace rlkernels

#if defined(__CUDACC__)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>

namespace rlkernels {

constexpr int kBlockThreads = 256;  // both kernels; a row gets one warp or the whole block
constexpr int kWarpSize = 32;
constexpr int kUnroll = 4;  // 16-byte vectors per thread per main-loop batch; two batches are in flight
// Resident blocks per SM the launch bounds ask for: 3 x 256 threads = 24 warps with at most 85 registers each,
// each thread keeping its next batch (64 bytes) in flight while it reduces the current one: 96 KiB of loads in
// flight per SM. 4 blocks (a 64-register budget) spilled the two batches, and 48 warps without the prefetch would
// hold 96 KiB only in bursts.
constexpr int kMinBlocksPerSm = 3;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Rows of at most this many elements get one warp (8 rows per block); longer rows get a block.
constexpr int64_t kWarpRowMaxV = 1024;

// ---- element conversion: explicit intrinsics and bit operations only (torch builds with
// __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__: no implicit half <-> float).
// A 16-byte vector is a uint4 of 4 fp32 or 8 fp16/bf16 elements.

template <typename T> struct Elem;

template <> struct Elem<float> {
  static constexpr int kVec = 4;
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
  static __device__ __forceinline__ void unpack(uint4 v, float (&out)[kVec]) {
    out[0] = __uint_as_float(v.x); out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z); out[3] = __uint_as_float(v.w);
  }
  static __device__ __forceinline__ uint4 pack(const float (&in)[kVec]) {
    return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]), __float_as_uint(in[3]));
  }
};

// fp16 and bf16 differ only in how one 32-bit word of two elements converts; Packed16 turns that
// into the 16-byte (8-element) vector conversions both use.
template <typename Word> struct Packed16 {
  static constexpr int kVec = 8;
  static __device__ __forceinline__ void unpack(uint4 v, float (&out)[kVec]) {
    Word::unpack_word(v.x, out[0], out[1]); Word::unpack_word(v.y, out[2], out[3]);
    Word::unpack_word(v.z, out[4], out[5]); Word::unpack_word(v.w, out[6], out[7]);
  }
  static __device__ __forceinline__ uint4 pack(const float (&in)[kVec]) {
    return make_uint4(Word::pack_word(in[0], in[1]), Word::pack_word(in[2], in[3]), Word::pack_word(in[4], in[5]),
                      Word::pack_word(in[6], in[7]));
  }
};

struct HalfWord {
  static __device__ __forceinline__ void unpack_word(uint32_t w, float& lo, float& hi) {
    lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  static __device__ __forceinline__ uint32_t pack_word(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);  // one cvt.rn.f16x2.f32
    return *reinterpret_cast<const uint32_t*>(&h);
  }
};

struct BFloat16Word {
  static __device__ __forceinline__ void unpack_word(uint32_t w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);  // bf16 is the top half of an fp32: the conversion is exact
    hi = __uint_as_float(w & 0xffff0000u);
  }
  static __device__ __forceinline__ uint32_t pack_word(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // one cvt.rn.bf16x2.f32
    return *reinterpret_cast<const uint32_t*>(&h);
  }
};

template <> struct Elem<__half> : Packed16<HalfWord> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <> struct Elem<__nv_bfloat16> : Packed16<BFloat16Word> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// ---- row layout: [0, head) scalar, [head, head + nvec*VEC) 16-byte vectors, the rest scalar.
// The head peels the elements before the first 16-byte boundary, so every row is vectorised
// whatever its stride or V; a row whose input and output boundaries differ (only possible in the
// backward with a strided, not in-place output) is all scalar.
struct RowSplit {
  int64_t head;
  int64_t nvec;
};

// Calls f(T{}) with T the element type of `dtype`: one switch for every launcher.
template <typename F> inline void dispatch_logits_dtype(LogitsDtype dtype, F&& f) {
  switch (dtype) {
    case LogitsDtype::kFloat32: f(float{}); break;
    case LogitsDtype::kFloat16: f(__half{}); break;
    case LogitsDtype::kBFloat16: f(__nv_bfloat16{}); break;
  }
}

template <typename T>
__device__ __forceinline__ int64_t misalignment(const void* p) {
  return static_cast<int64_t>((reinterpret_cast<uintptr_t>(p) & 15) / sizeof(T));
}

template <typename T>
__device__ __forceinline__ RowSplit split_row(const void* row_in, const void* row_out, int64_t V) {
  constexpr int kVec = Elem<T>::kVec;
  const int64_t mis = misalignment<T>(row_in);
  if (mis != misalignment<T>(row_out)) return {0, 0};
  const int64_t head = mis == 0 ? 0 : (kVec - mis < V ? kVec - mis : V);
  return {head, (V - head) / kVec};
}

__device__ __forceinline__ float max_identity_free(float m) {
  // -inf is the max identity; while a row has no finite entry its shift is 0 so that
  // exp2(z - shift) = exp2(-inf) = 0 and no (-inf) - (-inf) = NaN is formed.
  return m == -INFINITY ? 0.f : m;
}

// ---- online softmax state of a row slice. The max is kept in raw logit units, and every term is
// formed as (z - m) * scale2 with scale2 = log2(e) / T: z - m is exact for the entries that matter
// (Sterbenz), so a large common offset (logits ~1e4) costs no precision, and base 2 maps exp onto
// one ex2 instruction.
//   m  = max z (or -inf)
//   s1 = sum 2^t,  t = (z - m) * scale2     (log_norm = ln s1)
//   sx = sum 2^t * t                        (entropy: H = ln s1 - ln2 * sx / s1)
//   s2 = sum 2^(2t)                         (sum p^2 = s2 / s1^2)
template <bool HAS_ENTROPY, bool HAS_SUM_SQ>
struct SoftmaxState {
  float m, s1, sx, s2;  // no member initialisers: the type is used for a __shared__ array

  static __device__ __forceinline__ SoftmaxState identity() { return {-INFINITY, 0.f, 0.f, 0.f}; }

  // Move the reference from m to m_new >= m.
  __device__ __forceinline__ void rescale(float m_new, float scale2) {
    // m = -inf: d = -inf, clamped so that d * s1 (s1 = 0) is 0, not NaN; alpha = 0.
    const float d = fmaxf((m - max_identity_free(m_new)) * scale2, -FLT_MAX);
    const float alpha = exp2f(d);
    if (HAS_ENTROPY) sx = alpha * fmaf(d, s1, sx);
    if (HAS_SUM_SQ) s2 *= alpha * alpha;
    s1 *= alpha;
    m = m_new;
  }

  // Add K logits (converted to fp32): one max update and one rescale per call.
  template <int K>
  __device__ __forceinline__ void add(const float (&z)[K], float scale2) {
    float zmax = z[0];
#pragma unroll
    for (int j = 1; j < K; ++j) zmax = fmaxf(zmax, z[j]);
    rescale(fmaxf(m, zmax), scale2);
    const float shift = max_identity_free(m);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const float t = (z[j] - shift) * scale2;  // -inf for a -inf logit
      const float e = exp2f(t);                 // 0 there
      s1 += e;
      // p log p -> 0 as p -> 0: e * t is 0 * -inf = NaN for a -inf logit, so t is clamped first
      if (HAS_ENTROPY) sx = fmaf(e, fmaxf(t, -FLT_MAX), sx);
      if (HAS_SUM_SQ) s2 = fmaf(e, e, s2);
    }
  }

  __device__ __forceinline__ void merge(const SoftmaxState& o, float scale2) {
    const float m_new = fmaxf(m, o.m);
    SoftmaxState other = o;
    rescale(m_new, scale2);
    other.rescale(m_new, scale2);
    s1 += other.s1;
    if (HAS_ENTROPY) sx += other.sx;
    if (HAS_SUM_SQ) s2 += other.s2;
  }

  __device__ __forceinline__ SoftmaxState shfl_xor(int lane_mask) const {
    SoftmaxState o = identity();
    o.m = __shfl_xor_sync(0xffffffffu, m, lane_mask);
    o.s1 = __shfl_xor_sync(0xffffffffu, s1, lane_mask);
    if (HAS_ENTROPY) o.sx = __shfl_xor_sync(0xffffffffu, sx, lane_mask);
    if (HAS_SUM_SQ) o.s2 = __shfl_xor_sync(0xffffffffu, s2, lane_mask);
    return o;
  }
};

// Butterfly over the 32 lanes of a warp: every lane ends with the warp's state.
template <typename State>
__device__ __forceinline__ State warp_reduce(State s, float scale2) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) s.merge(s.shfl_xor(mask), scale2);
  return s;
}

// Reduce over the whole block (all threads must call it); the result is valid in warp 0.
template <typename State>
__device__ __forceinline__ State block_reduce(State s, float scale2) {
  constexpr int kWarps = kBlockThreads / kWarpSize;
  __shared__ State partial[kWarps];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  s = warp_reduce(s, scale2);
  if (lane == 0) partial[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < kWarps ? partial[lane] : State::identity();
    s = warp_reduce(s, scale2);
  }
  return s;
}

// ---- host side of the launchers

// Rows go on grid x (2^31 - 1 blocks), never y/z (65,535: Liger #1294).
inline dim3 row_grid(int64_t N, int rows_per_block) {
  return dim3(static_cast<unsigned>((N + rows_per_block - 1) / rows_per_block));
}

inline const char* launch_status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace rlkernels

#endif  // __CUDACC__

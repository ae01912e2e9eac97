// The two vocabulary passes (SPEC §2) on the CPU, and the full-form divergences between two distributions
// (SPEC §9.2): one parallel loop over rows per pass. At the end, the fused per-sequence stage (its own section).
//
// Why not ATen ops: the chunked torch backend runs several ATen ops per ~1 Mi-element chunk, each its
// own parallel region; on a machine shared with another multi-threaded process every region waits at
// its barrier for a descheduled thread. Here each pass is one at::parallel_for over rows (one
// contiguous block of rows per thread, one barrier), and each row is streamed from memory once into
// the cache and then read from there.
//
// Per row (z: the row's logits as float32, T: the temperature, m = max z):
//   forward   s1 = sum exp((z - m) / T), sx = sum exp(.) (z - m) / T, s2 = sum exp(.)^2
//             row_max = m, log_norm = log s1, logprob = (z_y - m) / T - log_norm,
//             entropy = log_norm - sx / s1, sum p^2 = s2 / s1^2
//   backward  log p = (z - m) / T - log_norm, p = exp(log p)
//             g = -(p (c + e H) + e p log p) / T  (+ c / T at the target column, in float32)
// The exponential is a branch-free Cody-Waite reduction with a degree-7 polynomial (relative error
// below 2^-23 on the reduced range), written so that the compiler vectorises the row loops, whose
// reductions keep explicit lane arrays (built with -fopenmp for at::parallel_for's threads). Rows follow the backends' contract
// (rlkernels/backends/base.py): a label outside [0, V) skips the row (never read, zeros out), except
// kForeignTarget (-2), a row whose target is in another vocabulary shard; a row without a finite logit
// has row_max 0, log_norm -inf, logprob -inf (0 for a foreign target), entropy and sum p^2 0; the
// backward replays p from (row_max, log_norm) and writes zeros without reading a row whose
// coefficients are both 0. Row offsets are 64-bit.
//
// The divergences (full_divergences_fwd / _bwd, the two Triton kernels of
// rlkernels/kernels/triton/divergences.py, with per-row temperatures as well): per row, pi = softmax(z / T) and
// mu = softmax(r / T_r) of the logits z and a reference r (each with its own row stride),
//   forward   [N, 9] float32: KL(mu||pi), KL(pi||mu), chi2(pi||mu), TV, sum pi sign(pi - mu), and the
//             (row max, log-normaliser) of z and of r; zeros for inactive rows (never read) and rows without
//             a distribution
//   backward  dz = (a (pi - mu) + b pi (log pi - log mu - KL(pi||mu)) + 2 c (pi^2 / mu - pi (chi2 + 1))
//                   + d pi (s - sum pi s) / 2) / T, s = sign(pi - mu), each term only where its coefficient
//             is nonzero; rows whose four coefficients are 0 are written with zeros, never read.
// The forward streams each row pair from memory once and sweeps the cached copy once more (see the section's
// comment below: two exponentials and one division per entry); the backward reads both rows once and writes
// dz once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// The row loops vectorise only if the exponential is inlined into them; GCC's heuristics decline
// in the large parallel lambdas, so it is forced.
#define RLK_ALWAYS_INLINE inline __attribute__((always_inline))

constexpr int64_t kForeignTarget = -2;
constexpr float kInf = std::numeric_limits<float>::infinity();

// exp(r), with n returned, for xc = n ln2 + r, |r| <= ln2 / 2 (|xc log2 e| < 2^22): the reduction and the degree-7
// polynomial both exponentials below share. n is rounded to nearest by the 1.5 * 2^23 trick: plain adds,
// which vectorise.
RLK_ALWAYS_INLINE float exp_reduced(float xc, float& n) {
  n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = std::fma(n, -0.693145751953125f, std::fma(n, -1.428606765330187e-06f, xc));
  float p = 1.98412698e-4f;  // 1/7!
  p = std::fma(p, r, 1.38888889e-3f);
  p = std::fma(p, r, 8.33333333e-3f);
  p = std::fma(p, r, 4.16666667e-2f);
  p = std::fma(p, r, 1.66666667e-1f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  return std::fma(p, r, 1.0f);
}

// exp(x) for x <= 0 (and NaN, which it returns): 2^n * exp(r).
RLK_ALWAYS_INLINE float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.0f);  // NaN stays NaN (std::max returns its first argument)
  float n;
  const float p = exp_reduced(xc, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float y = p * scale;
  return x < -87.0f ? 0.0f : y;  // exp(-87) ~ 1.6e-38: below it, 0 (the smallest normal is 1.2e-38)
}

// A log-probability where its exponential is 0 (below -87, exp_nonpositive returns 0) is raised to
// -200: p log p and p (c + e log p) are then 0 at p = 0 (never 0 * -inf) without a branch, which would
// stop the loop from vectorising; finite products stay far from overflow. NaN passes through.
RLK_ALWAYS_INLINE float where_p_is_zero_finite(float x) {
  return std::max(x, -200.0f);
}

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

// The row as float32: the input itself for float32, else converted into `buffer` (one pass).
template <typename T>
inline const float* row_as_float(const T* row, int64_t V, std::vector<float>& buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t j = 0; j < V; ++j) buffer[j] = to_float(row[j]);
    return buffer.data();
  }
}

// Reductions keep kLanes independent partial results (one vector register's worth), combined at
// the end: the compiler vectorises the lane loop, and each partial sum sees V / kLanes terms.
constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 1024;

RLK_ALWAYS_INLINE float row_max_of(const float* z, int64_t V) {
  float lanes[kLanes];
  for (int k = 0; k < kLanes; ++k) lanes[k] = -kInf;
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes)
    for (int k = 0; k < kLanes; ++k) lanes[k] = std::max(lanes[k], z[j + k]);
  float m = -kInf;
  for (int k = 0; k < kLanes; ++k) m = std::max(m, lanes[k]);
  for (; j < V; ++j) m = std::max(m, z[j]);
  return m;  // a NaN never wins a max: the sums below propagate it
}

// One row's statistics: (row max, log-normaliser, log-prob of the label y, entropy, sum p^2), zeros where the row
// takes no part. Not inlined: the pass (stats_rows) and the gradient formed in the forward (forward_gradient_rows)
// run this one compiled copy, so their statistics are the same bits (-ffp-contract=fast could contract two inlined
// copies differently).
struct RowStatistics {
  float max = 0.f, ln = 0.f, lp = 0.f, h = 0.f, s2 = 0.f;
};

__attribute__((noinline)) RowStatistics row_statistics(const float* z, int64_t V, int64_t y, float inv_t, bool more) {
  const bool has_target = y >= 0 && y < V;
  float out_max = 0.f, out_ln = 0.f, out_lp = 0.f, out_h = 0.f, out_s2 = 0.f;
  const float m = row_max_of(z, V);
  if (m == -kInf && std::none_of(z, z + V, [](float x) { return std::isnan(x); })) {
    // no finite logit: no distribution (the scan for a NaN, which never wins the max, runs on such rows
    // only: a NaN row must come out NaN, as in the other backends, for validate=True to refuse it)
    out_ln = -kInf;
    out_lp = has_target ? -kInf : 0.f;
  } else if (m == -kInf) {
    out_ln = out_lp = out_h = out_s2 = std::numeric_limits<float>::quiet_NaN();
  } else {
    // kLanes partial sums over blocks of kBlock elements, each block's total added in
    // float64: the float32 error grows with kBlock / kLanes terms, not V / kLanes
    double s1 = 0.0, sx = 0.0, s2 = 0.0;
    for (int64_t start = 0; start < V; start += kBlock) {
      const int64_t stop = std::min(start + kBlock, V);
      float l1[kLanes] = {}, lx[kLanes] = {}, l2[kLanes] = {};
      int64_t j = start;
      if (more) {
        for (; j + kLanes <= stop; j += kLanes) {
          for (int k = 0; k < kLanes; ++k) {
            const float d = (z[j + k] - m) * inv_t;
            const float e = exp_nonpositive(d);
            l1[k] += e;
            lx[k] += e * where_p_is_zero_finite(d);  // p log p -> 0 at p = 0 (d = -inf)
            l2[k] += e * e;
          }
        }
      } else {
        for (; j + kLanes <= stop; j += kLanes)
          for (int k = 0; k < kLanes; ++k) l1[k] += exp_nonpositive((z[j + k] - m) * inv_t);
      }
      for (; j < stop; ++j) {
        const float d = (z[j] - m) * inv_t;
        const float e = exp_nonpositive(d);
        l1[0] += e;
        lx[0] += e * where_p_is_zero_finite(d);
        l2[0] += e * e;
      }
      float b1 = 0.f, bx = 0.f, b2 = 0.f;
      for (int k = 0; k < kLanes; ++k) b1 += l1[k], bx += lx[k], b2 += l2[k];
      s1 += b1, sx += bx, s2 += b2;
    }
    out_max = m;
    out_ln = static_cast<float>(std::log(s1));
    out_lp = has_target ? (z[y] - m) * inv_t - out_ln : 0.f;
    out_h = static_cast<float>(std::log(s1) - sx / s1);
    out_s2 = static_cast<float>(s2 / (s1 * s1));
  }
  return RowStatistics{out_max, out_ln, out_lp, out_h, out_s2};
}

template <typename T>
void stats_rows(const T* logits, int64_t stride, const int64_t* labels, int64_t N, int64_t V, float temperature,
                const float* inv_t_rows, float* row_max, float* log_norm, float* logprobs, float* entropy,
                float* sum_sq) {
  const float inv_t_all = 1.0f / temperature;
  const bool more = entropy != nullptr || sum_sq != nullptr;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(std::is_same_v<T, float> ? 0 : V);
    for (int64_t r = begin; r < end; ++r) {
      const float inv_t = inv_t_rows != nullptr ? inv_t_rows[r] : inv_t_all;  // a per-token temperature
      const int64_t y = labels[r];
      RowStatistics st;
      if ((y >= 0 && y < V) || y == kForeignTarget) st = row_statistics(row_as_float(logits + r * stride, V, buffer),
                                                                         V, y, inv_t, more);
      row_max[r] = st.max;
      log_norm[r] = st.ln;
      logprobs[r] = st.lp;
      if (entropy != nullptr) entropy[r] = st.h;
      if (sum_sq != nullptr) sum_sq[r] = st.s2;
    }
  });
}

// g = -p (c + e H + e log p) over one row; the scalars arrive by value, so that no store to g can
// alias them (captured by reference they would be reloaded at every element). In place (g == z)
// each element is read before it is written.
RLK_ALWAYS_INLINE void grad_row(const float* z, float* g, int64_t V, float m, float inv_t, float ln, float ceh,
                                float e) {
  for (int64_t j = 0; j < V; ++j) {
    const float lp = (z[j] - m) * inv_t - ln;
    const float p = exp_nonpositive(std::min(lp, 0.f));
    g[j] = -p * (ceh + e * where_p_is_zero_finite(lp));  // p log p -> 0 at p = 0
  }
}

// One row's dlogits in float32 (the target column's + c included; a head's columns are the caller's): c and e are
// the row's coefficients over T, c_head the head's share of its p term. Not inlined, as row_statistics: the backward
// (grad_rows) and the gradient formed in the forward run this one compiled copy.
__attribute__((noinline)) void row_gradient(const float* z, float* g, int64_t V, int64_t y, float m, float ln,
                                            float inv_t, float c, float c_head, float e, float h) {
  if (ln == -kInf) {  // no distribution: p = 0 everywhere
    std::fill(g, g + V, 0.f);
  } else {
    grad_row(z, g, V, m, inv_t, ln, c + c_head + e * h, e);
  }
  if (y >= 0 && y < V) g[y] += c;  // the target column in float32, rounded once by the caller
}

// A second set of columns per row with their own coefficients (SPEC §9.1, the sampler's top-k): dLoss/dlog p at
// k ids (-1 pads), [N, k] each. The row's p term carries c + sum_j C_j; each id's column gets + C_j in float32 before
// the one rounding, as the target gets + c (an id equal to the target gets both).
struct HeadColumns {
  const int64_t* ids = nullptr;  // [N, k] int64, -1 pads
  const float* coef = nullptr;   // [N, k] float32, 0 at pads
  int64_t k = 0;
};

template <typename T>
void grad_rows(const T* logits, int64_t stride, T* out, int64_t out_stride, const int64_t* labels,
               const float* row_max, const float* log_norm, const float* entropy, const float* coef_logprob,
               const float* coef_entropy, int64_t N, int64_t V, float temperature, const float* inv_t_rows,
               HeadColumns head = {}) {
  const float inv_t_all = 1.0f / temperature;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(std::is_same_v<T, float> ? 0 : V);
    std::vector<float> grad(std::is_same_v<T, float> ? 0 : V);
    for (int64_t r = begin; r < end; ++r) {
      const float inv_t = inv_t_rows != nullptr ? inv_t_rows[r] : inv_t_all;  // a per-token temperature
      const int64_t y = labels[r];
      const bool has_target = y >= 0 && y < V;
      const float c = coef_logprob[r] * inv_t;
      const float e = coef_entropy != nullptr ? coef_entropy[r] * inv_t : 0.f;
      const int64_t* ids = head.ids + r * head.k;
      const float* coef = head.coef + r * head.k;
      float c_head = 0.f;  // sum_j C_j / T: the head's share of the p term
      bool any_head = false;  // a coefficient on an id (their sum may be 0 while the columns' values are not)
      for (int64_t j = 0; j < head.k; ++j) {
        c_head += coef[j];
        any_head = any_head || coef[j] != 0.f;
      }
      c_head *= inv_t;
      T* o = out + r * out_stride;
      if ((!has_target && y != kForeignTarget) || (c == 0.f && e == 0.f && !any_head)) {
        std::fill(o, o + V, T(0));  // skipped or zero coefficients: written, never read
        continue;
      }
      const float* z = row_as_float(logits + r * stride, V, buffer);
      float* g = std::is_same_v<T, float> ? reinterpret_cast<float*>(o) : grad.data();
      row_gradient(z, g, V, y, row_max[r], log_norm[r], inv_t, c, c_head, e, entropy != nullptr ? entropy[r] : 0.f);
      for (int64_t j = 0; j < head.k; ++j) {  // the head's columns likewise (ids are distinct within a row)
        if (ids[j] >= 0 && ids[j] < V) g[ids[j]] += coef[j] * inv_t;
      }
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t j = 0; j < V; ++j) o[j] = static_cast<T>(g[j]);
      }
    }
  });
}

// numbers reach a check's message as strings, never streamed (the reason: csrc/bindings.cpp, text())
void check_rows(const char* op, const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.device().is_cpu(), op, ": logits must be on the CPU");
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be [N, V], got ", std::to_string(logits.dim()), " dims");
  // a stride means nothing along a dimension of size <= 1 (or in an empty tensor)
  TORCH_CHECK(logits.stride(1) == 1 || logits.size(1) <= 1 || logits.numel() == 0, op,
              ": logits need unit stride along V");
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.is_contiguous() && labels.numel() == logits.size(0),
              op, ": labels must be contiguous int64 [N]");
}

// fn(T{}) for the logits' dtype: float32, bfloat16, float16 (float64 takes the torch backend)
template <typename Fn>
void dispatch(const char* op, const at::Tensor& logits, Fn&& fn) {
  switch (logits.scalar_type()) {
    case at::kFloat: return fn(float{});
    case at::kBFloat16: return fn(c10::BFloat16{});
    case at::kHalf: return fn(c10::Half{});
    default: TORCH_CHECK(false, op, ": logits must be float32, bfloat16 or float16, got ", logits.scalar_type());
  }
}

const float* f32(const at::Tensor& t, const char* op, const char* name, int64_t N) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == N, op, ": ", name,
              " must be contiguous float32 [N]");
  return t.data_ptr<float>();
}

// 1/T per row ([N] float32), or nullptr when one temperature serves every row
const float* inverse_temperatures(const std::optional<at::Tensor>& inv_t, const char* op, int64_t N) {
  return inv_t.has_value() ? f32(*inv_t, op, "inv_temperature", N) : nullptr;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_stats_fwd(
    const at::Tensor& logits, const at::Tensor& labels, double temperature, bool compute_entropy,
    bool compute_sum_pi_squared, const std::optional<at::Tensor>& inv_temperature) {
  check_rows("token_stats_fwd", logits, labels);
  const int64_t N = logits.size(0), V = logits.size(1);
  const float* inv_t_rows = inverse_temperatures(inv_temperature, "token_stats_fwd", N);
  auto opts = logits.options().dtype(at::kFloat);
  at::Tensor row_max = at::empty({N}, opts), log_norm = at::empty({N}, opts), logprobs = at::empty({N}, opts);
  at::Tensor entropy = at::empty({compute_entropy ? N : 0}, opts);
  at::Tensor sum_sq = at::empty({compute_sum_pi_squared ? N : 0}, opts);
  dispatch("token_stats_fwd", logits, [&](auto tag) {
    using T = decltype(tag);
    stats_rows<T>(logits.data_ptr<T>(), logits.stride(0), labels.data_ptr<int64_t>(), N, V,
                  static_cast<float>(temperature), inv_t_rows, row_max.data_ptr<float>(), log_norm.data_ptr<float>(),
                  logprobs.data_ptr<float>(), compute_entropy ? entropy.data_ptr<float>() : nullptr,
                  compute_sum_pi_squared ? sum_sq.data_ptr<float>() : nullptr);
  });
  return {row_max, log_norm, logprobs, entropy, sum_sq};
}

void launch_grad(const char* op, const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_max,
                 const at::Tensor& log_norm, const std::optional<at::Tensor>& entropy, const at::Tensor& coef_logprob,
                 const std::optional<at::Tensor>& coef_entropy, double temperature, at::Tensor& dlogits,
                 const std::optional<at::Tensor>& inv_temperature, HeadColumns head = {}) {
  check_rows(op, logits, labels);
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(entropy.has_value() == coef_entropy.has_value(), op, ": entropy and coef_entropy go together");
  TORCH_CHECK(dlogits.scalar_type() == logits.scalar_type() && dlogits.sizes() == logits.sizes() &&
                  (dlogits.stride(1) == 1 || V <= 1 || dlogits.numel() == 0),
              op, ": dlogits must be like logits with unit stride along V");
  const float* ent = entropy.has_value() ? f32(*entropy, op, "entropy", N) : nullptr;
  const float* ce = coef_entropy.has_value() ? f32(*coef_entropy, op, "coef_entropy", N) : nullptr;
  dispatch(op, logits, [&](auto tag) {
    using T = decltype(tag);
    grad_rows<T>(logits.data_ptr<T>(), logits.stride(0), dlogits.data_ptr<T>(), dlogits.stride(0),
                 labels.data_ptr<int64_t>(), f32(row_max, op, "row_max", N), f32(log_norm, op, "log_norm", N), ent,
                 f32(coef_logprob, op, "coef_logprob", N), ce, N, V, static_cast<float>(temperature),
                 inverse_temperatures(inv_temperature, op, N), head);
  });
}

at::Tensor token_grad_bwd(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_max,
                          const at::Tensor& log_norm, const std::optional<at::Tensor>& entropy,
                          const at::Tensor& coef_logprob, const std::optional<at::Tensor>& coef_entropy,
                          double temperature, const std::optional<at::Tensor>& inv_temperature) {
  at::Tensor dlogits = at::empty(logits.sizes(), logits.options());
  launch_grad("token_grad_bwd", logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature,
              dlogits, inv_temperature);
  return dlogits;
}

void token_grad_bwd_inplace(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_max,
                            const at::Tensor& log_norm, const std::optional<at::Tensor>& entropy,
                            const at::Tensor& coef_logprob, const std::optional<at::Tensor>& coef_entropy,
                            double temperature, const std::optional<at::Tensor>& inv_temperature) {
  at::Tensor out = logits;  // each row is read before it is written, by the same thread
  launch_grad("token_grad_bwd_inplace", logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy,
              temperature, out, inv_temperature);
}

void token_grad_bwd_out(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_max,
                        const at::Tensor& log_norm, const std::optional<at::Tensor>& entropy,
                        const at::Tensor& coef_logprob, const std::optional<at::Tensor>& coef_entropy,
                        double temperature, const at::Tensor& dlogits,
                        const std::optional<at::Tensor>& inv_temperature) {
  at::Tensor out = dlogits;
  launch_grad("token_grad_bwd_out", logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy,
              temperature, out, inv_temperature);
}

// [N, k] log p at a second set of ids per row (SPEC §9.1, the sampler's top-k) from the pass's normaliser, the
// torch backend's backends.base.head_logprobs: (z_j - row_max) / T - log_norm; -inf at pads, at ids whose logit is
// -inf (or NaN) and on rows without a distribution (a NaN normaliser stays NaN); 0 on rows outside the pass. k reads
// per row, no V-wide work.
template <typename T>
void head_rows(const T* logits, int64_t stride, const int64_t* labels, const int64_t* ids, int64_t k,
               const float* row_max, const float* log_norm, int64_t N, int64_t V, float temperature,
               const float* inv_t_rows, float* out) {
  const float inv_t_all = 1.0f / temperature;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t y = labels[r];
      float* o = out + r * k;
      if (!((y >= 0 && y < V) || y == kForeignTarget)) {
        std::fill(o, o + k, 0.f);
        continue;
      }
      const float inv_t = inv_t_rows != nullptr ? inv_t_rows[r] : inv_t_all;
      const float m = row_max[r], ln = log_norm[r];
      const T* row = logits + r * stride;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t h = ids[r * k + j];
        const float z = (h >= 0 && h < V && ln != -kInf) ? to_float(row[h]) : -kInf;
        o[j] = z > -kInf ? (z - m) * inv_t - ln : -kInf;
      }
    }
  });
}

at::Tensor head_logprobs_fwd(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& head_ids,
                             const at::Tensor& row_max, const at::Tensor& log_norm, double temperature,
                             const std::optional<at::Tensor>& inv_temperature) {
  const char* op = "head_logprobs_fwd";
  check_rows(op, logits, labels);
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(head_ids.scalar_type() == at::kLong && head_ids.is_contiguous() && head_ids.dim() == 2 &&
                  head_ids.size(0) == N,
              op, ": head_ids must be contiguous int64 [N, k]");
  at::Tensor out = at::empty({N, head_ids.size(1)}, logits.options().dtype(at::kFloat));
  dispatch(op, logits, [&](auto tag) {
    using T = decltype(tag);
    head_rows<T>(logits.data_ptr<T>(), logits.stride(0), labels.data_ptr<int64_t>(), head_ids.data_ptr<int64_t>(),
                 head_ids.size(1), f32(row_max, op, "row_max", N), f32(log_norm, op, "log_norm", N), N, V,
                 static_cast<float>(temperature), inverse_temperatures(inv_temperature, op, N),
                 out.data_ptr<float>());
  });
  return out;
}

// token_grad_bwd_out with the head's columns (ops/head.py): head_ids [N, k] int64 (-1 pads), head_coef [N, k] float32
// dLoss/dlog p at them (0 at pads and at ids without mass), contiguous.
void head_grad_bwd_out(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_max,
                       const at::Tensor& log_norm, const std::optional<at::Tensor>& entropy,
                       const at::Tensor& coef_logprob, const std::optional<at::Tensor>& coef_entropy,
                       const at::Tensor& head_ids, const at::Tensor& head_coef, double temperature,
                       const at::Tensor& dlogits, const std::optional<at::Tensor>& inv_temperature) {
  const char* op = "head_grad_bwd_out";
  const int64_t N = logits.size(0);
  TORCH_CHECK(head_ids.scalar_type() == at::kLong && head_ids.is_contiguous() && head_ids.dim() == 2 &&
                  head_ids.size(0) == N,
              op, ": head_ids must be contiguous int64 [N, k]");
  TORCH_CHECK(head_coef.scalar_type() == at::kFloat && head_coef.is_contiguous() &&
                  head_coef.sizes() == head_ids.sizes(),
              op, ": head_coef must be contiguous float32 like head_ids");
  HeadColumns head{head_ids.data_ptr<int64_t>(), head_coef.data_ptr<float>(), head_ids.size(1)};
  at::Tensor out = dlogits;
  launch_grad(op, logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, out,
              inv_temperature, head);
}


// ---- The full-form divergences (SPEC §9.2): rlkernels/kernels/triton/divergences.py on the CPU ----------------
//
// Per row, z the logits and q the reference (each as float32), s = 1/T and t = 1/T_r, M = max z, K = max q:
//   dz = (z - M) s, dq = (q - K) t,  ep = exp(dz), eq = exp(dq),  P = sum ep, Q = sum eq,
//   pi = ep / P, mu = eq / Q, log pi = dz - log P, log mu = dq - log Q (affine in the logits: no log per entry).
// Each divergence is a sum of unnormalised terms, normalised once per row (float64):
//   KL(pi||mu) = A / P + log Q - log P,   A = sum_{ep > 0} ep (dz - dq)
//   KL(mu||pi) = B / Q + log P - log Q,   B = sum_{eq > 0} eq (dq - dz)
//   chi2 + 1   = sum pi^2 / mu = U Q / P^2,  U = sum_{ep > 0} ep (ep / eq)
// so the two exponentials of an entry serve every sum but TV, which needs P and Q before its first term.
//
// The forward: one sweep streams both rows into the cache for their max (and min), a second forms the two
// exponentials of every entry from there and sums P, Q, A, B, U (kLanes float32 partial sums per block of
// kBlock entries, block totals in float64), keeping ep and eq in two per-thread row buffers, and a third, over
// those buffers, sums |pi - mu| and pi sign(pi - mu) with one multiplication each. Two exponentials and one
// division per entry in all, where the Triton kernel's two reads form five exponentials. (An online variant,
// one read of the rows with the sums rescaled as the block maxima rise, measured slower on a 2-core AVX2
// machine: its per-block max passes wait on memory, and its arithmetic is no smaller.)
//
// ep / eq is a division where the Triton kernel takes exp(2 log pi - log mu): the same value (eq is at least
// exp(-87) ~ 1.6e-38, a normal number, so ep / eq <= 6e37 stays finite), except where eq underflowed to 0 on a
// finite q (dq < -87) under an entry with mass, whose term is finite where the division gives +inf; a block
// whose float32 U is not finite is summed again in float64 with exp(2 dz - dq) there (block_u_exact).
//
// A row without a -inf on either side (the common case: the min says) needs no select but U's; otherwise
// selects keep 0 * inf out of the sums and the entries with mass against none are counted apart.
//
// Conventions, as in the Triton kernel: a term is formed only where its left-hand mass is positive (0 log 0 = 0;
// "positive" is exp_nonpositive's: exp(x) for x >= -87, else 0, the float32 normal range, as the GPU's flushing
// exponential), mass against none (q = -inf under pi > 0, or z = -inf under mu > 0) gives +inf; a row whose z
// or q has no finite entry has no distribution and gets zeros, and an inactive row is never read and gets zeros.
//
// The backward reads both rows once and writes dz once, from the forward's (M, log P, K, log Q, KL(pi||mu),
// chi2, sum pi s). Each term is selected only where its coefficient is nonzero (an infinite divergence with a
// zero coefficient must not become 0 * inf = NaN), and a row needs mu (two exponentials per entry) only for
// the a, c, d terms and exp(2 log pi - log mu) (a third) only for c: the row picks one of three loops.

constexpr int64_t kStats = 9;  // kl, reverse_kl, chi2, tv, sum pi s, (row max, log-normaliser) of z, of q

// exp(x) over the whole float range (x <= 88.7 finite, above +inf, -inf -> 0, NaN -> NaN, below -87 0 as in
// exp_nonpositive): chi2's terms exp(2 log pi - log mu) have a positive argument wherever pi^2 > mu. The same
// reduction and polynomial as exp_nonpositive, with 2^n applied in two halves so that n up to 128 (overflow to
// +inf) needs no special case.
RLK_ALWAYS_INLINE float exp_any(float x) {
  const float xc = std::min(std::max(x, -87.0f), 89.0f);  // NaN stays NaN; above 88.72 p 2^n overflows to +inf
  float n;
  const float p = exp_reduced(xc, n);
  const int32_t ni = static_cast<int32_t>(n), n1 = ni >> 1, n2 = ni - n1;  // each in [-63, 64]
  const int32_t bits1 = (n1 + 127) << 23, bits2 = (n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &bits1, sizeof(s1));
  std::memcpy(&s2, &bits2, sizeof(s2));
  const float y = (p * s1) * s2;
  return x < -87.0f ? 0.0f : y;
}

// Loads and stores of one entry as float32. The c10 conversions call the scalar F16C intrinsics (Half) or
// branch on NaN (BFloat16), which keeps the fused loops below from vectorising (GCC 12 vectorises neither);
// these are the same conversions (exact widening; round to nearest even, overflow to inf, a NaN stays a NaN;
// checked bit for bit against F16C over every half and every float32) as integer operations and selects.
RLK_ALWAYS_INLINE float load_float(float v) {
  return v;
}
RLK_ALWAYS_INLINE float load_float(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
RLK_ALWAYS_INLINE float load_float(c10::Half v) {
  // half's exponent and mantissa moved into float position and rebiased; infinities and NaN take the
  // larger bias, zeros and subnormals are renormalised by one float subtraction (exact)
  const uint32_t em = static_cast<uint32_t>(v.x & 0x7fffu) << 13;
  const uint32_t exponent = em & (0x7c00u << 13);
  const uint32_t normal = em + ((127u - 15u) << 23);
  const uint32_t inf_nan = normal + ((128u - 16u) << 23);
  const uint32_t shifted = normal + (1u << 23);
  float sub;
  std::memcpy(&sub, &shifted, sizeof(sub));
  sub -= 6.103515625e-05f;  // 2^-14
  uint32_t sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof(sub_bits));
  uint32_t bits = exponent == (0x7c00u << 13) ? inf_nan : (exponent == 0 ? sub_bits : normal);
  bits |= static_cast<uint32_t>(v.x & 0x8000u) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float32 -> half bits, round to nearest even: overflow to inf, NaN to a quiet NaN, the half-subnormal range
// rounded by the FPU (adding 0.5 puts the half's last place at float's), the normal range by integer rounding
RLK_ALWAYS_INLINE uint16_t half_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  const uint32_t big = u > (255u << 23) ? 0x7e00u : 0x7c00u;
  float a;
  std::memcpy(&a, &u, sizeof(a));
  const float shifted = a + 0.5f;
  uint32_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  const uint32_t small = shifted_bits - 0x3f000000u;
  const uint32_t normal = (u + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  const uint32_t bits = u >= (143u << 23) ? big : (u < (113u << 23) ? small : normal);
  return static_cast<uint16_t>(bits | (sign >> 16));
}

template <typename T>
RLK_ALWAYS_INLINE T store_float(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
    return T(static_cast<uint16_t>(f != f ? 0x7FC0u : rounded), T::from_bits());
  } else {
    return T(half_bits(f), T::from_bits());
  }
}

// max and min over a row (or a block of one) of T as float32 (row_max_of for any input dtype), read where it
// lies. The min (free beside the load from memory) says whether it holds a -inf.
template <typename T>
RLK_ALWAYS_INLINE void row_range(const T* x, int64_t V, float& max_out, float& min_out) {
  float hi[kLanes], lo[kLanes];
  for (int k = 0; k < kLanes; ++k) hi[k] = -kInf, lo[k] = kInf;
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes)
    // kept a loop for the vectoriser: unrolled first, the lanes become kLanes scalar min / max reductions,
    // which GCC 12 does not vectorise (a < b ? b : a is no MAX_EXPR without -ffinite-math-only)
#pragma GCC unroll 1
    for (int k = 0; k < kLanes; ++k) {
      const float v = load_float(x[j + k]);
      hi[k] = std::max(hi[k], v), lo[k] = std::min(lo[k], v);
    }
  float m = -kInf, n = kInf;
  for (int k = 0; k < kLanes; ++k) m = std::max(m, hi[k]), n = std::min(n, lo[k]);
  for (; j < V; ++j) m = std::max(m, load_float(x[j])), n = std::min(n, load_float(x[j]));
  max_out = m, min_out = n;  // a NaN never wins a max or a min: the sums propagate it
}

// The sums of one row, in float64 (each block's float32 lane totals added in)
struct RowSums {
  double P = 0, Q = 0, A = 0, B = 0, U = 0;
  float none_z = -kInf, none_q = -kInf;  // max z over entries with q = -inf, max q over entries with z = -inf
};

// One entry into lane k, against the row maxima M, K. kFinite: the row holds no -inf on either side, so dz and
// dq are finite and only U needs a select (an entry whose ep underflowed would give 0 / 0 where eq did too).
// Otherwise the selects keep 0 * inf out of every sum, and the entries with mass against none (q = -inf, or
// z = -inf) go to none_z / none_q instead, which decide once per row whether a divergence is +inf.
template <bool kFinite>
RLK_ALWAYS_INLINE void block_entry(float zv, float qv, float M, float K, float s, float t, float& ep_out,
                                   float& eq_out, float& lp, float& lq, float& la, float& lb, float& lu, float& nz,
                                   float& nq) {
  const float dz = (zv - M) * s, dq = (qv - K) * t;
  const float ep = exp_nonpositive(dz), eq = exp_nonpositive(dq);
  ep_out = ep, eq_out = eq;
  lp += ep, lq += eq;
  const float diff = dz - dq;
  // eq = 0 under mass on a finite q (an underflow) gives +inf here: the block's U is then summed again
  const float u = (ep / eq) * ep;
  if constexpr (kFinite) {
    la += ep * diff;
    lb -= eq * diff;
    lu += ep > 0.f ? u : 0.f;
  } else {
    // selects on values, not on (ep > 0 && ...): GCC 12 does not vectorise a select on two conditions one of
    // which it folds into exp_nonpositive's own select
    const bool both = zv > -kInf && qv > -kInf;  // else diff is infinite (or NaN) and the entry is set apart
    const float w = both ? diff : 0.f, u_both = both ? u : 0.f;
    la += ep * w;
    lb -= eq * w;
    lu += ep > 0.f ? u_both : 0.f;
    nz = std::max(nz, qv > -kInf ? -kInf : zv);
    nq = std::max(nq, zv > -kInf ? -kInf : qv);
  }
}

// U of one block summed again in float64 where its float32 sum is not finite: an eq that underflowed under an
// ep > 0 on a finite q (its term is exp(2 dz - dq), finite or not, as the Triton kernel's exp(2 log pi - log mu)),
// or float32 partial sums that overflowed. Rare (a reference spread over more than 87 T_r, or masked with a
// large finite negative), and the block is still in the L1 cache.
template <typename T>
double block_u_exact(const T* z, const T* q, const float* ep, const float* eq, int64_t n, float M, float K,
                     float s, float t) {
  double u = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float qv = load_float(q[j]);
    if (!(ep[j] > 0.f) || qv == -kInf) continue;
    const double dz = (load_float(z[j]) - M) * s, dq = (qv - K) * t;
    u += eq[j] > 0.f ? static_cast<double>(ep[j]) * ep[j] / eq[j] : std::exp(2 * dz - dq);
  }
  return u;
}

// One block of kBlock entries (or the row's tail): kLanes partial sums in float32, totals into the row's sums in
// float64 (as stats_rows); ep and eq go to the row buffers for the second sweep.
template <typename T, bool kFinite>
RLK_ALWAYS_INLINE void block_sums(const T* __restrict__ z, const T* __restrict__ q, int64_t n, float M, float K,
                                  float s, float t, float* __restrict__ ep, float* __restrict__ eq, RowSums& acc) {
  float lp[kLanes] = {}, lq[kLanes] = {}, la[kLanes] = {}, lb[kLanes] = {}, lu[kLanes] = {}, nz[kLanes], nq[kLanes];
  for (int k = 0; k < kLanes; ++k) nz[k] = -kInf, nq[k] = -kInf;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int k = 0; k < kLanes; ++k)
      block_entry<kFinite>(load_float(z[j + k]), load_float(q[j + k]), M, K, s, t, ep[j + k], eq[j + k], lp[k],
                           lq[k], la[k], lb[k], lu[k], nz[k], nq[k]);
  for (; j < n; ++j)
    block_entry<kFinite>(load_float(z[j]), load_float(q[j]), M, K, s, t, ep[j], eq[j], lp[0], lq[0], la[0], lb[0],
                         lu[0], nz[0], nq[0]);
  float bp = 0.f, bq = 0.f, ba = 0.f, bb = 0.f, bu = 0.f;
  for (int k = 0; k < kLanes; ++k) {
    bp += lp[k], bq += lq[k], ba += la[k], bb += lb[k], bu += lu[k];
    acc.none_z = std::max(acc.none_z, nz[k]), acc.none_q = std::max(acc.none_q, nq[k]);
  }
  acc.P += bp, acc.Q += bq, acc.A += ba, acc.B += bb;
  acc.U += std::isfinite(bu) ? static_cast<double>(bu) : block_u_exact(z, q, ep, eq, n, M, K, s, t);
}

// x * y rounded to float32 on its own: -ffp-contract=fast would fuse a plain product into the subtraction
// pi - mu (one side exact, the other rounded), which is then not 0 where pi == mu (identical rows: TV 0 and
// sign 0 in the Triton kernel). An fma with a zero addend is the rounded product and contracts with nothing.
RLK_ALWAYS_INLINE float rounded_product(float x, float y) {
  return std::fma(x, y, 0.0f);
}

// The second sweep, over the row buffers: sum |pi - mu| and sum pi sign(pi - mu)
RLK_ALWAYS_INLINE void second_sweep(const float* ep, const float* eq, int64_t V, float inv_P, float inv_Q,
                                    double& tv, double& s_bar) {
  tv = 0, s_bar = 0;
  for (int64_t start = 0; start < V; start += kBlock) {
    const int64_t stop = std::min(start + kBlock, V);
    float lt[kLanes] = {}, ls[kLanes] = {};
    int64_t j = start;
    for (; j + kLanes <= stop; j += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const float pi = rounded_product(ep[j + k], inv_P), diff = pi - rounded_product(eq[j + k], inv_Q);
        lt[k] += std::fabs(diff);
        ls[k] += diff > 0.f ? pi : (diff < 0.f ? -pi : 0.f);
      }
    }
    for (; j < stop; ++j) {
      const float pi = rounded_product(ep[j], inv_P), diff = pi - rounded_product(eq[j], inv_Q);
      lt[0] += std::fabs(diff);
      ls[0] += diff > 0.f ? pi : (diff < 0.f ? -pi : 0.f);
    }
    float bt = 0.f, bs = 0.f;
    for (int k = 0; k < kLanes; ++k) bt += lt[k], bs += ls[k];
    tv += bt, s_bar += bs;
  }
}

template <typename T>
void divergence_rows(const T* logits, int64_t z_stride, const T* reference, int64_t q_stride, const uint8_t* active,
                     int64_t N, int64_t V, float temperature, float reference_temperature, const float* inv_t_rows,
                     const float* inv_r_rows, float* stats) {
  const float inv_t_all = 1.0f / temperature, inv_r_all = 1.0f / reference_temperature;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    // ep and eq of the row being processed (per thread): 2 V floats, which the second sweep reads from the
    // cache (256 KiB at V = 32768, beside the rows' own 256 KiB in float32)
    std::vector<float> ep(V), eq(V);
    for (int64_t r = begin; r < end; ++r) {
      float* out = stats + r * kStats;
      std::fill(out, out + kStats, 0.f);
      if (active[r] == 0) continue;  // never read
      const float s = inv_t_rows != nullptr ? inv_t_rows[r] : inv_t_all;  // per-token temperatures
      const float t = inv_r_rows != nullptr ? inv_r_rows[r] : inv_r_all;
      const T* z = logits + r * z_stride;
      const T* q = reference + r * q_stride;
      // the sweep that streams both rows into the cache: their max, and their min (a -inf picks the variant with
      // selects)
      float M, K, z_min, q_min;
      row_range(z, V, M, z_min);
      row_range(q, V, K, q_min);
      if (M == -kInf || K == -kInf) continue;  // no finite entry on one side: no distribution, zeros
      RowSums acc;
      const bool finite = z_min > -kInf && q_min > -kInf;
      for (int64_t start = 0; start < V; start += kBlock) {
        const int64_t n = std::min(kBlock, V - start);
        if (finite) {
          block_sums<T, true>(z + start, q + start, n, M, K, s, t, ep.data() + start, eq.data() + start, acc);
        } else {
          block_sums<T, false>(z + start, q + start, n, M, K, s, t, ep.data() + start, eq.data() + start, acc);
        }
      }
      double tv, s_bar;
      second_sweep(ep.data(), eq.data(), V, static_cast<float>(1.0 / acc.P), static_cast<float>(1.0 / acc.Q), tv,
                   s_bar);
      // mass against none: pi > 0 where mu = 0 makes KL(pi||mu) and chi2 +inf, mu > 0 where pi = 0 KL(mu||pi)
      const bool pi_against_none = exp_nonpositive((acc.none_z - M) * s) > 0.f;
      const bool mu_against_none = exp_nonpositive((acc.none_q - K) * t) > 0.f;
      const double log_P = std::log(acc.P), log_Q = std::log(acc.Q);
      out[0] = mu_against_none ? kInf : static_cast<float>(acc.B / acc.Q + log_P - log_Q);
      out[1] = pi_against_none ? kInf : static_cast<float>(acc.A / acc.P + log_Q - log_P);
      out[2] = pi_against_none ? kInf : static_cast<float>(acc.U * acc.Q / (acc.P * acc.P) - 1.0);
      out[3] = static_cast<float>(0.5 * tv);
      out[4] = static_cast<float>(s_bar);
      out[5] = M, out[6] = static_cast<float>(log_P);
      out[7] = K, out[8] = static_cast<float>(log_Q);
    }
  });
}

// The row's scalars for the backward, by value (see grad_row): no store to the output row can alias them
struct DivergenceGradRow {
  float M, log_P, s, K, log_Q, t;
  float a, b, c, d;  // the coefficients as given: each term is formed where its own is nonzero
  float reverse_kl, chi2_plus_1, s_bar;
};

// One entry of dz. Each term is selected where its coefficient is nonzero, not multiplied by it (0 * inf).
template <bool kMu, bool kChi2>
RLK_ALWAYS_INLINE float divergence_grad_entry(float zv, float qv, const DivergenceGradRow g) {
  const float lp = (zv - g.M) * g.s - g.log_P;
  const float lq = (qv - g.K) * g.t - g.log_Q;
  const float pi = exp_nonpositive(std::min(lp, 0.f));
  const bool live = pi > 0.f;  // 0 log 0 = 0: no term where pi has no mass
  // two selects, not one on (b != 0 && live): GCC 12 does not vectorise a select on a loop-invariant bool
  // and'ed with a per-entry one
  const float b_term = live ? g.b * (pi * (lp - lq - g.reverse_kl)) : 0.f;
  float v = g.b != 0.f ? b_term : 0.f;
  if constexpr (kMu) {
    const float mu = exp_nonpositive(std::min(lq, 0.f));
    v += g.a != 0.f ? g.a * (pi - mu) : 0.f;
    // exp(2 log pi - log mu), not pi * (pi / mu): mu may have underflowed under a finite term
    if constexpr (kChi2) v += live ? 2.f * g.c * (exp_any(2.f * lp - lq) - pi * g.chi2_plus_1) : 0.f;
    const float sign = pi > mu ? 1.f : (pi < mu ? -1.f : 0.f);
    v += g.d != 0.f ? 0.5f * g.d * (pi * (sign - g.s_bar)) : 0.f;
  }
  return v * g.s;
}

// dz over one row (no reduction: a plain loop, which the compiler vectorises). kMu: the row needs mu (a, c or
// d nonzero); kChi2: c is nonzero.
template <typename T, bool kMu, bool kChi2>
RLK_ALWAYS_INLINE void divergence_grad_row(const T* __restrict__ z, const T* __restrict__ q, T* __restrict__ o,
                                           int64_t V, const DivergenceGradRow g) {
  for (int64_t j = 0; j < V; ++j)
    o[j] = store_float<T>(divergence_grad_entry<kMu, kChi2>(load_float(z[j]), load_float(q[j]), g));
}

template <typename T>
void divergence_grad_rows(const T* logits, int64_t z_stride, const T* reference, int64_t q_stride, const float* stats,
                          const float* coef, T* out, int64_t N, int64_t V, float temperature,
                          float reference_temperature, const float* inv_t_rows, const float* inv_r_rows) {
  const float inv_t_all = 1.0f / temperature, inv_r_all = 1.0f / reference_temperature;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = coef + r * 4;
      const float* st = stats + r * kStats;
      T* o = out + r * V;
      const T* z = logits + r * z_stride;
      const T* q = reference + r * q_stride;
      bool zeros = c[0] == 0.f && c[1] == 0.f && c[2] == 0.f && c[3] == 0.f;  // then never read
      if (!zeros && std::all_of(st, st + kStats, [](float x) { return x == 0.f; })) {
        // the forward's zeros: a row without a distribution, or one whose statistics all happen to be 0
        // (one entry with mass at logit 0 on both sides); only a look at the row tells them apart
        float M, K, unused;
        row_range(z, V, M, unused);
        row_range(q, V, K, unused);
        zeros = M == -kInf || K == -kInf;
      }
      if (zeros) {
        std::fill(o, o + V, T(0));
        continue;
      }
      const float s = inv_t_rows != nullptr ? inv_t_rows[r] : inv_t_all;  // per-token temperatures
      const float t = inv_r_rows != nullptr ? inv_r_rows[r] : inv_r_all;
      const DivergenceGradRow g{st[5], st[6], s, st[7], st[8], t, c[0], c[1], c[2], c[3], st[1], st[2] + 1.f, st[4]};
      if (c[2] != 0.f) {
        divergence_grad_row<T, true, true>(z, q, o, V, g);
      } else if (c[0] != 0.f || c[3] != 0.f) {
        divergence_grad_row<T, true, false>(z, q, o, V, g);
      } else {
        divergence_grad_row<T, false, false>(z, q, o, V, g);
      }
    }
  });
}

void check_pair(const char* op, const at::Tensor& logits, const at::Tensor& reference) {
  for (const at::Tensor* x : {&logits, &reference}) {
    TORCH_CHECK(x->device().is_cpu(), op, ": logits and reference must be on the CPU");
    TORCH_CHECK(x->dim() == 2, op, ": logits and reference must be [N, V], got ",
                std::to_string(x->dim()), " dims");
    TORCH_CHECK(x->stride(1) == 1 || x->size(1) <= 1 || x->numel() == 0, op,
                ": logits and reference need unit stride along V");
  }
  TORCH_CHECK(reference.sizes() == logits.sizes(), op, ": reference must be shaped like logits");
  TORCH_CHECK(reference.scalar_type() == logits.scalar_type(), op, ": reference must have the logits' dtype");
}

const float* optional_f32(const std::optional<at::Tensor>& t, const char* op, const char* name, int64_t N) {
  return t.has_value() ? f32(*t, op, name, N) : nullptr;
}

at::Tensor full_divergences_fwd(const at::Tensor& logits, const at::Tensor& reference, const at::Tensor& active,
                                double temperature, double reference_temperature,
                                const std::optional<at::Tensor>& inv_temperature,
                                const std::optional<at::Tensor>& inv_reference_temperature) {
  const char* op = "full_divergences_fwd";
  check_pair(op, logits, reference);
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK((active.scalar_type() == at::kBool || active.scalar_type() == at::kChar ||
               active.scalar_type() == at::kByte) && active.is_contiguous() && active.numel() == N,
              op, ": active must be contiguous bool or int8 [N]");
  const float* inv_t = optional_f32(inv_temperature, op, "inv_temperature", N);
  const float* inv_r = optional_f32(inv_reference_temperature, op, "inv_reference_temperature", N);
  at::Tensor stats = at::empty({N, kStats}, logits.options().dtype(at::kFloat));
  if (V == 0) return stats.zero_();
  const auto* act = static_cast<const uint8_t*>(active.data_ptr());  // bool and int8 are one byte, 0 = inactive
  dispatch(op, logits, [&](auto tag) {
    using T = decltype(tag);
    divergence_rows<T>(logits.data_ptr<T>(), logits.stride(0), reference.data_ptr<T>(), reference.stride(0), act,
                       N, V, static_cast<float>(temperature), static_cast<float>(reference_temperature), inv_t,
                       inv_r, stats.data_ptr<float>());
  });
  return stats;
}

at::Tensor full_divergences_bwd(const at::Tensor& logits, const at::Tensor& reference, const at::Tensor& stats,
                                const at::Tensor& coef, double temperature, double reference_temperature,
                                const std::optional<at::Tensor>& inv_temperature,
                                const std::optional<at::Tensor>& inv_reference_temperature) {
  const char* op = "full_divergences_bwd";
  check_pair(op, logits, reference);
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.is_contiguous() && stats.dim() == 2 &&
                  stats.size(0) == N && stats.size(1) == kStats,
              op, ": stats must be contiguous float32 [N, 9] (full_divergences_fwd's)");
  TORCH_CHECK(coef.scalar_type() == at::kFloat && coef.is_contiguous() && coef.dim() == 2 && coef.size(0) == N &&
                  coef.size(1) == 4,
              op, ": coef must be contiguous float32 [N, 4]");
  const float* inv_t = optional_f32(inv_temperature, op, "inv_temperature", N);
  const float* inv_r = optional_f32(inv_reference_temperature, op, "inv_reference_temperature", N);
  at::Tensor dlogits = at::empty({N, V}, logits.options());  // contiguous, every entry written once
  if (V == 0) return dlogits;
  dispatch(op, logits, [&](auto tag) {
    using T = decltype(tag);
    divergence_grad_rows<T>(logits.data_ptr<T>(), logits.stride(0), reference.data_ptr<T>(), reference.stride(0),
                            stats.data_ptr<float>(), coef.data_ptr<float>(), dlogits.data_ptr<T>(), N, V,
                            static_cast<float>(temperature), static_cast<float>(reference_temperature), inv_t,
                            inv_r);
  });
  return dlogits;
}

// ---- The fused per-sequence stage (rlkernels/stage/fused.py; its GPU twin: kernels/triton/stage.py) ----------
// The common PPO family's loss and gradient coefficients from [N] per-token values: one parallel loop over
// sequences (each reads its tokens twice: the sums its decisions need, then each token's IS weight, final mask,
// PPO term and derivatives, and the sequence's sums into an [S, kRecord] record), the batch's normalisers from the
// record, the loss, then one parallel loop over tokens scaling each coefficient by its aggregation weight a_t. The
// arithmetic is the torch stage's in float32, a sequence's sums kept in lanes (LaneSum); the options arrive as codes
// (kernels/stage_options.py, in the enums' order), the hyperparameters as floats. The same bits on any thread count.
namespace stage {
enum OptionCode {
  kProximal, kWeighted, kIsLevel, kIsMask, kRsK1Sum, kRsK1Mean, kRsK3Sum, kRsK3Mean, kRatioClamp, kDualClip,
  kKlType, kKlStraight, kAggregation, kSeqMeanOverAll, kGlobalTokens, kGlobalSeqs, kScaleFactor, kNormalize,
  kEntropyAggregation, kPolicy, kSeqMeanAdvantages, kZeroWeight, kKlScore, kRsToken, kRsAll, kSeqTokensKept,
  kGivenWeights, kCispoCap, kKlBiasCorrection, kSampler, kLogRatioSq, kRsK2, kRsK3Max, kRsBinary, kOpsm, kOptionCount
};
enum HyperCode {
  kIsLo, kIsHi, kK1SumLo, kK1SumHi, kK1MeanLo, kK1MeanHi, kK3SumMax, kK3MeanMax, kRatioClampValue, kClipLo, kClipHi,
  kClipC, kTokenK1Lo, kTokenK1Hi, kTokenK2Max, kTokenK3Max, kAllK1Lo, kAllK1Hi, kCispoCapValue, kBinaryTvLow,
  kBinaryTvHigh, kIpoKlTau, kIpoEps, kDroBeta, kTauPos, kTauNeg, kEpsLo, kEpsHi, kK2SumMax, kK2MeanMax, kK2MaxBound,
  kK3MaxBound, kTokenBklMax, kTokenBtvMax, kBklMeanMax, kBtvMeanMax, kOpsmThreshold, kKlCoef, kEntropyCoeff,
  kGlobalTokensValue, kGlobalSeqsValue, kScaleFactorValue, kLogRatioSqCoef, kHyperCount
};
constexpr float kClamp = 20.0f;  // SPEC §4: importance log-ratios are clamped to [-20, 20] before exp
// a sequence's record: policy-term sum, KL sum, entropy sum (over m'), final length, width, the IS weights' sum (the
// token weights', or the sequence's one weight: what is_batch_normalize averages), masked length, the sum over m' of
// the weighted policy derivative in the sequence's log-ratio (kPolicy 1: each token's coefficient is its mean), and
// the KL sum over m' where the bias-corrected KL's ratio is the sequence's and its clamp passes the gradient (0 else),
// the sum over m' of (log p/q)^2 against the sampler (log_ratio_sq_coef's term)
constexpr int64_t kRecord = 10;
// kPolicy: PPO's clip of the token's ratio, of its sequence's mean log-ratio (ratio_level="sequence"), GSPO's token
// form, CISPO of the token's ratio or of its sequence's, prime-rl's trust regions on the sampler (dppo_binary_tv,
// dppo_binary_tv_signed, IPO), GPG, DRO, SAPO of the token's ratio or of its sequence's, verl's DPPO regions on
// π_old (dppo_tv, dppo_kl)
enum PolicyCode {
  kPpo, kPpoSequence, kGspo, kCispo, kCispoSequence, kBinaryTv, kBinaryTvSigned, kIpo, kGpg, kDro, kSapo,
  kSapoSequence, kDppoTv, kDppoKl
};

// ratio_level="sequence": the policy terms of the sequence's ratio, which the bias-corrected KL multiplies too (GSPO's
// token form has the token's)
inline bool sequence_level(const int64_t* o) {
  return o[kPolicy] == kPpoSequence || o[kPolicy] == kCispoSequence || o[kPolicy] == kSapoSequence;
}

// the terms whose derivative in the sequence's mean log-ratio goes through the record (column 7), chained per token
inline bool chained(const int64_t* o) { return o[kPolicy] == kPpoSequence || o[kPolicy] == kSapoSequence; }

// torch.clamp: NaN stays NaN
inline float clamp(float x, float lo, float hi) { return std::isnan(x) ? x : std::min(std::max(x, lo), hi); }

inline float truncated(float raw, bool live, float lo, float hi, bool mask_mode) {
  if (!live) return 0.0f;
  if (mask_mode) return (raw >= lo && raw <= hi) ? raw : 0.0f;
  return clamp(raw, lo, hi);
}

// SPEC §6's penalty and its derivative in lp (stage/loss.py kl_and_grad): 1 k1, 2 k2, 3 abs, 4 k3, 5 k3 unclamped
inline void kl_and_grad(float lp, float ref, int64_t type, bool straight, float& kl, float& dkl) {
  if (type == 1) {
    kl = lp - ref, dkl = 1.0f;
  } else if (type == 2) {
    kl = 0.5f * ((lp - ref) * (lp - ref)), dkl = lp - ref;
  } else if (type == 3) {
    kl = std::fabs(lp - ref), dkl = lp > ref ? 1.0f : (lp < ref ? -1.0f : 0.0f);
  } else if (type == 4) {
    const float d_raw = ref - lp, d = clamp(d_raw, -kClamp, kClamp), k3_raw = std::exp(d) - d - 1.0f;
    kl = clamp(k3_raw, -10.0f, 10.0f);
    const bool live = d_raw >= -kClamp && d_raw <= kClamp && k3_raw <= 10.0f && k3_raw >= -10.0f;
    dkl = live ? 1.0f - std::exp(d) : 0.0f;
  } else {
    const float d = ref - lp;
    kl = std::exp(d) - d - 1.0f, dkl = 1.0f - std::exp(d);
  }
  if (straight) dkl = lp - ref;
}

// kl_score_gradient's derivative (NeMo-RL: k x exp(lp - sg lp)): dkl + k where the estimator's clamps pass a gradient
// (loss.kl_gradient_passes: everywhere but k3's, |ref - lp| <= 20 and k3 <= 10).
inline float kl_score(float lp, float ref, float kl, float dkl, int64_t type, bool straight) {
  if (type == 5 && !straight) return lp - ref;  // (1 - e^d) + (e^d - d - 1) = -d: the e^d terms cancel exactly
  if (type != 4 || straight) return dkl + kl;
  const float d_raw = ref - lp, d = clamp(d_raw, -kClamp, kClamp);
  const bool passes = d_raw >= -kClamp && d_raw <= kClamp && std::exp(d) - d - 1.0f <= 10.0f;
  return dkl + (passes ? kl : 0.0f);
}

// A per-token input on the mask, 0 off it (padding may hold NaN: it must reach no sum), as the torch stage's are.
inline float on_mask(const float* x, int64_t t, bool m) { return m ? x[t] : 0.0f; }

// r = exp(log_r), log_r clamped to [-log_ratio_clamp, log_ratio_clamp] where the options clamp it
// (policy_terms.clamped_ratio).
inline float policy_ratio(float log_r, const int64_t* o, const float* h) {
  return std::exp(o[kRatioClamp] ? clamp(log_r, -h[kRatioClampValue], h[kRatioClampValue]) : log_r);
}

// kl_bias_correction (DeepSeek-V3.2's, TRL's use_bias_correction_kl; loss._bias_corrected_kl): the penalty times the
// policy ratio r = exp(log_r) (log_r clamped where the options clamp it), and its derivative in lp. The token's ratio
// (token_ratio) adds r's own derivative r k where the clamp passes it; the sequence's goes through its mean log-ratio,
// which the finish chains. The unclamped k3 is e^(d + log r) - (d + 1) r, d = ref - lp, with -d r its token-level
// derivative (two e^d terms of ~1e17 would cancel otherwise).
inline void bias_corrected_kl(float lp, float ref, float log_r, bool token_ratio, const int64_t* o, const float* h,
                              float& kl, float& dkl) {
  const bool clamped = o[kRatioClamp];
  const float bound = h[kRatioClampValue], log_r_hat = clamped ? clamp(log_r, -bound, bound) : log_r;
  const float r = policy_ratio(log_r, o, h);
  const bool unclamped_k3 = o[kKlType] == 5 && !o[kKlStraight];
  float value = kl * r, corrected = dkl * r;
  if (unclamped_k3) {
    const float d = ref - lp;
    value = std::exp(d + log_r_hat) - (d + 1.0f) * r;
  }
  if (token_ratio && (!clamped || std::fabs(log_r) <= bound)) {  // r's own derivative, where the clamp passes it
    corrected = unclamped_k3 ? (lp - ref) * r : corrected + value;
  }
  kl = value, dkl = corrected;
}

// PPO's clip with dual clip of the ratio exp(log_r) (log_r clamped to log_ratio_clamp), and its derivative in log_r,
// both times the IS weight w where the options weigh (policy_terms._ppo_clip). Not inlined, nor are ppo_term and
// token_coefficient: the stage and the gradient formed in the forward (forward_gradient_rows) run one compiled copy,
// so a token's coefficient is the same bits in both.
__attribute__((noinline)) void ppo_clip(float log_r, float adv, float w, const int64_t* o, const float* h,
                                        float& term_out, float& grad_out) {
  const float r = policy_ratio(log_r, o, h);
  const float neg_adv = -adv, l1 = neg_adv * r, l2 = neg_adv * clamp(r, h[kClipLo], h[kClipHi]);
  const bool clipped = l2 > l1;
  float term = clipped ? l2 : l1;
  bool active = !clipped;
  if (o[kDualClip]) {
    const float l3 = neg_adv * h[kClipC];
    const bool dual = adv < 0.0f && l3 < term;
    term = dual ? l3 : term, active = active && !dual;
  }
  float grad = active ? l1 : 0.0f;
  if (o[kRatioClamp] && !(std::fabs(log_r) <= h[kRatioClampValue])) grad = 0.0f;
  if (o[kWeighted]) term *= w, grad *= w;
  term_out = term, grad_out = grad;
}

// The token's PPO term: ppo_clip of its own log-ratio lp - l_old.
__attribute__((noinline)) void ppo_term(float lp, float l_old, float adv, float w, const int64_t* o, const float* h,
                                        float& term_out, float& grad_out) {
  ppo_clip(lp - l_old, adv, w, o, h, term_out, grad_out);
}

// GSPO's token form (policy_terms.gspo): s = exp(min(log_s, 10)) of the sequence's mean log-ratio log_s, clipped as
// PPO, and its derivative in the token's lp (d s / d lp = s), both times w where the options weigh.
inline void gspo_term(float log_s, float adv, float w, const int64_t* o, const float* h, float& term_out,
                      float& grad_out) {
  const float s = std::exp(std::isnan(log_s) ? log_s : std::min(log_s, 10.0f));
  const float neg_adv = -adv, l1 = neg_adv * s, l2 = neg_adv * clamp(s, h[kClipLo], h[kClipHi]);
  const bool clipped = l2 > l1;
  float term = clipped ? l2 : l1, grad = !clipped && log_s <= 10.0f ? l1 : 0.0f;
  if (o[kWeighted]) term *= w, grad *= w;
  term_out = term, grad_out = grad;
}

// c_t = a_t g_t + (beta a_t) dKL_t from the token's weighted policy derivative g_t (over the batch normalisation's
// factor where it applies), its a_t and its KL derivative (loss.run). One rounding for the sum of products, spelled
// out: -ffp-contract=fast could contract two copies differently (a gradient that depended on the thread count).
__attribute__((noinline)) float token_coefficient(float grad, float a, float factor, bool normalize, bool has_kl,
                                                  float beta, float dkl) {
  const float g = normalize ? grad / factor : grad;
  return has_kl ? std::fma(beta * a, dkl, a * g) : a * g;
}

// token_coefficient's twin for kPolicy 1: the policy part is the sequence's sum over m' of the weighted derivative in
// its mean log-ratio (grad_sum), times a_t, over its final length (0 off m'), then the KL's (a_t beta) dKL_t.
__attribute__((noinline)) float sequence_coefficient(float grad_sum, float a, float final_length, bool kept,
                                                     float factor, bool normalize, bool has_kl, float beta, float dkl) {
  const float g = normalize ? grad_sum / factor : grad_sum;
  const float chained = kept ? (a * g) / std::max(final_length, 1.0f) : 0.0f;
  return has_kl ? std::fma(beta * a, dkl, chained) : chained;
}

struct Inputs {
  const float *lp, *entropy, *adv, *old, *rollout, *ref, *given;  // given: a trainer's own IS weights, or nullptr
  const bool* mask;
  const int64_t* cu;  // nullptr: the padded layout, seq_len tokens each
  int64_t seq_len;
};

// A token's trainer-sampler mismatch (correction.token_terms): delta = log π_old - log μ on the mask, delta clamped
// to [-20, 20] (SPEC §4), and k3 of the clamped delta (0 off the mask).
struct Mismatch {
  float delta, delta_hat, k3;
};

inline Mismatch mismatch(const Inputs& in, int64_t t, bool m) {
  const float delta = on_mask(in.old, t, m) - on_mask(in.rollout, t, m);
  const float delta_hat = clamp(delta, -kClamp, kClamp);
  return {delta, delta_hat, m ? std::exp(delta_hat) - 1.0f - delta_hat : 0.0f};
}

// The sampled token's binary KL(μ || π_old) of (token, rest) and its probability gap |μ - π_old| (correction's bkl and
// btv: OpenRLHF's binary_kl and tv gates), 0 off the mask and where not asked for; each probability clamped to
// [eps, 1 - eps] (correction.BINARY_EPS), 1 - x formed as -expm1(log x) (policy_terms.binary_kl).
struct Binary {
  float bkl, btv;
};

inline Binary binary_stats(const Inputs& in, int64_t t, bool m, bool bkl, bool btv) {
  if (!m || !(bkl || btv)) return {0.0f, 0.0f};
  constexpr double kEps = 1e-6;
  const float log_lo = static_cast<float>(std::log(kEps)), log_hi = static_cast<float>(std::log1p(-kEps));
  const float lo = static_cast<float>(kEps), hi = static_cast<float>(1.0 - kEps);
  const auto parts = [&](float log_x, float& x, float& log_clamped, float& log_rest) {
    log_clamped = clamp(log_x, log_lo, log_hi), x = std::exp(log_clamped);
    log_rest = std::log(clamp(-std::expm1(log_x), lo, hi));
  };
  float mu, log_mu, log_mu_rest, pi, log_pi, log_pi_rest;
  parts(in.rollout[t], mu, log_mu, log_mu_rest), parts(in.old[t], pi, log_pi, log_pi_rest);
  return {bkl ? mu * (log_mu - log_pi) + std::exp(log_mu_rest) * (log_mu_rest - log_pi_rest) : 0.0f,
          btv ? std::fabs(mu - pi) : 0.0f};
}

// token_keeps' twin for the binary divergences (TOKEN_KINDS bits 8: bkl, 16: btv); a NaN statistic fails.
inline bool binary_keeps(bool keep, const Binary& b, int64_t kinds, const float* h) {
  if (kinds & 8) keep = keep && b.bkl <= h[kTokenBklMax];
  if (kinds & 16) keep = keep && b.btv <= h[kTokenBtvMax];
  return keep;
}

// The token of m keeps its k-statistics of the set `kinds` (kernels/stage_options.py TOKEN_KINDS bits: 1 k1, 2 k2,
// 4 k3) inside their bounds (k1 in [k1_lo, k1_hi], k2 <= k2_max, k3 <= k3_max: correction._keeps); a NaN statistic
// fails.
inline bool token_keeps(bool m, float delta_hat, float k3, int64_t kinds, float k1_lo, float k1_hi, float k2_max,
                        float k3_max) {
  bool keep = m;
  if (kinds & 1) keep = keep && -delta_hat <= k1_hi && -delta_hat >= k1_lo;
  if (kinds & 2) keep = keep && 0.5f * delta_hat * delta_hat <= k2_max;
  if (kinds & 4) keep = keep && k3 <= k3_max;
  return keep;
}

// CISPO (policy_terms.cispo): -sg(c) A lp with c = clip(r, lo, hi) or min(r, cap) of the ratio exp(log_r) (log_r
// clamped to log_ratio_clamp), and its derivative in lp, -c A, both times w where the options weigh.
inline void cispo_term(float lp, float log_r, float adv, float w, const int64_t* o, const float* h, float& term_out,
                       float& grad_out) {
  const float r = policy_ratio(log_r, o, h);
  const float c = o[kCispoCap] ? (std::isnan(r) ? r : std::min(r, h[kCispoCapValue]))
                                : clamp(r, h[kClipLo], h[kClipHi]);
  float grad = -c * adv, term = grad * lp;
  if (o[kWeighted]) term *= w, grad *= w;
  term_out = term, grad_out = grad;
}

// prime-rl's trust regions on the sampler (policy_terms._rollout_trust_region): -A r + tau d^2 on the kept tokens, 0
// elsewhere, and its derivative in lp, (-A r where the clamp passes it) + 2 tau d there, both times w where the
// options weigh; d = lp - log q, r = exp(d). Kept: p - q inside [-low, high] (dppo_binary_tv), or not past the bound on
// the advantage's side (dppo_binary_tv_signed: p - q > high drops a token where A > 0, p - q < -low elsewhere), or
// |p - q| <= ipo_eps (IPO; e^high (1 - e^(low - high)), no cancellation of two small probabilities); selected, never
// multiplied, so an overflowing r off the region makes no NaN.
inline void trust_region_term(float lp, float behaviour, float adv, float w, const int64_t* o, const float* h,
                              float& term_out, float& grad_out) {
  const float d = lp - behaviour, r = policy_ratio(d, o, h), gap = std::exp(lp) - std::exp(behaviour);
  const float lo = h[kBinaryTvLow], hi = h[kBinaryTvHigh], tau = h[kIpoKlTau];
  bool keep;
  if (o[kPolicy] == kIpo) {
    const float high = std::max(lp, behaviour);
    keep = std::exp(high) * -std::expm1(std::min(lp, behaviour) - high) <= h[kIpoEps];
  } else {
    keep = o[kPolicy] == kBinaryTv ? gap >= -lo && gap <= hi : !(adv > 0.0f ? gap > hi : gap < -lo);
  }
  const float scaled = -adv * r;
  const float direct = o[kRatioClamp] && !(std::fabs(d) <= h[kRatioClampValue]) ? 0.0f : scaled;
  float term = keep ? scaled + tau * d * d : 0.0f, grad = keep ? direct + 2.0f * tau * d : 0.0f;
  if (o[kWeighted]) term *= w, grad *= w;
  term_out = term, grad_out = grad;
}

// SAPO's soft gate (policy_terms.sapo): -A g 4 / tau with g = sigmoid(tau (r - 1)), tau by the advantage's sign, of
// the ratio exp(log_r) (log_r clamped where the options clamp it), and its derivative in log_r, -A 4 g (1 - g) r where
// the clamp passes it, both times w where the options weigh; 1 - g formed as sigmoid(-x), which keeps the slope of a
// saturated gate.
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

inline void sapo_term(float log_r, float adv, float w, const int64_t* o, const float* h, float& term_out,
                      float& grad_out) {
  const float r = policy_ratio(log_r, o, h), tau = adv > 0.0f ? h[kTauPos] : h[kTauNeg];
  const float x = tau * (r - 1.0f), gate = sigmoid(x), slope = gate * sigmoid(-x), neg_adv = -adv;
  const bool passes = !o[kRatioClamp] || std::fabs(log_r) <= h[kRatioClampValue];
  float term = neg_adv * gate * 4.0f / tau, grad = passes ? neg_adv * 4.0f * slope * r : 0.0f;
  if (o[kWeighted]) term *= w, grad *= w;
  term_out = term, grad_out = grad;
}

// GPG (-A lp, derivative -A) and DRO (policy_terms.dro: -(lp A - beta/2 d^2), d = lp - l_old unclamped, derivative
// -A + beta d), both times w where the options weigh.
inline void gpg_or_dro_term(float lp, float l_old, float adv, float w, const int64_t* o, const float* h,
                            float& term_out, float& grad_out) {
  float term = -adv * lp, grad = -adv;
  if (o[kPolicy] == kDro) {
    const float d = lp - l_old, beta = h[kDroBeta];
    term = -(lp * adv - 0.5f * beta * d * d), grad = -adv + beta * d;
  }
  if (o[kWeighted]) term *= w, grad *= w;
  term_out = term, grad_out = grad;
}

// verl's DPPO (policy_terms._dppo): -A sg(min(r, c)) lp on the tokens inside the region (c: clip_ratio_c, else 20),
// 0 elsewhere, and its derivative in lp, both times w where the options weigh. The region (policy_terms._dppo_inside):
// p - p_old within eps_hi where A > 0, within -eps_lo elsewhere (dppo_tv); or the binary KL of (p_old, p) within them
// or a move against the advantage (dppo_kl, verl's 1e-8 guards).
inline void dppo_term(float lp, float l_old, float adv, float w, const int64_t* o, const float* h, float& term_out,
                      float& grad_out) {
  const float r = policy_ratio(lp - l_old, o, h), cap = o[kDualClip] ? h[kClipC] : 20.0f;
  const float truncated = std::isnan(r) ? r : std::min(r, cap), p = std::exp(lp), p_old = std::exp(l_old);
  const float lo = h[kEpsLo], hi = h[kEpsHi];
  bool inside;
  if (o[kPolicy] == kDppoTv) {
    inside = adv > 0.0f ? p - p_old <= hi : p - p_old >= -lo;
  } else {
    const float bkl = p_old * (l_old - lp) + (1.0f - p_old) * std::log((1.0f - p_old + 1e-8f) / (1.0f - p + 1e-8f));
    inside = adv > 0.0f ? bkl <= hi || p <= p_old : bkl <= lo || p >= p_old;
  }
  const float grad = -adv * truncated;
  float term = inside ? grad * lp : 0.0f, coefficient = inside ? grad : 0.0f;
  if (o[kWeighted]) term *= w, coefficient *= w;
  term_out = term, grad_out = coefficient;
}

// l_old of SPEC §1 on the mask: π_old (decoupled), μ (bypass), or the current log-prob (on-policy).
inline float proximal(const Inputs& in, int64_t t, bool m, float lp, const int64_t* o) {
  return o[kProximal] == 1 ? on_mask(in.old, t, m) : o[kProximal] == 2 ? on_mask(in.rollout, t, m) : lp;
}

struct Outputs {
  float *lp, *grad, *dkl, *sq, *weights, *record;
  bool* kept;
};

// Sums of a sequence's values in kLanes interleaved partial sums, added pairwise at the end: the error of a long
// sequence's sum grows as its length over kLanes, not its length (the Triton kernel keeps 512).
constexpr int kLanes = 16;
struct LaneSum {
  float lane[kLanes] = {};
  void add(int64_t i, float x) { lane[i % kLanes] += x; }
  float total() const {
    float part[kLanes];
    std::copy(lane, lane + kLanes, part);
    for (int width = kLanes / 2; width > 0; width /= 2)
      for (int j = 0; j < width; ++j) part[j] += part[j + width];
    return part[0];
  }
};

// One sequence: its decisions and its tokens' outputs, and its record (kRecord). Not inlined: one compiled copy
// serves the serial and the threaded loop, so a result never depends on the thread count (-ffp-contract=fast could
// contract two inlined copies differently).
__attribute__((noinline)) void sequence(int64_t s, const Inputs& in, const Outputs& out, const int64_t* o,
                                        const float* h) {
  const int64_t start = in.cu ? in.cu[s] : s * in.seq_len, end = in.cu ? in.cu[s + 1] : start + in.seq_len;
  const int64_t token_kinds = o[kRsToken];
  const bool all_k1 = o[kRsAll];  // seq_all_k1
  const int64_t k2_scopes = o[kRsK2];  // seq_sum_k2, seq_mean_k2, seq_max_k2 (stage_options.K2_SCOPES bits)
  // the binary divergences: of each token (token_kinds bits 8, 16), their means over the sequence (BINARY_MEANS bits)
  const int64_t binary_means = o[kRsBinary];
  const bool need_bkl = (token_kinds & 8) || (binary_means & 1), need_btv = (token_kinds & 16) || (binary_means & 2);
  const bool peaks = (k2_scopes & 4) || o[kRsK3Max];  // a k2 or k3 maximum over the sequence
  const bool rejects = o[kRsK1Sum] || o[kRsK1Mean] || o[kRsK3Sum] || o[kRsK3Mean] || token_kinds || all_k1 ||
                       k2_scopes || o[kRsK3Max] || binary_means;
  const bool corrects = rejects || o[kIsLevel] != 0, zero_weight = o[kZeroWeight], over_kept = o[kSeqTokensKept];
  const int64_t policy = o[kPolicy];  // the policy ratio is the sequence's:
  const bool sequence_ratio = sequence_level(o) || policy == kGspo;
  const bool seq_level = sequence_level(o);
  // the trust regions and the log-ratio square are taken against the behaviour policy
  const bool uses_behaviour = (policy >= kBinaryTv && policy <= kIpo) || o[kLogRatioSq];
  // the tokens the token_* options keep (kept_length_sum) and those outside seq_all_k1's band
  LaneSum length_sum, delta_sum, k1_sum, k3_sum, pg_delta_sum, adv_sum, kept_length_sum, rejecting_sum, k2_sum,
      bkl_sum, btv_sum, opsm_sum;
  // the maxima over m (correction's add_max), and whether a statistic is NaN (its maximum then is, as torch's)
  float k2_peak = -std::numeric_limits<float>::infinity(), k3_peak = k2_peak;
  bool nan_peak = false;
  for (int64_t t = start; t < end; ++t) {
    const bool m = in.mask[t];
    length_sum.add(t, m ? 1.0f : 0.0f);
    bool token_keep = m;
    if (corrects) {
      const auto [delta, delta_hat, k3_token] = mismatch(in, t, m);
      const Binary binary = binary_stats(in, t, m, need_bkl, need_btv);
      if (token_kinds) {
        token_keep = token_keeps(m, delta_hat, k3_token, token_kinds, h[kTokenK1Lo], h[kTokenK1Hi], h[kTokenK2Max],
                                 h[kTokenK3Max]);
        token_keep = binary_keeps(token_keep, binary, token_kinds, h);
        kept_length_sum.add(t, token_keep ? 1.0f : 0.0f);
      }
      if (all_k1 && m && !token_keeps(m, delta_hat, k3_token, 1, h[kAllK1Lo], h[kAllK1Hi], 0.0f, 0.0f)) {
        rejecting_sum.add(t, 1.0f);
      }
      // the sequence statistics over m, or over the tokens the token options keep (SkyRL's order)
      const bool over = !over_kept || token_keep;
      delta_sum.add(t, over ? delta : 0.0f), k1_sum.add(t, over ? -delta_hat : 0.0f);
      k3_sum.add(t, over ? k3_token : 0.0f);
      if (binary_means) bkl_sum.add(t, over ? binary.bkl : 0.0f), btv_sum.add(t, over ? binary.btv : 0.0f);
      if (k2_scopes || o[kRsK3Max]) {
        const float k2_token = over ? 0.5f * delta_hat * delta_hat : 0.0f, k3_over = over ? k3_token : 0.0f;
        k2_sum.add(t, k2_token);
        if (peaks && m) {
          if (std::isnan(k2_token)) nan_peak = true;  // k3 is NaN with k2 (a NaN delta)
          k2_peak = std::max(k2_peak, k2_token), k3_peak = std::max(k3_peak, k3_over);
        }
      }
    }
    const bool summed = zero_weight ? m : token_keep;  // what loss._kept_sums sums (every token of m: zero_weight)
    if (sequence_ratio) {  // the sequence's policy log-ratio (pg_delta)
      const float lp = on_mask(in.lp, t, m);
      pg_delta_sum.add(t, summed ? lp - proximal(in, t, m, lp, o) : 0.0f);
    }
    if (o[kSeqMeanAdvantages]) adv_sum.add(t, summed ? on_mask(in.adv, t, m) : 0.0f);
    if (o[kOpsm]) {  // loss._kept_sums' opsm: the behaviour policy's log-prob less the current one
      const float lp = on_mask(in.lp, t, m);
      const float behaviour = o[kSampler] ? on_mask(in.rollout, t, m) : proximal(in, t, m, lp, o);
      opsm_sum.add(t, summed ? behaviour - lp : 0.0f);
    }
  }
  const float length = length_sum.total(), count = std::max(length, 1.0f), k1 = k1_sum.total(), k3 = k3_sum.total();
  const float kept_length = token_kinds ? kept_length_sum.total() : length;
  // what a sequence statistic's mean divides by: its tokens in m, or those the token options keep
  const float stat_count = over_kept ? std::max(kept_length, 1.0f) : count;
  float seq_weight = 0.0f;
  if (o[kIsLevel] >= 2) {
    const float log_sum = delta_sum.total();
    const float log_ratio = clamp(o[kIsLevel] == 3 ? log_sum / stat_count : log_sum, -kClamp, kClamp);
    seq_weight = truncated(std::exp(log_ratio), length > 0.0f, h[kIsLo], h[kIsHi], o[kIsMask]);
  }
  bool keep = true;  // a NaN statistic fails every bound, as the torch comparisons do
  if (o[kRsK1Sum]) keep = keep && k1 <= h[kK1SumHi] && k1 >= h[kK1SumLo];
  if (o[kRsK1Mean]) keep = keep && k1 / stat_count <= h[kK1MeanHi] && k1 / stat_count >= h[kK1MeanLo];
  if (o[kRsK3Sum]) keep = keep && k3 <= h[kK3SumMax];
  if (o[kRsK3Mean]) keep = keep && k3 / stat_count <= h[kK3MeanMax];
  if (all_k1) keep = keep && rejecting_sum.total() == 0.0f;  // every token of the sequence inside the band
  if (k2_scopes & 3) {
    const float k2 = k2_sum.total();
    if (k2_scopes & 1) keep = keep && k2 <= h[kK2SumMax];
    if (k2_scopes & 2) keep = keep && k2 / stat_count <= h[kK2MeanMax];
  }
  if (binary_means & 1) keep = keep && bkl_sum.total() / stat_count <= h[kBklMeanMax];
  if (binary_means & 2) keep = keep && btv_sum.total() / stat_count <= h[kBtvMeanMax];
  if (peaks) {  // 0 for a sequence without a token in m
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float k2_max = nan_peak ? nan : (length > 0.0f ? k2_peak : 0.0f);
    const float k3_max = nan_peak ? nan : (length > 0.0f ? k3_peak : 0.0f);
    if (k2_scopes & 4) keep = keep && k2_max <= h[kK2MaxBound];
    if (o[kRsK3Max]) keep = keep && k3_max <= h[kK3MaxBound];
  }
  // m' = m & token keep & keep; with rs_mode="zero_weight" m' = m, and rejection zeroes the IS weights instead
  if (zero_weight && !keep) seq_weight = 0.0f;
  // over 1 where rejection emptied the sequence
  const float final_count = zero_weight ? count : (keep ? std::max(kept_length, 1.0f) : 1.0f);
  // the sequence's mean policy log-ratio and advantage over its final mask
  const float log_s = sequence_ratio ? pg_delta_sum.total() / final_count : 0.0f;
  const float seq_adv = o[kSeqMeanAdvantages] ? adv_sum.total() / final_count : 0.0f;
  // OPSM: the sequence's mean sampler-to-current log-ratio over m' within delta (a NaN one is not)
  const bool opsm_within = o[kOpsm] && opsm_sum.total() / final_count <= h[kOpsmThreshold];
  LaneSum pg, kl_sum, entropy_sum, kept_count, weight_sum, grad_sum, sq_sum;
  for (int64_t t = start; t < end; ++t) {
    const bool m = in.mask[t];
    bool token_keep = m;
    if (token_kinds) {  // the first read's decision again, from π_old and μ (cheaper than storing it)
      const Mismatch x = mismatch(in, t, m);
      token_keep = token_keeps(m, x.delta_hat, x.k3, token_kinds, h[kTokenK1Lo], h[kTokenK1Hi], h[kTokenK2Max],
                               h[kTokenK3Max]);
      token_keep = binary_keeps(token_keep, binary_stats(in, t, m, token_kinds & 8, token_kinds & 16), token_kinds, h);
    }
    const bool kept = zero_weight ? m : token_keep && keep;
    const float lp = on_mask(in.lp, t, m);
    const float adv = o[kSeqMeanAdvantages] ? (kept ? seq_adv : 0.0f) : on_mask(in.adv, t, m);
    const float l_old = proximal(in, t, m, lp, o);
    // the sampler's log-probs where given, else l_old (loss._Inputs.behaviour)
    const float behaviour = !uses_behaviour ? 0.0f : o[kSampler] ? on_mask(in.rollout, t, m) : l_old;
    float w = 0.0f;
    if (o[kIsLevel] == 1) {
      const float delta_hat = clamp(l_old - on_mask(in.rollout, t, m), -kClamp, kClamp);
      w = truncated(std::exp(delta_hat), m, h[kIsLo], h[kIsHi], o[kIsMask]);
    } else if (o[kIsLevel] >= 2) {
      w = m ? seq_weight : 0.0f;
    } else if (o[kGivenWeights]) {  // a trainer's own, on the mask (loss._masked_inputs)
      w = on_mask(in.given, t, m);
    }
    if (zero_weight && !(token_keep && keep)) w = 0.0f;
    if (o[kWeighted]) out.weights[t] = w, weight_sum.add(t, w);
    float term, grad;
    if (o[kPolicy] == kPpo) {
      ppo_term(lp, l_old, adv, w, o, h, term, grad);
    } else if (o[kPolicy] == kPpoSequence) {  // d term / d log_s, which the finish chains through the mean
      ppo_clip(log_s, adv, w, o, h, term, grad);
    } else if (o[kPolicy] == kGspo) {
      gspo_term(log_s, adv, w, o, h, term, grad);
    } else if (o[kPolicy] == kCispo || o[kPolicy] == kCispoSequence) {
      // CISPO of the token's ratio, or of the sequence's (its gradient through lp alone: sg(c))
      cispo_term(lp, o[kPolicy] == kCispo ? lp - l_old : log_s, adv, w, o, h, term, grad);
    } else if (o[kPolicy] == kGpg || o[kPolicy] == kDro) {
      gpg_or_dro_term(lp, l_old, adv, w, o, h, term, grad);
    } else if (o[kPolicy] == kSapo || o[kPolicy] == kSapoSequence) {  // the sequence's: d term / d log_s, chained
      sapo_term(o[kPolicy] == kSapo ? lp - l_old : log_s, adv, w, o, h, term, grad);
    } else if (o[kPolicy] == kDppoTv || o[kPolicy] == kDppoKl) {
      dppo_term(lp, l_old, adv, w, o, h, term, grad);
    } else {
      trust_region_term(lp, behaviour, adv, w, o, h, term, grad);
    }
    if (o[kOpsm] && !(adv >= 0.0f || opsm_within)) term = 0.0f, grad = 0.0f;  // loss._weigh_and_mask
    pg.add(t, kept ? term : 0.0f);
    if (chained(o)) {
      grad_sum.add(t, kept ? grad : 0.0f);
    } else {
      out.grad[t] = grad;
    }
    if (o[kKlType] != 0) {
      float kl, dkl;
      const float ref = on_mask(in.ref, t, m);
      kl_and_grad(lp, ref, o[kKlType], o[kKlStraight], kl, dkl);
      if (o[kKlScore]) dkl = kl_score(lp, ref, kl, dkl, o[kKlType], o[kKlStraight]);
      if (o[kKlBiasCorrection]) bias_corrected_kl(lp, ref, seq_level ? log_s : lp - l_old, !seq_level, o, h, kl, dkl);
      kl_sum.add(t, kept ? kl : 0.0f);
      out.dkl[t] = dkl;
    }
    if (o[kLogRatioSq]) {  // the log-ratio against the sampler on m' (loss._add_log_ratio_sq)
      const float d = kept ? lp - behaviour : 0.0f;
      sq_sum.add(t, d * d), out.sq[t] = d;
    }
    if (in.entropy) entropy_sum.add(t, kept ? on_mask(in.entropy, t, m) : 0.0f);
    kept_count.add(t, kept ? 1.0f : 0.0f);
    out.lp[t] = lp, out.kept[t] = kept;
  }
  float* row = out.record + s * kRecord;
  row[0] = pg.total(), row[1] = kl_sum.total(), row[2] = entropy_sum.total(), row[3] = kept_count.total();
  row[4] = static_cast<float>(end - start);
  row[5] = o[kIsLevel] == 1 ? weight_sum.total() : seq_weight, row[6] = length, row[7] = grad_sum.total();
  // the bias-corrected KL's sum where it goes through the sequence's ratio: the finish chains it to each token
  const bool kl_chained = o[kKlBiasCorrection] && seq_level && o[kKlType] != 0 &&
                          (!o[kRatioClamp] || std::fabs(log_s) <= h[kRatioClampValue]);
  row[8] = kl_chained ? row[1] : 0.0f, row[9] = sq_sum.total();
}

// The offsets, read on the host (free on the CPU): every token in exactly one sequence, or the op refuses.
void check_layout(const char* op, const int64_t* cu, int64_t S, int64_t seq_len, int64_t N, const int64_t* seq_id) {
  TORCH_CHECK(S >= 0, op, ": num_seqs must be >= 0");
  if (cu) {
    TORCH_CHECK(cu[0] == 0 && cu[S] == N, op, ": cu_seqlens must run from 0 to N = ", std::to_string(N));
    for (int64_t s = 0; s < S; ++s) TORCH_CHECK(cu[s] <= cu[s + 1], op, ": cu_seqlens must not decrease");
  } else {
    TORCH_CHECK(S * seq_len == N, op, ": num_seqs x seq_len must be N = ", std::to_string(N));
  }
  for (int64_t t = 0; t < N; ++t) TORCH_CHECK(seq_id[t] >= 0 && seq_id[t] < S, op, ": seq_id out of [0, S)");
}
}  // namespace stage

// Returns (loss, lp, coef, coef_entropy, weights, kept); with `factors` (what forward_gradient forms a coefficient
// from) (the batch normalisation's factor, lp, a_t, coef_entropy, the unnormalised weights, kept) instead.
// coef_entropy and weights are [0] where the options have
// none (no entropy input; no IS level).
std::vector<at::Tensor> sequence_stage(const at::Tensor& lp, const std::optional<at::Tensor>& entropy,
                                       const at::Tensor& advantages, const at::Tensor& mask,
                                       const std::optional<at::Tensor>& old, const std::optional<at::Tensor>& rollout,
                                       const std::optional<at::Tensor>& ref,
                                       const std::optional<at::Tensor>& is_weights,
                                       const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& seq_id,
                                       int64_t seq_len, int64_t num_seqs, at::IntArrayRef options,
                                       at::ArrayRef<double> hyper, bool factors) {
  using namespace stage;
  const char* op = "sequence_stage";
  const int64_t N = lp.numel(), S = num_seqs;
  TORCH_CHECK(options.size() == kOptionCount && hyper.size() == kHyperCount, op, ": expected ",
              std::to_string(kOptionCount), " option codes and ", std::to_string(kHyperCount), " hyperparameters");
  auto f32 = [&](const std::optional<at::Tensor>& t, const char* name) -> const float* {
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N, op, ": ", name,
                " must be contiguous float32 [N]");
    return t->data_ptr<float>();
  };
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.numel() == N, op,
              ": mask must be contiguous bool [N]");
  TORCH_CHECK(seq_id.scalar_type() == at::kLong && seq_id.is_contiguous() && seq_id.numel() == N, op,
              ": seq_id must be contiguous int64 [N]");
  const int64_t* o = options.data();
  float h[kHyperCount];
  for (int i = 0; i < kHyperCount; ++i) h[i] = static_cast<float>(hyper[i]);  // as a float kernel argument rounds
  const int64_t* cu = nullptr;
  if (cu_seqlens.has_value()) {
    TORCH_CHECK(cu_seqlens->scalar_type() == at::kLong && cu_seqlens->is_contiguous() && cu_seqlens->numel() == S + 1,
                op, ": cu_seqlens must be contiguous int64 [S + 1]");
    cu = cu_seqlens->data_ptr<int64_t>();
  }
  check_layout(op, cu, S, seq_len, N, seq_id.data_ptr<int64_t>());
  const Inputs in{f32(lp, "lp"), f32(entropy, "entropy"), f32(advantages, "advantages"), f32(old, "old"),
                  f32(rollout, "rollout"), f32(ref, "ref"), f32(is_weights, "is_weights"), mask.data_ptr<bool>(), cu,
                  seq_len};
  const bool weighted = o[kWeighted], has_kl = o[kKlType] != 0, has_entropy = in.entropy != nullptr;
  const auto options_f32 = lp.options().dtype(at::kFloat);
  at::Tensor lp_out = at::empty({N}, options_f32), coef = at::empty({N}, options_f32);
  at::Tensor weights = at::empty({weighted ? N : 0}, options_f32);
  at::Tensor coef_entropy = at::empty({has_entropy ? N : 0}, options_f32);
  at::Tensor dkl = at::empty({has_kl ? N : 0}, options_f32), record = at::empty({S, kRecord}, options_f32);
  at::Tensor sq = at::empty({o[kLogRatioSq] ? N : 0}, options_f32);
  at::Tensor kept = at::empty({N}, mask.options());
  const Outputs out{lp_out.data_ptr<float>(), coef.data_ptr<float>(), dkl.data_ptr<float>(), sq.data_ptr<float>(),
                    weights.data_ptr<float>(), record.data_ptr<float>(), kept.data_ptr<bool>()};
  at::parallel_for(0, S, 16, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) sequence(s, in, out, o, h);
  });
  // the batch's normalisers (correction.normalisers, loss.aggregation_weights)
  const float* rec = out.record;
  float kept_tokens = 0.0f, kept_seqs = 0.0f, width = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    kept_tokens += rec[s * kRecord + 3], kept_seqs += rec[s * kRecord + 3] > 0.0f ? 1.0f : 0.0f;
    width = std::max(width, rec[s * kRecord + 4]);
  }
  const float tokens = o[kGlobalTokens] ? h[kGlobalTokensValue] : std::max(kept_tokens, 1.0f);
  const float seqs = o[kGlobalSeqs] ? h[kGlobalSeqsValue]
                                    : (o[kSeqMeanOverAll] ? std::max(static_cast<float>(S), 1.0f)
                                                          : std::max(kept_seqs, 1.0f));
  const float K = o[kScaleFactor] ? h[kScaleFactorValue] : std::max(width, 1.0f);
  // a_t = m'_t / its denominator (loss.aggregation_weights) in aggregation mode `agg`: 0 token-sum, 1 token-mean,
  // 2 seq-mean-token-mean (per sequence), 3 seq-mean-token-sum, 4 seq-mean-token-sum-norm
  auto per_token = [&](int64_t agg) { return agg == 0 ? 1.0f : agg == 1 ? tokens : agg == 3 ? seqs : seqs * K; };
  const int64_t agg = o[kAggregation], agg_entropy = o[kEntropyAggregation];
  const float per_token_loss = per_token(agg), per_token_entropy = per_token(agg_entropy);
  auto weight = [&](float kept, float final_length, int64_t mode, float denominator) {
    return mode == 2 ? kept / (std::max(final_length, 1.0f) * seqs) : (mode == 0 ? kept : kept / denominator);
  };
  float pg = 0.0f, kl_total = 0.0f, sq_total = 0.0f, entropy_total = 0.0f;
  for (int64_t s = 0; s < S; ++s) {
    const float a = weight(1.0f, rec[s * kRecord + 3], agg, per_token_loss);
    const float a_entropy = weight(1.0f, rec[s * kRecord + 3], agg_entropy, per_token_entropy);
    pg += a * rec[s * kRecord], kl_total += a * rec[s * kRecord + 1], sq_total += a * rec[s * kRecord + 9];
    entropy_total += a_entropy * rec[s * kRecord + 2];
  }
  // is_batch_normalize: the IS weights over their batch mean (over the masked tokens, or the non-empty sequences)
  float factor = 1.0f;
  if (o[kNormalize] != 0) {
    float total = 0.0f, count = 0.0f;
    for (int64_t s = 0; s < S; ++s) {
      total += rec[s * kRecord + 5];
      count += o[kNormalize] == 1 ? rec[s * kRecord + 6] : (rec[s * kRecord + 6] > 0.0f ? 1.0f : 0.0f);
    }
    const float mean = total / std::max(count, 1.0f);
    factor = mean > 1e-8f ? mean : 1.0f;
  }
  float loss = o[kNormalize] != 0 ? pg / factor : pg;
  if (has_kl) loss = loss + h[kKlCoef] * kl_total;
  if (o[kLogRatioSq]) loss = loss + h[kLogRatioSqCoef] * sq_total;
  if (has_entropy) loss = loss + -h[kEntropyCoeff] * entropy_total;
  // each token's coefficients: c_t = a_t g_t + (beta a_t) dKL_t, e_t = -entropy_coeff a_t (loss.run)
  const int64_t* sid = seq_id.data_ptr<int64_t>();
  float* c = coef.data_ptr<float>();
  float* e = has_entropy ? coef_entropy.data_ptr<float>() : nullptr;
  const float* d = has_kl ? dkl.data_ptr<float>() : nullptr;
  const float* sq_d = o[kLogRatioSq] ? sq.data_ptr<float>() : nullptr;
  const float beta = h[kKlCoef], entropy_coeff = h[kEntropyCoeff];
  // the bias-corrected KL's part through the sequence's ratio (record column 8), chained as the policy's
  const bool kl_chained = has_kl && o[kKlBiasCorrection] && sequence_level(o);
  float* w_out = o[kNormalize] != 0 ? weights.data_ptr<float>() : nullptr;
  at::parallel_for(0, N, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float kept_t = out.kept[t] ? 1.0f : 0.0f, final_length = rec[sid[t] * kRecord + 3];
      const float a = weight(kept_t, final_length, agg, per_token_loss);
      if (factors) {  // what forward_gradient_rows forms the coefficient from: a_t, the unnormalised weights
        c[t] = a;
      } else {
        if (w_out) w_out[t] = w_out[t] / factor;
        // loss._chain_through_ratio for PPO on the sequence's ratio: the sequence's mean of a_t g_t over m'
        c[t] = chained(o)
                   ? sequence_coefficient(rec[sid[t] * kRecord + 7], a, final_length, out.kept[t], factor,
                                          w_out != nullptr, d != nullptr, beta, d ? d[t] : 0.0f)
                   : token_coefficient(c[t], a, factor, w_out != nullptr, d != nullptr, beta, d ? d[t] : 0.0f);
        if (kl_chained && out.kept[t]) c[t] += (beta * a) * rec[sid[t] * kRecord + 8] / std::max(final_length, 1.0f);
        if (sq_d) c[t] += (2.0f * h[kLogRatioSqCoef] * a) * sq_d[t];  // 2 tau a_t d_t
      }
      if (e) e[t] = -entropy_coeff * (agg_entropy == agg ? a : weight(kept_t, final_length, agg_entropy,
                                                                        per_token_entropy));
    }
  });
  // factors: the loss's slot carries the batch normalisation's factor (1 without it)
  return {at::scalar_tensor(factors ? factor : loss, options_f32), lp_out, coef, coef_entropy, weights, kept};
}

// The gradient formed in the forward (SPEC §2.4), a row at a time: the row's statistics (row_statistics), the
// token's coefficient from its log-prob and the stage's factors (ppo_term, kl_and_grad, token_coefficient: the
// stage's own compiled copies), then dlogits (row_gradient) from the row while it is still in cache. The same bits
// as the two-pass form's statistics, coefficients and gradient.
struct StageFactors {
  const bool* mask;
  const float *adv, *proximal, *ref, *a, *weights, *coef_entropy;  // nullptr where the options have none
  float factor;
};

template <typename T>
void forward_gradient_rows(const T* logits, int64_t stride, T* out, int64_t out_stride, const int64_t* labels,
                           int64_t N, int64_t V, float temperature, const float* inv_t_rows, float* logprobs,
                           float* entropy, const StageFactors& f, const int64_t* o, const float* h) {
  using namespace stage;
  const float inv_t_all = 1.0f / temperature;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(std::is_same_v<T, float> ? 0 : V);
    std::vector<float> grad(std::is_same_v<T, float> ? 0 : V);
    for (int64_t r = begin; r < end; ++r) {
      const float inv_t = inv_t_rows != nullptr ? inv_t_rows[r] : inv_t_all;
      const int64_t y = labels[r];
      const bool has_target = y >= 0 && y < V;
      T* row_out = out + r * out_stride;
      const float* z = has_target ? row_as_float(logits + r * stride, V, buffer) : nullptr;
      RowStatistics st;
      if (has_target) st = row_statistics(z, V, y, inv_t, entropy != nullptr);
      logprobs[r] = st.lp;
      if (entropy != nullptr) entropy[r] = st.h;
      // the token's coefficients, as the stage forms them from its inputs on the mask
      const bool m = f.mask[r];
      const float lp = m ? st.lp : 0.0f, adv = on_mask(f.adv, r, m);
      const float l_old = o[kProximal] != 0 ? on_mask(f.proximal, r, m) : lp;
      float term, g;
      ppo_term(lp, l_old, adv, o[kWeighted] ? f.weights[r] : 0.0f, o, h, term, g);
      float kl = 0.0f, dkl = 0.0f;
      if (o[kKlType] != 0) kl_and_grad(lp, on_mask(f.ref, r, m), o[kKlType], o[kKlStraight], kl, dkl);
      const float coef = token_coefficient(g, f.a[r], f.factor, o[kNormalize] != 0, o[kKlType] != 0, h[kKlCoef], dkl);
      // dlogits, as grad_rows forms them from the coefficients autograd hands it
      const float c = has_target ? coef * inv_t : 0.0f;
      const float e = has_target && f.coef_entropy != nullptr ? f.coef_entropy[r] * inv_t : 0.0f;
      if (!has_target || (c == 0.f && e == 0.f)) {
        std::fill(row_out, row_out + V, T(0));
        continue;
      }
      float* gr = std::is_same_v<T, float> ? reinterpret_cast<float*>(row_out) : grad.data();
      row_gradient(z, gr, V, y, st.max, st.ln, inv_t, c, 0.f, e, f.coef_entropy != nullptr ? st.h : 0.f);
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t j = 0; j < V; ++j) row_out[j] = static_cast<T>(gr[j]);
      }
    }
  });
}

// Returns (logprobs, entropy or [0]); dlogits written into `out` (like logits, unit stride along V).
std::vector<at::Tensor> forward_gradient(const at::Tensor& logits, const at::Tensor& labels, double temperature,
                                         const std::optional<at::Tensor>& inv_temperature, const at::Tensor& out,
                                         const at::Tensor& mask, const at::Tensor& advantages,
                                         const std::optional<at::Tensor>& proximal,
                                         const std::optional<at::Tensor>& ref, const at::Tensor& a,
                                         const std::optional<at::Tensor>& weights, double factor,
                                         const std::optional<at::Tensor>& coef_entropy, at::IntArrayRef options,
                                         at::ArrayRef<double> hyper, bool compute_entropy) {
  using namespace stage;
  const char* op = "forward_gradient";
  check_rows(op, logits, labels);
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(options.size() == kOptionCount && hyper.size() == kHyperCount, op, ": expected ",
              std::to_string(kOptionCount), " option codes and ", std::to_string(kHyperCount), " hyperparameters");
  TORCH_CHECK(out.scalar_type() == logits.scalar_type() && out.sizes() == logits.sizes() &&
                  (out.stride(1) == 1 || V <= 1 || out.numel() == 0),
              op, ": out must be like logits with unit stride along V");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.numel() == N, op,
              ": mask must be contiguous bool [N]");
  auto optional = [&](const std::optional<at::Tensor>& t, const char* name) -> const float* {
    return t.has_value() ? f32(*t, op, name, N) : nullptr;
  };
  const int64_t* o = options.data();
  TORCH_CHECK(!(o[kProximal] != 0 && !proximal.has_value()) && !(o[kKlType] != 0 && !ref.has_value()) &&
                  !(o[kWeighted] && !weights.has_value()),
              op, ": the options read an input that is absent");
  float h[kHyperCount];
  for (int i = 0; i < kHyperCount; ++i) h[i] = static_cast<float>(hyper[i]);
  const StageFactors f{mask.data_ptr<bool>(), f32(advantages, op, "advantages", N), optional(proximal, "proximal"),
                       optional(ref, "ref"), f32(a, op, "a", N), optional(weights, "weights"),
                       optional(coef_entropy, "coef_entropy"), static_cast<float>(factor)};
  const auto opts = logits.options().dtype(at::kFloat);
  at::Tensor logprobs = at::empty({N}, opts), entropy = at::empty({compute_entropy ? N : 0}, opts);
  at::Tensor dlogits = out;
  dispatch(op, logits, [&](auto tag) {
    using T = decltype(tag);
    forward_gradient_rows<T>(logits.data_ptr<T>(), logits.stride(0), dlogits.data_ptr<T>(), dlogits.stride(0),
                             labels.data_ptr<int64_t>(), N, V, static_cast<float>(temperature),
                             inverse_temperatures(inv_temperature, op, N), logprobs.data_ptr<float>(),
                             compute_entropy ? entropy.data_ptr<float>() : nullptr, f, o, h);
  });
  return {logprobs, entropy};
}

}  // namespace

// The same schemas as the CUDA extension's ops (csrc/bindings.cpp), in their own namespace; sequence_stage is the
// CPU's alone (the GPU's is Triton).
TORCH_LIBRARY(rlkernels_cpu, m) {
  m.def("token_stats_fwd(Tensor logits, Tensor labels, float temperature, bool compute_entropy, "
        "bool compute_sum_pi_squared, Tensor? inv_temperature=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("token_grad_bwd(Tensor logits, Tensor labels, Tensor row_max, Tensor log_norm, Tensor? entropy, "
        "Tensor coef_logprob, Tensor? coef_entropy, float temperature, Tensor? inv_temperature=None) -> Tensor");
  m.def("token_grad_bwd_inplace(Tensor(a!) logits, Tensor labels, Tensor row_max, Tensor log_norm, "
        "Tensor? entropy, Tensor coef_logprob, Tensor? coef_entropy, float temperature, "
        "Tensor? inv_temperature=None) -> ()");
  m.def("token_grad_bwd_out(Tensor logits, Tensor labels, Tensor row_max, Tensor log_norm, Tensor? entropy, "
        "Tensor coef_logprob, Tensor? coef_entropy, float temperature, Tensor(a!) dlogits, "
        "Tensor? inv_temperature=None) -> ()");
  m.def("head_logprobs_fwd(Tensor logits, Tensor labels, Tensor head_ids, Tensor row_max, Tensor log_norm, "
        "float temperature, Tensor? inv_temperature=None) -> Tensor");
  m.def("head_grad_bwd_out(Tensor logits, Tensor labels, Tensor row_max, Tensor log_norm, Tensor? entropy, "
        "Tensor coef_logprob, Tensor? coef_entropy, Tensor head_ids, Tensor head_coef, float temperature, "
        "Tensor(a!) dlogits, Tensor? inv_temperature=None) -> ()");
  m.def("full_divergences_fwd(Tensor logits, Tensor reference, Tensor active, float temperature, "
        "float reference_temperature, Tensor? inv_temperature=None, Tensor? inv_reference_temperature=None) "
        "-> Tensor");
  m.def("full_divergences_bwd(Tensor logits, Tensor reference, Tensor stats, Tensor coef, float temperature, "
        "float reference_temperature, Tensor? inv_temperature=None, Tensor? inv_reference_temperature=None) "
        "-> Tensor");
  m.def("sequence_stage(Tensor lp, Tensor? entropy, Tensor advantages, Tensor mask, Tensor? old, Tensor? rollout, "
        "Tensor? ref, Tensor? is_weights, Tensor? cu_seqlens, Tensor seq_id, int seq_len, int num_seqs, "
        "int[] options, float[] hyper, bool factors=False) -> Tensor[]");
  m.def("forward_gradient(Tensor logits, Tensor labels, float temperature, Tensor? inv_temperature, "
        "Tensor(a!) out, Tensor mask, Tensor advantages, Tensor? proximal, Tensor? ref, Tensor a, Tensor? weights, "
        "float factor, Tensor? coef_entropy, int[] options, float[] hyper, bool compute_entropy) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(rlkernels_cpu, CPU, m) {
  m.impl("token_stats_fwd", &token_stats_fwd);
  m.impl("token_grad_bwd", &token_grad_bwd);
  m.impl("token_grad_bwd_inplace", &token_grad_bwd_inplace);
  m.impl("token_grad_bwd_out", &token_grad_bwd_out);
  m.impl("head_logprobs_fwd", &head_logprobs_fwd);
  m.impl("head_grad_bwd_out", &head_grad_bwd_out);
  m.impl("full_divergences_fwd", &full_divergences_fwd);
  m.impl("full_divergences_bwd", &full_divergences_bwd);
  m.impl("sequence_stage", &sequence_stage);
  m.impl("forward_gradient", &forward_gradient);
}

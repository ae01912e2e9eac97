// The two vocabulary passes (SPEC §2) on the CPU: one parallel loop over rows per pass.
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

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// exp(x) for x <= 0 (and NaN, which it returns): 2^n * exp(r), x = n ln2 + r, |r| <= ln2 / 2.
RLK_ALWAYS_INLINE float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.0f);  // NaN stays NaN (std::max returns its first argument)
  // round to nearest by the 1.5 * 2^23 trick (|x log2 e| < 2^22): plain adds, which vectorise
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = std::fma(n, -0.693145751953125f, std::fma(n, -1.428606765330187e-06f, xc));
  float p = 1.98412698e-4f;  // 1/7!
  p = std::fma(p, r, 1.38888889e-3f);
  p = std::fma(p, r, 8.33333333e-3f);
  p = std::fma(p, r, 4.16666667e-2f);
  p = std::fma(p, r, 1.66666667e-1f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
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

template <typename T>
void stats_rows(const T* logits, int64_t stride, const int64_t* labels, int64_t N, int64_t V, float temperature,
                const float* inv_t_rows, float* row_max, float* log_norm, float* logprobs, float* entropy,
                float* sum_sq) {
  const float inv_t_all = 1.0f / temperature;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(std::is_same_v<T, float> ? 0 : V);
    for (int64_t r = begin; r < end; ++r) {
      const float inv_t = inv_t_rows != nullptr ? inv_t_rows[r] : inv_t_all;  // a per-token temperature
      const int64_t y = labels[r];
      const bool has_target = y >= 0 && y < V;
      float out_max = 0.f, out_ln = 0.f, out_lp = 0.f, out_h = 0.f, out_s2 = 0.f;
      if (has_target || y == kForeignTarget) {
        const float* z = row_as_float(logits + r * stride, V, buffer);
        const float m = row_max_of(z, V);
        if (m == -kInf) {  // no finite logit: no distribution
          out_ln = -kInf;
          out_lp = has_target ? -kInf : 0.f;
        } else {
          // kLanes partial sums over blocks of kBlock elements, each block's total added in
          // float64: the float32 error grows with kBlock / kLanes terms, not V / kLanes
          double s1 = 0.0, sx = 0.0, s2 = 0.0;
          const bool more = entropy != nullptr || sum_sq != nullptr;
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
      }
      row_max[r] = out_max;
      log_norm[r] = out_ln;
      logprobs[r] = out_lp;
      if (entropy != nullptr) entropy[r] = out_h;
      if (sum_sq != nullptr) sum_sq[r] = out_s2;
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

template <typename T>
void grad_rows(const T* logits, int64_t stride, T* out, int64_t out_stride, const int64_t* labels,
               const float* row_max, const float* log_norm, const float* entropy, const float* coef_logprob,
               const float* coef_entropy, int64_t N, int64_t V, float temperature, const float* inv_t_rows) {
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
      T* o = out + r * out_stride;
      if ((!has_target && y != kForeignTarget) || (c == 0.f && e == 0.f)) {
        std::fill(o, o + V, T(0));  // skipped or zero coefficients: written, never read
        continue;
      }
      const float* z = row_as_float(logits + r * stride, V, buffer);
      float* g = std::is_same_v<T, float> ? reinterpret_cast<float*>(o) : grad.data();
      const float ln = log_norm[r];
      const float m = row_max[r];
      if (ln == -kInf) {  // no distribution: p = 0 everywhere
        std::fill(g, g + V, 0.f);
      } else {
        grad_row(z, g, V, m, inv_t, ln, c + e * (entropy != nullptr ? entropy[r] : 0.f), e);
      }
      if (has_target) g[y] += c;  // the target column in float32, rounded once below
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t j = 0; j < V; ++j) o[j] = static_cast<T>(g[j]);
      }
    }
  });
}

void check_rows(const char* op, const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.device().is_cpu(), op, ": logits must be on the CPU");
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be [N, V], got ", logits.dim(), " dims");
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
                 const std::optional<at::Tensor>& inv_temperature) {
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
                 inverse_temperatures(inv_temperature, op, N));
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

}  // namespace

// The same schemas as the CUDA extension's ops (csrc/bindings.cpp), in their own namespace.
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
}

TORCH_LIBRARY_IMPL(rlkernels_cpu, CPU, m) {
  m.impl("token_stats_fwd", &token_stats_fwd);
  m.impl("token_grad_bwd", &token_grad_bwd);
  m.impl("token_grad_bwd_inplace", &token_grad_bwd_inplace);
  m.impl("token_grad_bwd_out", &token_grad_bwd_out);
}

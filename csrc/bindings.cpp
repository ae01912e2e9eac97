// Op schemas and every input check of the CUDA backend; no math (the kernels are in the .cu files).
//
// Ops live in the `rlkernels_cuda` namespace (the Triton side may use `rlkernels`):
//   torch.ops.rlkernels_cuda.token_stats_fwd   (SPEC §2 forward: row_max, log_norm, logprob, entropy, sum p^2)
//   torch.ops.rlkernels_cuda.token_grad_bwd    (SPEC §2 backward into a new tensor)
//   torch.ops.rlkernels_cuda.token_grad_bwd_inplace   (the same, written into the logits)
// Their fake (meta) implementations are registered in rlkernels/backends/cuda_backend.py.
// Only device-agnostic torch headers are used: the current CUDA stream comes through the device
// guard interface, so this file compiles against any torch wheel (CPU ones included).
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "common.cuh"

namespace rlkernels {
namespace {

// The numbers in a check's message are formatted here (snprintf, to_string) and reach TORCH_CHECK as strings,
// never streamed: on the lent H200's image (torch 2.11, the extension built by its /opt/gcc g++), a check that
// streamed a double or an integer killed the process with SIGSEGV, while one that streamed only names raised
// (2026-12-04: temperature 0 and column-strided logits crashed; int32 labels and float64 logits raised). The
// cause is not established: the locale's number formatting of a libstdc++ other than the headers' is the
// likely one. Devices likewise: their names, not Device's operator<<.
std::string text(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", value);
  return buffer;
}

std::string text(int64_t value) { return std::to_string(value); }

std::string text(at::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

std::string text(const c10::Device& device) {
  std::string out = c10::DeviceTypeName(device.type(), /*lower_case=*/true);
  return device.has_index() ? out + ":" + std::to_string(static_cast<int>(device.index())) : out;
}

void check_logits(const char* op, const at::Tensor& logits) {
  TORCH_CHECK(logits.is_cuda(), op, ": logits must be a CUDA tensor, got device ", text(logits.device()));
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be 2-D [N, V], got shape ", text(logits.sizes()));
  const auto dt = logits.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op,
              ": logits must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(logits.size(1) <= 1 || logits.stride(1) == 1, op,
              ": logits must have unit stride along V (dim 1), got strides ", text(logits.strides()));
  TORCH_CHECK(logits.size(0) <= std::numeric_limits<int32_t>::max(), op,
              ": logits has more than 2^31 - 1 rows: ", text(logits.size(0)));
}

void check_row_vector(const char* op, const char* name, const at::Tensor& t, const at::Tensor& logits,
                      at::ScalarType dtype) {
  TORCH_CHECK(t.device() == logits.device(), op, ": ", name, " must be on the logits' device ",
              text(logits.device()), ", got ", text(t.device()));
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == logits.size(0), op, ": ", name, " must have shape [N] = [",
              text(logits.size(0)), "], got ", text(t.sizes()));
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_temperature(const char* op, double temperature) {
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0, op, ": temperature must be a finite float > 0, got ",
              text(temperature));
}

// [N] float32 1 / T per row on the logits' device, or null for one temperature
const float* inverse_temperatures(const char* op, const std::optional<at::Tensor>& inv_t, const at::Tensor& logits) {
  if (!inv_t.has_value()) return nullptr;
  check_row_vector(op, "inv_temperature", *inv_t, logits, at::kFloat);
  return inv_t->data_ptr<float>();
}

LogitsDtype logits_dtype(const at::Tensor& logits) {
  switch (logits.scalar_type()) {
    case at::kHalf:
      return LogitsDtype::kFloat16;
    case at::kBFloat16:
      return LogitsDtype::kBFloat16;
    default:
      return LogitsDtype::kFloat32;
  }
}

void* current_stream(const at::Tensor& t) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device()).native_handle();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_stats_fwd(
    const at::Tensor& logits, const at::Tensor& labels, double temperature, bool compute_entropy,
    bool compute_sum_pi_squared, const std::optional<at::Tensor>& inv_temperature) {
  constexpr const char* op = "rlkernels_cuda::token_stats_fwd";
  check_logits(op, logits);
  check_row_vector(op, "labels", labels, logits, at::kLong);
  check_temperature(op, temperature);
  const c10::DeviceGuard guard(logits.device());
  const int64_t N = logits.size(0);
  const auto opts = logits.options().dtype(at::kFloat);
  at::Tensor row_max = at::empty({N}, opts);
  at::Tensor log_norm = at::empty({N}, opts);
  at::Tensor logprobs = at::empty({N}, opts);
  at::Tensor entropy = at::empty({compute_entropy ? N : 0}, opts);
  at::Tensor sum_pi_squared = at::empty({compute_sum_pi_squared ? N : 0}, opts);
  const char* err = token_stats_fwd_launch(
      logits.data_ptr(), labels.data_ptr<int64_t>(), row_max.data_ptr<float>(), log_norm.data_ptr<float>(),
      logprobs.data_ptr<float>(),
      compute_entropy ? entropy.data_ptr<float>() : nullptr,
      compute_sum_pi_squared ? sum_pi_squared.data_ptr<float>() : nullptr, N, logits.size(1), logits.stride(0),
      temperature, inverse_temperatures(op, inv_temperature, logits), logits_dtype(logits), current_stream(logits));
  TORCH_CHECK(err == nullptr, op, ": kernel launch failed: ", err);
  return {row_max, log_norm, logprobs, entropy, sum_pi_squared};
}

void check_grad_inputs(const char* op, const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_max,
                       const at::Tensor& log_norm,
                       const std::optional<at::Tensor>& entropy, const at::Tensor& coef_logprob,
                       const std::optional<at::Tensor>& coef_entropy, double temperature) {
  check_logits(op, logits);
  check_row_vector(op, "labels", labels, logits, at::kLong);
  check_row_vector(op, "row_max", row_max, logits, at::kFloat);
  check_row_vector(op, "log_norm", log_norm, logits, at::kFloat);
  check_row_vector(op, "coef_logprob", coef_logprob, logits, at::kFloat);
  if (coef_entropy.has_value()) {
    TORCH_CHECK(entropy.has_value(), op, ": entropy is required when coef_entropy is given");
    check_row_vector(op, "coef_entropy", *coef_entropy, logits, at::kFloat);
    check_row_vector(op, "entropy", *entropy, logits, at::kFloat);
  }
  check_temperature(op, temperature);
}

const char* launch_grad(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_max,
                        const at::Tensor& log_norm,
                        const std::optional<at::Tensor>& entropy, const at::Tensor& coef_logprob,
                        const std::optional<at::Tensor>& coef_entropy, double temperature, at::Tensor& dlogits,
                        const float* inv_t_rows) {
  const bool has_entropy = coef_entropy.has_value();
  return token_grad_bwd_launch(
      logits.data_ptr(), labels.data_ptr<int64_t>(), row_max.data_ptr<float>(), log_norm.data_ptr<float>(),
      has_entropy ? entropy->data_ptr<float>() : nullptr, coef_logprob.data_ptr<float>(),
      has_entropy ? coef_entropy->data_ptr<float>() : nullptr, dlogits.data_ptr(), logits.size(0), logits.size(1),
      logits.stride(0), dlogits.stride(0), temperature, inv_t_rows, logits_dtype(logits), current_stream(logits));
}

at::Tensor token_grad_bwd(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_max,
                          const at::Tensor& log_norm,
                          const std::optional<at::Tensor>& entropy, const at::Tensor& coef_logprob,
                          const std::optional<at::Tensor>& coef_entropy, double temperature,
                          const std::optional<at::Tensor>& inv_temperature) {
  constexpr const char* op = "rlkernels_cuda::token_grad_bwd";
  check_grad_inputs(op, logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature);
  const c10::DeviceGuard guard(logits.device());
  at::Tensor dlogits = at::empty({logits.size(0), logits.size(1)}, logits.options());
  const char* err = launch_grad(logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, dlogits,
                                inverse_temperatures(op, inv_temperature, logits));
  TORCH_CHECK(err == nullptr, op, ": kernel launch failed: ", err);
  return dlogits;
}

void token_grad_bwd_inplace(at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_max,
                            const at::Tensor& log_norm,
                            const std::optional<at::Tensor>& entropy, const at::Tensor& coef_logprob,
                            const std::optional<at::Tensor>& coef_entropy, double temperature,
                            const std::optional<at::Tensor>& inv_temperature) {
  constexpr const char* op = "rlkernels_cuda::token_grad_bwd_inplace";
  check_grad_inputs(op, logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature);
  // overlapping rows (stride 0 from expand) would be written by several blocks at once
  TORCH_CHECK(logits.size(0) <= 1 || logits.stride(0) >= logits.size(1), op,
              ": in place needs non-overlapping rows, got strides ", text(logits.strides()), " for shape ",
              text(logits.sizes()));
  const c10::DeviceGuard guard(logits.device());
  const char* err = launch_grad(logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, logits,
                                inverse_temperatures(op, inv_temperature, logits));
  TORCH_CHECK(err == nullptr, op, ": kernel launch failed: ", err);
}

void token_grad_bwd_out(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& row_max,
                        const at::Tensor& log_norm,
                        const std::optional<at::Tensor>& entropy, const at::Tensor& coef_logprob,
                        const std::optional<at::Tensor>& coef_entropy, double temperature, at::Tensor& dlogits,
                        const std::optional<at::Tensor>& inv_temperature) {
  // writes into a caller's [N, V] buffer (a row-strided slice of a larger gradient)
  constexpr const char* op = "rlkernels_cuda::token_grad_bwd_out";
  check_grad_inputs(op, logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature);
  TORCH_CHECK(dlogits.device() == logits.device() && dlogits.scalar_type() == logits.scalar_type(), op,
              ": dlogits must match the logits' device and dtype, got ", text(dlogits.device()), " ",
              dlogits.scalar_type());
  TORCH_CHECK(dlogits.dim() == 2 && dlogits.sizes() == logits.sizes() && dlogits.stride(1) == 1, op,
              ": dlogits must be [N, V] = ", text(logits.sizes()), " with unit stride along V, got ",
              text(dlogits.sizes()), " strides ", text(dlogits.strides()));
  TORCH_CHECK(dlogits.size(0) <= 1 || dlogits.stride(0) >= dlogits.size(1), op,
              ": dlogits rows must not overlap, got strides ", text(dlogits.strides()));
  const c10::DeviceGuard guard(logits.device());
  const char* err = launch_grad(logits, labels, row_max, log_norm, entropy, coef_logprob, coef_entropy, temperature, dlogits,
                                inverse_temperatures(op, inv_temperature, logits));
  TORCH_CHECK(err == nullptr, op, ": kernel launch failed: ", err);
}

}  // namespace
}  // namespace rlkernels

TORCH_LIBRARY(rlkernels_cuda, m) {
  m.def(
      "token_stats_fwd(Tensor logits, Tensor labels, float temperature, bool compute_entropy, "
      "bool compute_sum_pi_squared, Tensor? inv_temperature=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "token_grad_bwd(Tensor logits, Tensor labels, Tensor row_max, Tensor log_norm, Tensor? entropy, "
      "Tensor coef_logprob, Tensor? coef_entropy, float temperature, Tensor? inv_temperature=None) -> Tensor");
  m.def(
      "token_grad_bwd_inplace(Tensor(a!) logits, Tensor labels, Tensor row_max, Tensor log_norm, "
      "Tensor? entropy, Tensor coef_logprob, Tensor? coef_entropy, float temperature, "
      "Tensor? inv_temperature=None) -> ()");
  m.def(
      "token_grad_bwd_out(Tensor logits, Tensor labels, Tensor row_max, Tensor log_norm, Tensor? entropy, "
      "Tensor coef_logprob, Tensor? coef_entropy, float temperature, Tensor(a!) dlogits, "
      "Tensor? inv_temperature=None) -> ()");
}

TORCH_LIBRARY_IMPL(rlkernels_cuda, CUDA, m) {
  m.impl("token_stats_fwd", &rlkernels::token_stats_fwd);
  m.impl("token_grad_bwd", &rlkernels::token_grad_bwd);
  m.impl("token_grad_bwd_inplace", &rlkernels::token_grad_bwd_inplace);
  m.impl("token_grad_bwd_out", &rlkernels::token_grad_bwd_out);
}

// `import rlkernels._C` loads the library, which runs the registrations above; the Python module
// itself is empty (no pybind11, which would pull in <torch/extension.h>).
#define RLK_CONCAT_(a, b) a##b
#define RLK_CONCAT(a, b) RLK_CONCAT_(a, b)
#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif

extern "C" PyMODINIT_FUNC RLK_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}

#include "reference/reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "formats/codec.hpp"
#include "math/expert_row.hpp"
#include "math/quantize.hpp"

namespace epmoe::reference {
namespace {

std::vector<float> to_float(const std::uint16_t* bf16, std::size_t n) {
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = formats::bf16_to_float(bf16[i]);
  return out;
}

}  // namespace

struct ReferenceModel::Expert {
  std::vector<float> w13;
  std::vector<float> w2;
};

ReferenceModel::ReferenceModel(const LayerShape& shape, Precision precision,
                               const LayerOptions& options, const LayerWeights& weights)
    : shape_(shape),
      precision_(precision),
      options_(options),
      weights_(weights),
      experts_(static_cast<std::size_t>(shape.num_experts)),
      prepared_(std::make_unique<std::once_flag[]>(static_cast<std::size_t>(shape.num_experts))) {}

ReferenceModel::~ReferenceModel() = default;

const ReferenceModel::Expert& ReferenceModel::expert(std::int64_t e) {
  auto& slot = experts_[static_cast<std::size_t>(e)];
  std::call_once(prepared_[static_cast<std::size_t>(e)], [&] {
    const auto h = static_cast<std::size_t>(shape_.hidden);
    const auto inter = static_cast<std::size_t>(shape_.intermediate);
    const auto w13 =
        to_float(weights_.w13.data() + static_cast<std::size_t>(e) * 2 * inter * h, 2 * inter * h);
    const auto w2 =
        to_float(weights_.w2.data() + static_cast<std::size_t>(e) * h * inter, h * inter);
    const ScaleRounding r = options_.mxfp8_scale_rounding;
    auto ex = std::make_unique<Expert>();
    ex->w13 = math::emulate_weight_matrix(w13.data(), 2 * shape_.intermediate, shape_.hidden,
                                          precision_, r);
    ex->w2 =
        math::emulate_weight_matrix(w2.data(), shape_.hidden, shape_.intermediate, precision_, r);
    slot = std::move(ex);
  });
  return *slot;
}

const float* ReferenceModel::bias_b13(std::int64_t e) const {
  return weights_.b13.empty()
             ? nullptr
             : weights_.b13.data() + static_cast<std::size_t>(e * 2 * shape_.intermediate);
}

const float* ReferenceModel::bias_b2(std::int64_t e) const {
  return weights_.b2.empty() ? nullptr
                             : weights_.b2.data() + static_cast<std::size_t>(e * shape_.hidden);
}

std::vector<std::uint16_t> ReferenceModel::forward(const Batch& batch) {
  const auto h = static_cast<std::size_t>(shape_.hidden);
  const auto k = static_cast<std::size_t>(shape_.top_k);
  const auto tokens = static_cast<std::size_t>(batch.tokens);
  std::vector<std::uint16_t> y(tokens * h);
  std::vector<float> x(h), row(h), acc(h), scratch;
  for (std::size_t t = 0; t < tokens; ++t) {
    for (std::size_t i = 0; i < h; ++i) x[i] = formats::bf16_to_float(batch.x[t * h + i]);
    math::emulate_activation_row(x.data(), shape_.hidden, precision_,
                                 options_.mxfp8_scale_rounding);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::size_t s = 0; s < k; ++s) {
      const std::int32_t e = batch.topk_ids[t * k + s];
      if (e < 0) continue;
      const Expert& ex = expert(e);
      const math::ExpertMatrices m{ex.w13.data(), ex.w2.data(), bias_b13(e), bias_b2(e)};
      math::expert_forward_row(x.data(), m, shape_, precision_, options_, row.data(), scratch);
      const float w = batch.topk_weights[t * k + s];
      const bool staged = options_.combine == Combine::staged;
      for (std::size_t i = 0; i < h; ++i)
        acc[i] += w * (staged ? formats::round_to_bf16(row[i]) : row[i]);
    }
    for (std::size_t i = 0; i < h; ++i) y[t * h + i] = formats::float_to_bf16(acc[i]);
  }
  return y;
}

std::vector<double> ReferenceModel::forward_exact(const Batch& batch) const {
  const auto h = static_cast<std::size_t>(shape_.hidden);
  const auto inter = static_cast<std::size_t>(shape_.intermediate);
  const auto k = static_cast<std::size_t>(shape_.top_k);
  const auto tokens = static_cast<std::size_t>(batch.tokens);
  std::vector<double> y(tokens * h, 0.0), act(inter);
  for (std::size_t t = 0; t < tokens; ++t) {
    const std::uint16_t* x = batch.x.data() + t * h;
    for (std::size_t s = 0; s < k; ++s) {
      const std::int32_t e = batch.topk_ids[t * k + s];
      if (e < 0) continue;
      const std::uint16_t* w13 = weights_.w13.data() + static_cast<std::size_t>(e) * 2 * inter * h;
      const std::uint16_t* w2 = weights_.w2.data() + static_cast<std::size_t>(e) * h * inter;
      const float* b13 = bias_b13(e);
      const float* b2 = bias_b2(e);
      for (std::size_t j = 0; j < inter; ++j) {
        double gate = b13 ? b13[j] : 0.0, up = b13 ? b13[inter + j] : 0.0;
        for (std::size_t i = 0; i < h; ++i) {
          const double xi = formats::bf16_to_float(x[i]);
          gate += xi * formats::bf16_to_float(w13[j * h + i]);
          up += xi * formats::bf16_to_float(w13[(inter + j) * h + i]);
        }
        act[j] = math::activation(options_.activation, gate, up, options_.swiglu_limit);
      }
      const double w = batch.topk_weights[t * k + s];
      for (std::size_t n = 0; n < h; ++n) {
        double acc = b2 ? b2[n] : 0.0;
        for (std::size_t j = 0; j < inter; ++j)
          acc += act[j] * formats::bf16_to_float(w2[n * inter + j]);
        y[t * h + n] += w * acc;
      }
    }
  }
  return y;
}

namespace {

template <class Ref, class Mismatch>
ErrorStats compare_impl(const std::vector<std::uint16_t>& y, const std::vector<Ref>& ref,
                        Mismatch&& mismatch) {
  ErrorStats s;
  double diff2 = 0.0, ref2 = 0.0;
  for (std::size_t i = 0; i < y.size() && i < ref.size(); ++i) {
    const double a = formats::bf16_to_float(y[i]);
    const double b = static_cast<double>(ref[i]);
    // Equal values (Inf == Inf, NaN in both) differ by nothing; NaN against anything else
    // propagates into the report. Only finite reference values count towards ||ref||.
    const double d = a == b || (std::isnan(a) && std::isnan(b)) ? 0.0 : std::fabs(a - b);
    if (!(d <= s.max_abs)) s.max_abs = d;
    diff2 += d * d;
    if (std::isfinite(b)) ref2 += b * b;
    if (mismatch(a, b)) ++s.mismatches;
  }
  if (y.size() != ref.size()) s.mismatches += 1;
  s.rel_l2 = ref2 > 0.0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  return s;
}

double as_double(std::uint16_t b) {
  return formats::bf16_to_float(b);
}

}  // namespace

ErrorStats compare_bf16(const std::vector<std::uint16_t>& y,
                        const std::vector<std::uint16_t>& ref) {
  std::vector<double> r(ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) r[i] = as_double(ref[i]);
  ErrorStats s = compare_impl(y, r, [](double, double) { return false; });
  s.mismatches = 0;
  for (std::size_t i = 0; i < y.size() && i < ref.size(); ++i) {
    const bool both_nan = std::isnan(as_double(y[i])) && std::isnan(as_double(ref[i]));
    if (y[i] != ref[i] && !both_nan) ++s.mismatches;
  }
  if (y.size() != ref.size()) s.mismatches += 1;
  return s;
}

ErrorStats compare_exact(const std::vector<std::uint16_t>& y, const std::vector<double>& ref) {
  return compare_impl(y, ref, [](double, double) { return false; });
}

ErrorStats compare_bf16_tolerant(const std::vector<std::uint16_t>& y,
                                 const std::vector<std::uint16_t>& ref, int ulps,
                                 double abs_floor) {
  std::vector<double> r(ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) r[i] = as_double(ref[i]);
  return compare_impl(y, r, [&](double a, double b) {
    if (a == b || (std::isnan(a) && std::isnan(b))) return false;  // also Inf == Inf
    if (!std::isfinite(a) || !std::isfinite(b)) return true;       // an ulp of Inf is no bound
    const double mag = std::max(std::fabs(a), std::fabs(b));
    const double ulp = mag > 0 ? std::ldexp(1.0, std::ilogb(mag) - 7) : 0.0;
    return !(std::fabs(a - b) <= ulps * ulp + abs_floor);
  });
}

double fp8_gemm_max_rel_l2(std::int64_t intermediate) {
  if (intermediate <= 0) return kFp8GemmMaxRelL2;
  return std::max(kFp8GemmMaxRelL2, 2.0 * 0.125 / std::sqrt(static_cast<double>(intermediate)));
}

double bf16_gemm_rms_floor(std::int64_t intermediate) {
  if (intermediate <= 0) return kTensorCoreRmsFloor;
  return std::max(kTensorCoreRmsFloor, 0.03125 / std::sqrt(static_cast<double>(intermediate)));
}

namespace {

// A bound that scales with I as a rule's text: `flat_text` while it is the flat one.
std::string bound_text(double bound, double flat, const char* flat_text) {
  if (bound == flat) return flat_text;
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", bound);
  return text;
}

}  // namespace

std::string output_rule(Combine combine, ExpertMath math, Precision precision,
                        std::int64_t intermediate) {
  static_assert(kTensorCoreMaxRelL2 == 4e-3 && kTensorCoreOutlierFraction == 1e-3 &&
                kWgmmaOutlierFraction == 1e-2 && kTensorCoreUlps == 2 &&
                kTensorCoreRmsFloor == 1e-3 && kInKernelReduceUlps == 1 && kAbsFloor == 1e-6 &&
                kFp8GemmMaxRelL2 == 1e-2);
  if (fp8_gemm(math, precision)) {
    return std::string("wgmma on E4M3 (") + to_string(precision) + "): rel_l2 <= " +
           bound_text(fp8_gemm_max_rel_l2(intermediate), kFp8GemmMaxRelL2, "1e-2");
  }
  if (math != ExpertMath::exact) {
    return std::string(to_string(math)) + ": rel_l2 <= 4e-3 and at most max(1, " +
           (math == ExpertMath::wgmma ? "1%" : "0.1%") +
           ") of the elements beyond 2 bf16 ulps + max(1e-6, " +
           bound_text(bf16_gemm_rms_floor(intermediate), kTensorCoreRmsFloor, "1e-3") +
           " x rms(ref))";
  }
  return combine == Combine::staged ? "staged: bit-exact"
                                    : "in_kernel_reduce: within 1 bf16 ulp + 1e-6";
}

OutputCheck check_output(const std::vector<std::uint16_t>& y, const std::vector<std::uint16_t>& ref,
                         Combine combine, ExpertMath math, Precision precision,
                         std::int64_t intermediate) {
  OutputCheck c;
  c.rule = output_rule(combine, math, precision, intermediate);
  double sum_sq = 0.0;
  std::int64_t finite = 0;
  for (const std::uint16_t r : ref)
    if (const double v = formats::bf16_to_float(r); std::isfinite(v)) {
      sum_sq += v * v;
      ++finite;
    }
  c.ref_rms = finite > 0 ? std::sqrt(sum_sq / static_cast<double>(finite)) : 0.0;
  if (fp8_gemm(math, precision)) {
    c.stats = compare_bf16_tolerant(y, ref, kTensorCoreUlps, kAbsFloor);
    c.pass = y.size() == ref.size() && c.stats.rel_l2 <= fp8_gemm_max_rel_l2(intermediate);
  } else if (math != ExpertMath::exact) {  // fp32 accumulation on tensor cores, in any order
    c.stats =
        compare_bf16_tolerant(y, ref, kTensorCoreUlps,
                              std::max(kAbsFloor, bf16_gemm_rms_floor(intermediate) * c.ref_rms));
    const auto outliers_allowed = std::max<std::int64_t>(
        1, static_cast<std::int64_t>(static_cast<double>(ref.size()) * outlier_fraction(math)));
    c.pass = y.size() == ref.size() && c.stats.rel_l2 <= kTensorCoreMaxRelL2 &&
             c.stats.mismatches <= outliers_allowed;
  } else {
    c.stats = combine == Combine::staged
                  ? compare_bf16(y, ref)
                  : compare_bf16_tolerant(y, ref, kInKernelReduceUlps, kAbsFloor);
    c.pass = c.stats.mismatches == 0;
  }
  return c;
}

}  // namespace epmoe::reference

// LayerConfig: validation of caller-owned fields, knob application, bucket choice and the
// cross-rank description (docs/design.md §5). workspace_bytes() lives with the protocol.
#include <epmoe/config.hpp>
#include <epmoe/errors.hpp>

#include "core/knob_table.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <string_view>

namespace epmoe {
namespace {

constexpr std::int64_t kDecodeMaxTokens = 16;
constexpr std::int64_t kSmallMaxTokens = 128;
constexpr std::int64_t kMediumMaxTokens = 1024;

std::string float_text(float v) {
  // Shortest text that reads back to the same float: stable, and equal iff the values are equal.
  char buf[32];
  const auto result = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, result.ptr);
}

[[noreturn]] void reject(std::string_view field, const std::string& value, std::string_view rule) {
  std::string msg;
  msg.append(field).append("=").append(value).append(": ").append(rule);
  throw Error(ErrorCode::invalid_argument, msg);
}
[[noreturn]] void reject(std::string_view field, std::int64_t value, std::string_view rule) {
  reject(field, std::to_string(value), rule);
}

void check_dim(const char* field, std::int64_t value, std::int64_t max) {
  if (value <= 0) reject(field, value, "must be > 0");
  if (value % kShapeAlignment != 0) {
    reject(field, value, "must be a multiple of " + std::to_string(kShapeAlignment));
  }
  if (value > max) reject(field, value, "must be at most " + std::to_string(max));
}

void check_shape(const LayerShape& s, int world) {
  // NOTES: multiples of 64 cover MXFP8 / MXFP4 blocks of 32, NVFP4 blocks of 16, the 64-wide k
  // tile and 16-byte vector stores of a row in every precision. fp8_block128 needs no more: its
  // 128 x 128 weight tiles (along rows, K) and 1 x 128 activation runs (along K) may be partial at
  // a matrix's edge (gpt-oss's 2880 = 22 x 128 + 64), and its fp32 scales follow H (or I) E4M3
  // bytes, a multiple of 64, so they stay 4-byte (16-byte) aligned on the wire.
  check_dim("hidden", s.hidden, kMaxHidden);
  check_dim("intermediate", s.intermediate, kMaxIntermediate);
  if (s.num_experts < 1) reject("num_experts", s.num_experts, "must be >= 1");
  if (s.num_experts > kMaxExperts) {
    reject("num_experts", s.num_experts, "must be at most " + std::to_string(kMaxExperts));
  }
  if (s.num_experts % world != 0) {
    reject("num_experts", s.num_experts, "must be a multiple of world=" + std::to_string(world));
  }
  const std::int64_t max_top_k = std::min(s.num_experts, kMaxTopK);
  if (s.top_k < 1 || s.top_k > max_top_k) {
    reject("top_k", s.top_k,
           "must be in [1, min(num_experts=" + std::to_string(s.num_experts) + ", " +
               std::to_string(kMaxTopK) + ")=" + std::to_string(max_top_k) + "]");
  }
  if (s.max_tokens_per_rank < 1 || s.max_tokens_per_rank > kMaxTokensPerRank) {
    reject("max_tokens_per_rank", s.max_tokens_per_rank,
           "must be in [1, " + std::to_string(kMaxTokensPerRank) + "]");
  }
}

void check_options(const LayerOptions& o) {
  if (o.combine != Combine::staged && o.combine != Combine::in_kernel_reduce) {
    reject("combine", static_cast<std::int64_t>(o.combine), "must be staged or in_kernel_reduce");
  }
  if (o.mxfp8_scale_rounding != ScaleRounding::rceil &&
      o.mxfp8_scale_rounding != ScaleRounding::ocp_floor) {
    reject("mxfp8_scale_rounding", static_cast<std::int64_t>(o.mxfp8_scale_rounding),
           "must be rceil or ocp_floor");
  }
  if (o.expert_math != ExpertMath::exact && o.expert_math != ExpertMath::tensor_core &&
      o.expert_math != ExpertMath::wgmma) {
    reject("expert_math", static_cast<std::int64_t>(o.expert_math),
           "must be exact, tensor_core or wgmma");
  }
  // The caller asked for two things that exclude each other: rejected, not adjusted.
  if (o.deterministic && o.combine != Combine::staged) {
    reject("deterministic", "true",
           std::string("requires combine=staged, got ") + to_string(o.combine));
  }
  if (o.activation != Activation::swiglu && o.activation != Activation::swiglu_oai) {
    reject("activation", static_cast<std::int64_t>(o.activation), "must be swiglu or swiglu_oai");
  }
  if (!std::isfinite(o.swiglu_limit) || o.swiglu_limit < 0.0f) {
    reject("swiglu_limit", float_text(o.swiglu_limit), "must be finite and >= 0 (0 = no clamp)");
  }
  if (o.activation == Activation::swiglu_oai && !(o.swiglu_limit > 0.0f)) {
    reject("swiglu_limit", float_text(o.swiglu_limit),
           "activation=swiglu_oai requires a clamp > 0 (gpt-oss uses 7)");
  }
  if (o.timeout_ms > kMaxTimeoutMs) {
    reject("timeout_ms", o.timeout_ms,
           "must be at most " + std::to_string(kMaxTimeoutMs) + " (1 hour; 0 = wait forever)");
  }
}

// docs/design.md §5: a knob exists only if the code that runs reads it (stages, which none read,
// left Knobs with epmoe.config/10). The CUDA executor reads num_sms,
// dispatch_warps and megakernel (the persistent round, or a refusal at creation where the backend
// has none) with every expert math, token_back with wgmma (the E4M3 tile's buckets run either
// mode; every other bucket, of every math, has one, which make_config and with_knobs set) and
// block_m / block_n with wgmma (bf16: both, its CUTLASS GEMMs' tiles;
// mxfp8 / nvfp4 / mxfp4: block_m, the packed-weight GEMM's token rows; fp8_block128: block_m,
// 64 its E4M3 tile, 128 its blockwise GEMM);
// the CPU executor reads none (its describe() is the same line: ranks compare configs, not
// executors).
std::string describe_knobs(const Knobs& k, ExpertMath math, Precision precision) {
  // block_m / block_n: read by the wgmma backend only (exact and tensor_core run fixed tiles):
  // both by its bf16 GEMMs, block_m by the others (the packed-weight GEMM's token rows; for
  // fp8_block128 which GEMM runs).
  std::string m_mark, n_mark;
  if (math != ExpertMath::wgmma) {
    m_mark = n_mark = std::string(" (not read by expert_math=") + to_string(math) + ")";
  } else if (precision != Precision::bf16) {
    n_mark =
        std::string(" (not read by expert_math=wgmma with precision=") + to_string(precision) + ")";
  }
  return "{" + core::knob_fields(k, m_mark, n_mark) + "}";
}

}  // namespace

std::string core::knob_fields(const Knobs& k, const std::string& block_m_mark,
                              const std::string& block_n_mark) {
  std::string s = "token_back=";
  s += to_string(k.token_back);
  s += " block_m=" + std::to_string(k.block_m) + block_m_mark;
  s += " block_n=" + std::to_string(k.block_n) + block_n_mark;
  s += " dispatch_warps=" + std::to_string(k.dispatch_warps);
  s += " num_sms=" + std::to_string(k.num_sms);
  s += k.megakernel ? " megakernel=true" : " megakernel=false";
  return s;
}

const char* to_string(Precision p) {
  switch (p) {
    case Precision::bf16:
      return "bf16";
    case Precision::mxfp8:
      return "mxfp8";
    case Precision::nvfp4:
      return "nvfp4";
    case Precision::fp8_block128:
      return "fp8_block128";
    case Precision::mxfp4:
      return "mxfp4";
  }
  return "unknown";
}

const char* to_string(Combine c) {
  switch (c) {
    case Combine::staged:
      return "staged";
    case Combine::in_kernel_reduce:
      return "in_kernel_reduce";
  }
  return "unknown";
}

const char* to_string(TokenBack t) {
  switch (t) {
    case TokenBack::epilogue_warps:
      return "epilogue_warps";
    case TokenBack::dispatch_warps:
      return "dispatch_warps";
  }
  return "unknown";
}

const char* to_string(ScaleRounding s) {
  switch (s) {
    case ScaleRounding::rceil:
      return "rceil";
    case ScaleRounding::ocp_floor:
      return "ocp_floor";
  }
  return "unknown";
}

const char* to_string(ExpertMath m) {
  switch (m) {
    case ExpertMath::exact:
      return "exact";
    case ExpertMath::tensor_core:
      return "tensor_core";
    case ExpertMath::wgmma:
      return "wgmma";
  }
  return "unknown";
}

const char* to_string(Activation a) {
  switch (a) {
    case Activation::swiglu:
      return "swiglu";
    case Activation::swiglu_oai:
      return "swiglu_oai";
  }
  return "unknown";
}

std::int64_t bucket_max_tokens(TokenBucket b) {
  switch (b) {
    case TokenBucket::decode:
      return kDecodeMaxTokens;
    case TokenBucket::small:
      return kSmallMaxTokens;
    case TokenBucket::medium:
      return kMediumMaxTokens;
    case TokenBucket::prefill:
      break;
  }
  return std::numeric_limits<std::int64_t>::max();
}

const char* to_string(TokenBucket b) {
  switch (b) {
    case TokenBucket::decode:
      return "decode";
    case TokenBucket::small:
      return "small";
    case TokenBucket::medium:
      return "medium";
    case TokenBucket::prefill:
      return "prefill";
  }
  return "unknown";
}

Precision parse_precision(const std::string& name, const char* what) {
  for (Precision p : {Precision::bf16, Precision::mxfp8, Precision::nvfp4, Precision::fp8_block128,
                      Precision::mxfp4}) {
    if (name == to_string(p)) return p;
  }
  reject(what, name, "must be one of bf16, mxfp8, nvfp4, fp8_block128, mxfp4");
}

Combine parse_combine(const std::string& name, const char* what) {
  for (Combine c : {Combine::staged, Combine::in_kernel_reduce}) {
    if (name == to_string(c)) return c;
  }
  reject(what, name, "must be one of staged, in_kernel_reduce");
}

ExpertMath parse_expert_math(const std::string& name, const char* what) {
  for (ExpertMath m : {ExpertMath::exact, ExpertMath::tensor_core, ExpertMath::wgmma}) {
    if (name == to_string(m)) return m;
  }
  reject(what, name, "must be one of exact, tensor_core, wgmma");
}

Activation parse_activation(const std::string& name, const char* what) {
  for (Activation a : {Activation::swiglu, Activation::swiglu_oai}) {
    if (name == to_string(a)) return a;
  }
  reject(what, name, "must be one of swiglu, swiglu_oai");
}

TokenBack parse_token_back(const std::string& name, const char* what) {
  for (TokenBack t : {TokenBack::epilogue_warps, TokenBack::dispatch_warps}) {
    if (name == to_string(t)) return t;
  }
  reject(what, name, "must be one of epilogue_warps, dispatch_warps");
}

TokenBucket token_bucket(std::int64_t tokens) {
  if (tokens < 0) reject("tokens", tokens, "must be >= 0");
  if (tokens <= kDecodeMaxTokens) return TokenBucket::decode;
  if (tokens <= kSmallMaxTokens) return TokenBucket::small;
  if (tokens <= kMediumMaxTokens) return TokenBucket::medium;
  return TokenBucket::prefill;
}

const Knobs& LayerConfig::knobs_for(std::int64_t tokens) const {
  return knobs(token_bucket(tokens));
}

std::string LayerConfig::describe() const {
  // One line, every field but rank (ranks compare it), fixed order; bump the version tag when the
  // format changes.
  std::string s = "epmoe.config/10";
  s += " hidden=" + std::to_string(shape_.hidden);
  s += " intermediate=" + std::to_string(shape_.intermediate);
  s += " num_experts=" + std::to_string(shape_.num_experts);
  s += " top_k=" + std::to_string(shape_.top_k);
  s += " max_tokens_per_rank=" + std::to_string(shape_.max_tokens_per_rank);
  s += " precision=";
  s += to_string(precision_);
  s += " world=" + std::to_string(world_);
  s += " combine=";
  s += to_string(options_.combine);
  s += options_.deterministic ? " deterministic=true" : " deterministic=false";
  s += " timeout_ms=" + std::to_string(options_.timeout_ms);
  s += " activation=";
  s += to_string(options_.activation);
  s += " swiglu_limit=" + float_text(options_.swiglu_limit);
  s += " mxfp8_scale_rounding=";
  s += to_string(options_.mxfp8_scale_rounding);
  s += " expert_math=";
  s += to_string(options_.expert_math);
  for (int b = 0; b < kNumTokenBuckets; ++b) {
    s += " knobs.";
    s += to_string(static_cast<TokenBucket>(b));
    s += "=" + describe_knobs(knobs_[b], options_.expert_math, precision_);
  }
  return s;
}

LayerConfig make_config(const LayerShape& shape, Precision precision, int rank, int world,
                        const LayerOptions& options) {
  if (world < 1 || world > kMaxWorld) {
    reject("world", world, "must be in [1, " + std::to_string(kMaxWorld) + "]");
  }
  if (rank < 0 || rank >= world) {
    reject("rank", rank, "must be in [0, world=" + std::to_string(world) + ")");
  }
  if (precision != Precision::bf16 && precision != Precision::mxfp8 &&
      precision != Precision::nvfp4 && precision != Precision::fp8_block128 &&
      precision != Precision::mxfp4) {
    reject("precision", static_cast<std::int64_t>(precision),
           "must be bf16, mxfp8, nvfp4, fp8_block128 or mxfp4");
  }
  check_shape(shape, world);
  check_options(options);

  LayerConfig config;
  config.shape_ = shape;
  config.precision_ = precision;
  config.rank_ = rank;
  config.world_ = world;
  config.options_ = options;
  for (int b = 0; b < kNumTokenBuckets; ++b) {
    const Knobs defaults = default_knobs(precision, world, shape, static_cast<TokenBucket>(b));
    config.knobs_[b] =
        core::adjust_knobs(defaults, precision, world, shape, static_cast<TokenBucket>(b), options);
  }
  return config;
}

LayerConfig with_knobs(const LayerConfig& config, const Knobs& knobs,
                       std::optional<TokenBucket> bucket) {
  if (bucket && static_cast<int>(*bucket) >= kNumTokenBuckets) {
    reject("bucket", static_cast<std::int64_t>(*bucket),
           "must be decode, small, medium or prefill");
  }
  core::check_knob_space(knobs);
  LayerConfig result = config;
  for (int b = 0; b < kNumTokenBuckets; ++b) {
    if (!bucket || static_cast<int>(*bucket) == b)  // adjusted per bucket: token_back's mode
      result.knobs_[b] = core::adjust_knobs(knobs, config.precision_, config.world_, config.shape_,
                                            static_cast<TokenBucket>(b), config.options_);
  }
  return result;
}

}  // namespace epmoe

// Layer configuration: shape, precision, caller options and tuned knobs (docs/design.md §5).
//
// A LayerConfig is immutable and validated when made. Fields the caller sets (precision, combine
// mode, determinism, timeouts, activation and its clamp, scale rounding, expert math) are
// caller-owned:
// with_knobs() adjusts any tuned knob that conflicts with them and never changes them. The CUDA
// executor reads the knobs of each launch's token bucket (Knobs says which expert math reads
// which); the CPU executor reads none.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace epmoe {

struct LayerShape {
  std::int64_t hidden = 0;               // H: model dimension
  std::int64_t intermediate = 0;         // I: expert FFN dimension (w13 has 2I rows)
  std::int64_t num_experts = 0;          // E: experts in the whole layer
  std::int64_t top_k = 0;                // K: experts per token
  std::int64_t max_tokens_per_rank = 0;  // largest T any forward() may pass
};

// Limits make_config checks (docs/tuning.md says why each exists). Code that sizes arrays per peer
// or packs slots into metadata may rely on them.
inline constexpr std::int64_t kShapeAlignment = 64;  // hidden, intermediate: multiples of this
inline constexpr std::int64_t kMaxHidden = 65536;
inline constexpr std::int64_t kMaxIntermediate = 65536;
inline constexpr std::int64_t kMaxExperts = 1024;
inline constexpr std::int64_t kMaxTopK = 16;  // top-k slot index fits in 4 bits of metadata
inline constexpr std::int64_t kMaxTokensPerRank = std::int64_t{1} << 20;
inline constexpr int kMaxWorld = 64;                       // ranks of one NVLink domain
inline constexpr std::uint32_t kMaxTimeoutMs = 3'600'000;  // one hour; 0 = wait forever

// The layer's number format: of its weights, its wire rows and its GEMM inputs (docs/formats.md has
// the table of what each one puts where).
//   bf16, mxfp8, nvfp4: weights and activations alike.
//   fp8_block128 (DeepSeek-V3/R1 checkpoints): E4M3 + fp32 scales; weights in 128 x 128 tiles along
//     (rows, K), activations (wire rows, FC2's input) in 1 x 128 runs along K; edge blocks partial.
//   mxfp4 (gpt-oss checkpoints): weights MXFP4 (E2M1 + E8M0 per 32 along K); activations MXFP8.
enum class Precision : std::uint8_t { bf16, mxfp8, nvfp4, fp8_block128, mxfp4 };
enum class Combine : std::uint8_t { staged, in_kernel_reduce };
enum class TokenBack : std::uint8_t { epilogue_warps, dispatch_warps };
enum class ScaleRounding : std::uint8_t { rceil, ocp_floor };  // MXFP8 / MXFP4 E8M0 scale rule
enum class ExpertMath : std::uint8_t { exact, tensor_core, wgmma };  // how the expert GEMMs sum
// The expert activation between FC1 and FC2 (gate, up = FC1 output, + b13 when given):
//   swiglu:      silu(gate) * up; swiglu_limit > 0 clamps gate <= limit, |up| <= limit first
//   swiglu_oai:  gpt-oss: gate = min(gate, limit), up = clamp(up, -limit, limit),
//                (up + 1) * gate * sigmoid(kSwigluOaiAlpha * gate); needs swiglu_limit > 0 (7)
enum class Activation : std::uint8_t { swiglu, swiglu_oai };
inline constexpr double kSwigluOaiAlpha = 1.702;  // gpt-oss's sigmoid scale (every size)
inline constexpr float kSwigluOaiLimit = 7.0f;    // gpt-oss's clamp: pass it as swiglu_limit

const char* to_string(Precision p);
const char* to_string(Combine c);
const char* to_string(TokenBack t);
const char* to_string(ScaleRounding s);
const char* to_string(ExpertMath m);
const char* to_string(Activation a);
// Parse a name printed by to_string; throws Error(invalid_argument) naming `what` otherwise.
Precision parse_precision(const std::string& name, const char* what = "precision");
Combine parse_combine(const std::string& name, const char* what = "combine");
ExpertMath parse_expert_math(const std::string& name, const char* what = "expert_math");
Activation parse_activation(const std::string& name, const char* what = "activation");
TokenBack parse_token_back(const std::string& name, const char* what = "token_back");

// Caller-owned choices. Nothing here is ever changed by tuning.
struct LayerOptions {
  Combine combine = Combine::staged;
  bool deterministic = false;         // requires Combine::staged
  std::uint32_t timeout_ms = 10'000;  // every cross-rank wait; 0 = wait forever
  Activation activation = Activation::swiglu;
  // The activation's clamp: swiglu, 0 = no clamp (the default); swiglu_oai, must be > 0 (gpt-oss
  // uses kSwigluOaiLimit = 7; a config with 0 is rejected, never adjusted).
  float swiglu_limit = 0.0f;
  // Every E8M0 scale the layer makes: MXFP8 weights and activations, MXFP4 weights (and an mxfp4
  // layer's MXFP8 activations).
  ScaleRounding mxfp8_scale_rounding = ScaleRounding::rceil;
  // wgmma (the default: the fastest at most points, docs/tuning.md#expert-math): Hopper's TMA +
  // WGMMA grouped GEMMs (CUTLASS) on bf16 operands with fp32 accumulation, E4M3 GEMMs with the
  // block scales for fp8_block128 (H and I multiples of 128) and for mxfp8 / mxfp4 where an
  // expert gets a few rows; agreeing with the reference to accumulation-order noise
  // (reference::check_output). tensor_core: bf16 mma.sync tiles with fp32 accumulation (no
  // fp8_block128). exact: float64 sums of exact products, bit-exact vs the emulating reference
  // with staged combine, and runs every layer. The CPU executor always computes exactly.
  ExpertMath expert_math = ExpertMath::wgmma;
};

// Token buckets: a launch's knob set is chosen from its T (knobs_for), so decode and prefill steps
// of one layer each get their own tuning: every forward of the CUDA executor runs the knobs of its
// T's bucket (a captured CUDA graph, those of its captured T).
enum class TokenBucket : std::uint8_t { decode, small, medium, prefill };
inline constexpr int kNumTokenBuckets = 4;
// decode: T <= 16, small: T <= 128, medium: T <= 1024, prefill: larger.
TokenBucket token_bucket(std::int64_t tokens);
// The largest T of a bucket: 16, 128, 1024, and for prefill
// std::numeric_limits<std::int64_t>::max().
std::int64_t bucket_max_tokens(TokenBucket b);
const char* to_string(TokenBucket b);

// Tuned knobs, each with a documented range (see kKnobSpace), kept per token bucket. What reads
// them (docs/tuning.md#knobs): the CUDA executor picks each forward's bucket from T on the host and
// runs the grids and GEMMs it built at creation for that bucket's
//   num_sms            every expert math: every kernel of the chain, and
//   dispatch_warps     every expert math: the chain's dispatch kernel's warps per CTA, and
//   token_back         who ships FC2's rows home, where a bucket runs either mode (wgmma's E4M3
//                      tile); make_config and with_knobs set every other bucket's to its one mode,
//   block_m, block_n   expert_math=wgmma only: its GEMMs' tiles.
// Pipeline depth (stages) is no knob: exact and tensor_core run fixed tiles (64 rows x 128
// columns, k slabs of 64, 3 stages in exact math, 4 with tensor_core, whose narrow form for chunks
// of at most 16 rows takes 5 to 8); wgmma's CUTLASS GEMMs take as many stages as fit (CUTLASS's
// automatic carveout: 6 at 128 x 128, 4 at 128 x 256, 7 and 9 for the activating FC1's 128 x 128
// and 64 x 128), its packed-weight GEMM a fixed ring by its token rows (8, 7 or 4 at 64, 128 or
// 256; 12 to 16 at 16). A StageCount<N> per value would multiply the GEMMs' instantiations. The
// CPU executor reads no knob.
struct Knobs {
  // who ships FC2's rows home. epilogue_warps: the FC2 tile's epilogue stores each row into its
  // home rank's window (exact and tensor_core always, chain and persistent round); dispatch_warps:
  // FC2 leaves its rows in a local fp32 staging pool that copy warps ship home afterwards (wgmma's
  // home kernel: always for bf16, nvfp4, CUTLASS's fp8_block128 GEMMs and the packed GEMM's
  // decoding tiles). wgmma's E4M3 tile (mxfp8 and mxfp4 where an expert gets a few rows,
  // fp8_block128 at block_m 64) reads it and runs either, in the chain and in mxfp8's and mxfp4's
  // persistent round (megakernel=true: dispatch_warps stages FC2's rows, and after a grid barrier
  // every CTA's warps send them home). with_knobs moves it onto the mode a bucket runs.
  TokenBack token_back = TokenBack::epilogue_warps;
  // read by expert_math=wgmma (exact and tensor_core run fixed 64-row tiles): tile rows, 64, 128
  // or 256. wgmma's cooperative GEMMs take 128; for bf16, 64 runs FC1 (whose epilogue activates)
  // on 64 x 128 ping-pong tiles (FC2 stays 128-row); for mxfp8, nvfp4 and mxfp4 it is the token
  // rows of the packed-weight GEMM's tile (64, 128 or 256; 128 weight rows); for fp8_block128, 64
  // runs the packed GEMM's 16-row E4M3 tile and 128 CUTLASS's blockwise GEMM. with_knobs moves 256
  // to 128 under wgmma for bf16 and fp8_block128.
  std::int32_t block_m = 64;
  // read by expert_math=wgmma: tile columns, 64, 128 or 256. 256 runs bf16's FC2 GEMM on
  // 128 x 256 x 64 tiles, anything else 128 x 128 x 64 (the activating FC1: 128 columns always;
  // fp8_block128's blockwise GEMM: 128 x 128 x 128 only; not read for mxfp8, nvfp4, mxfp4, nor by
  // fp8_block128's 16-row tile); with_knobs moves 64 to 128, and 256 to 128 for fp8_block128.
  std::int32_t block_n = 128;
  // read by the CUDA executor: warps per CTA of the chain's dispatch kernel, which quantizes each
  // token's row and pushes it to its owner ranks (a CTA per token at a time): 1..16. (The
  // persistent round's dispatch step runs on its kernel's CTAs.)
  std::int32_t dispatch_warps = 4;
  // read by the CUDA executor: every kernel of the chain gets a grid of as many CTAs as fit at once
  // on min(num_sms, the device's SMs), and wgmma's GEMMs that many persistent CTAs; 0 = all SMs.
  // It caps CTAs, not placement: a chain kernel's CTAs may still land on more SMs.
  std::int32_t num_sms = 0;
  // read by the CUDA executor: true runs this bucket's rounds as one persistent (cooperative)
  // launch per forward instead of the chain of kernels (docs/design.md §4.3), where the bucket has
  // one (has_persistent_round: tensor_core, and wgmma's E4M3 tile); elsewhere a bucket with true
  // is refused at layer creation (unsupported, naming the knob).
  bool megakernel = false;

  bool operator==(const Knobs&) const = default;
};

// The ranges a knob may take; the property test walks all of them.
struct KnobSpace {
  std::array<std::int32_t, 3> block_m{64, 128, 256};
  std::array<std::int32_t, 3> block_n{64, 128, 256};
  std::int32_t min_dispatch_warps = 1, max_dispatch_warps = 16;
};
inline constexpr KnobSpace kKnobSpace{};

class LayerConfig {
 public:
  const LayerShape& shape() const { return shape_; }
  Precision precision() const { return precision_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  const LayerOptions& options() const { return options_; }
  std::int64_t local_experts() const { return shape_.num_experts / world_; }
  int expert_owner(std::int64_t expert) const { return static_cast<int>(expert / local_experts()); }

  // The knobs of the bucket a launch with `tokens` rows falls in (picked from T, never from
  // max_tokens): what the CUDA executor's forward runs (see Knobs for which it reads).
  const Knobs& knobs_for(std::int64_t tokens) const;
  const Knobs& knobs(TokenBucket bucket) const { return knobs_[static_cast<int>(bucket)]; }

  // Bytes of the symmetric window one rank registers for this layer (same on every rank).
  std::size_t workspace_bytes() const;

  // A stable one-line description, compared across ranks at layer creation. block_m / block_n
  // are marked "(not read by expert_math=...)" where the backend does not read them: under exact
  // and tensor_core, and under wgmma block_n for every precision but bf16, block_m too for
  // fp8_block128.
  std::string describe() const;

 private:
  friend LayerConfig make_config(const LayerShape&, Precision, int, int, const LayerOptions&);
  friend LayerConfig with_knobs(const LayerConfig&, const Knobs&, std::optional<TokenBucket>);
  LayerConfig() = default;

  LayerShape shape_{};
  Precision precision_ = Precision::bf16;
  int rank_ = 0;
  int world_ = 1;
  LayerOptions options_{};
  std::array<Knobs, kNumTokenBuckets> knobs_{};
};

// Validates everything; throws Error(invalid_argument) naming field, value and rule. Knobs come
// from the built-in default table (default_knobs).
LayerConfig make_config(const LayerShape& shape, Precision precision, int rank, int world,
                        const LayerOptions& options = {});

// Applies tuned knobs (to one bucket, or to all when `bucket` is empty). Knobs outside kKnobSpace
// are rejected; knobs inside it are adjusted, never rejected, where they conflict with a
// caller-owned field or with the hardware (e.g. a tile expert_math=wgmma does not ship moved onto
// one it does): the result holds what runs.
LayerConfig with_knobs(const LayerConfig& config, const Knobs& knobs,
                       std::optional<TokenBucket> bucket = std::nullopt);

// The built-in default knob table, keyed by (precision, world, H, I, E, K, bucket).
Knobs default_knobs(Precision precision, int world, const LayerShape& shape, TokenBucket bucket);

// Whether `bucket`'s rounds can run as the persistent round (Knobs::megakernel, docs/design.md
// §4.3) on the CUDA executor: always under expert_math=tensor_core; under wgmma where the bucket
// runs mxfp8's or mxfp4's E4M3 tile (its block_m 64 and at most 16 rows per expert when routing is
// balanced: docs/tuning.md; in either token_back mode; not fp8_block128's); never under exact. A
// layer refuses megakernel=true elsewhere.
bool has_persistent_round(const LayerConfig& config, TokenBucket bucket);

// Knob files (docs/tuning.md#knob-files): a layer's knobs as text, a line per bucket, keyed by
// what they were chosen for: precision, world, the shape's hidden, intermediate, num_experts and
// top_k, and expert_math. Every Layer loads the file $EPMOE_KNOB_FILE names when that is set and
// not empty (so `epmoe run`, `epmoe bench` and the Python package do too).
inline constexpr const char* kKnobFileEnv = "EPMOE_KNOB_FILE";
// The file for `config`'s four buckets.
std::string knob_file_text(const LayerConfig& config);
// `config` with the buckets the text holds (with_knobs each, so adjusted where they conflict;
// buckets it does not name keep theirs). Error(invalid_argument) naming `source`, the line and the
// field for a malformed line, an unknown field or bucket, a knob outside kKnobSpace, or a key that
// is not `config`'s (a file tuned for another layer). `stages=`, a knob no code ever read, is
// accepted from older files and ignored.
LayerConfig with_knob_text(const LayerConfig& config, const std::string& text,
                           const std::string& source = "knob file");
// The same from a file; Error(invalid_argument) naming the path when it cannot be read.
LayerConfig with_knob_file(const LayerConfig& config, const std::string& path);

}  // namespace epmoe

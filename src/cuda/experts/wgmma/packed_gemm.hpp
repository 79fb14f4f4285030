// A grouped GEMM of the wgmma backend that reads the weights packed in the layer's format
// (packed_weights.hpp: MXFP8, MXFP4 or NVFP4 codes and block scales), so they stay resident at
// the format's size (docs/design.md §4.1). One group per local expert:
//   D_e [M_e, N] = A_e [M_e, K] . decoded(W_e) [N, K]^T
// A's rows are bf16 codes (the expert's staged rows), W_e is expert e's matrix of `weights`, D is
// fp32, row-major, with every weight decoded as the tiles of `tensor_core` decode it: the code
// times its block scale (E4M3 * 2^s, E2M1 * 2^s, E2M1 * E4M3), exact in bf16, without NVFP4's
// per-matrix divisor and multiplier (the caller applies those to D). So D is the exact product sum
// with fp32 accumulation, as Bf16GroupedGemm's over bf16 codes of the same values. mxfp8's and
// mxfp4's A on their E4M3 tile is MXFP8 instead (t16_e4m3; mxfp4's weights as E4M3 codes): E4M3
// times E4M3 in the tensor cores, each k32 block's sums times both block scales added in fp32
// (WGMMA's FP8 sums keep fewer bits than fp32 within a block). fp8_block128's weights (E4M3 codes
// with an fp32 scale per 128 x 128, fp8_block_weights.hpp, handed over as PackedMatrices whose
// `scales` hold those fp32 values) run that tile only: its tokens are the wire's FP8 rows, an fp32
// scale per 128 along K, and each k tile's two k32 WGMMAs add into one sum, promoted once by the
// weight tile's and the token's scale.
//
// Why by hand: CUTLASS 4's SM90 mixed-input GEMMs take a scale group that is a multiple of the
// tile's K (≥ 64), not MX's 32 or NVFP4's 16, and its blockwise-FP8 GEMMs a scale granularity of at
// least 128 along K (docs/design.md §4.1). fp8_block128's few rows per expert run the E4M3 tile
// too: its tiles are device functions that one persistent kernel can chain (docs/design.md §4.3),
// which CUTLASS's blockwise GEMM, a whole-grid kernel with its own scheduler and 128-row token
// tiles, is not. The kernel uses CuTe for the WGMMA atoms and their shared memory layout; the
// loads, the decode and the schedule are its own (packed_gemm.cu).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <optional>

#include "cuda/experts/inputs.hpp"  // ExpertStep
#include "cuda/experts/packed_weights.hpp"
#include "cuda/experts/wgmma/grouped_gemm.hpp"  // GemmProblem
#include "epmoe/config.hpp"                     // Activation, ScaleRounding
#include "protocol/token_back.hpp"              // HomeSlot

namespace epmoe::cuda::experts::wgmma {

// The device arrays the kernel reads, [groups] each; a round's kernel fills them before run().
// problems[e].n and .k must be the GEMM's N and K (M = problems[e].m).
struct PackedGemmArrays {
  GemmProblem* problems;
  const std::uint16_t** a;  // bf16 codes, [M_e, K] row-major (but t16_e4m3)
  float** d;                // [M_e, N] row-major (not written by an activating FC1)
  std::uint16_t** h;        // an activating FC1's output, [M_e, N / 2] (but t16_e4m3)
  const float** b13;        // an activating FC1's [N] biases (gate, then up), or nullptr
  // t16_e4m3 (the E4M3 tile of mxfp8, mxfp4): the tokens as MXFP8, E4M3 codes [M_e, K] and each
  // block's scale value (2^(s - 127), NaN for s = 0xFF) [M_e, K / 32]; an activating FC1's h the
  // same way, [M_e, N / 2] and [M_e, N / 64]. fp8_block128's: codes [M_e, K] and an fp32 scale
  // per 128, [M_e, K / 128] (its FC1 stores d: the activate kernel makes FC2's input)
  const std::uint8_t** a8;
  const float** a8_scale;
  std::uint8_t** h8;
  float** h8_scale;
  // FC2 storing GemmOutput::bf16_rows (in place of d): each result as the staged combine takes it,
  // bf16(sum unscaled + b2) with the home kernel's arithmetic, [M_e, N]; each row's scale to
  // divide by (nvfp4's h_scale, from its group's first row; nullptr: 1) and the group's b2 ([N];
  // nullptr: none)
  std::uint16_t** d16;
  const float** row_scale;
  const float** bias;
};

// FC1 of an mxfp8 or mxfp4 layer (FC2's input is MXFP8) may activate in its epilogue: for output j
// of N / 2 (gate = column j, up = column N / 2 + j of D, each plus its bias, arrays' b13), the
// activation, then FC2's input quantization point (MXFP8 per 32 outputs, the wire codec's), stored
// as the exact bf16 codes FC2's GEMM reads, as the wgmma backend's activate kernel computes them
// from D. Such a GEMM writes h, not d.
struct PackedFc1Epilogue {
  Activation activation = Activation::swiglu;
  float swiglu_limit = 0.0f;
  ScaleRounding rounding = ScaleRounding::rceil;
};

// FC2 on the E4M3 tile may send its rows home itself, in place of D and the wgmma backend's home
// kernel: each result plus its b2 to its pair's home slot (staged: bf16 into the home rank's
// combine row; in_kernel_reduce: weight x result added to the home rank's accumulator), the round
// joined and its done published to every rank (finish_expert_step) as that kernel does, so the
// results are the same bits. For the E4M3 tile only, whose sums are the values (no row or weight
// scale to divide by: MX's block scales and fp8_block128's fp32 ones are in its promotion).
struct PackedFc2Home {
  ExpertStep step;
  const float* b2;                  // [groups, N], or nullptr
  const protocol::HomeSlot* homes;  // [pairs] each pair's home slot, in pair order
};

// What a kernel of the GEMM reads (PackedGroupedGemm::args): its arrays, the weights, the shape and
// the epilogues'.
struct PackedGemmArgs {
  PackedGemmArrays arrays;
  PackedMatrices w;
  int groups, n, k;
  PackedFc1Epilogue epilogue;
  PackedFc2Home home;  // read by the E4M3 tile's FC2 that sends home only
  GemmOutput output;   // what a GEMM that neither activates nor sends home stores
};

// Token rows of the kernel's tile (WGMMA's N): 64 for a few rows per expert (decode), 128 or 256
// to decode each weight once per 128 or 256 rows (prefill). Knobs::block_m picks it
// (wgmma_backend.hpp). t16_e4m3 (mxfp8, mxfp4) is a 16-row tile that multiplies E4M3 codes: its
// tokens are MXFP8 rows (the wire rows, and FC2's input from an activating FC1), so each k32
// WGMMA of E4M3 weights and E4M3 tokens is one block of both, and its sums times the two block
// scales are the decoded values' products: no decode. Its cost is a scale promotion per token row
// and k32 block, which beats decoding the weights at a few rows per expert and loses from a few
// tens (core::wgmma_e4m3_tokens picks it per bucket); the other tiles decode the weights to bf16
// and take bf16 rows.
// fp8_block128 runs t16_e4m3 only (where an expert gets a few rows; CUTLASS's blockwise GEMM
// takes the rest: grouped_gemm.hpp).
// t16 (nvfp4 only) is the decoding tile at 16 token rows, whose CTA splits K over two pairs of
// math warpgroups as t16_e4m3's does: NVFP4's 16-wide E4M3 block scales cannot ride an FP8 WGMMA's
// k32 block, so its few-row tile decodes.
enum class PackedTokenTile : std::uint8_t { t64, t16_e4m3, t128, t256, t16 };

class PackedGroupedGemm {
 public:
  // `groups` groups of N x K weights in `precision` (mxfp8, mxfp4 or nvfp4; fp8_block128 on
  // t16_e4m3 only), at most `sm_count` persistent CTAs. Throws Error(unsupported) with
  // cannot_take's reason, or naming the tile a precision cannot run.
  // With `epilogue`, FC1 of an mxfp8 or mxfp4 layer that activates (PackedFc1Epilogue; N = 2I,
  // I a multiple of 64): cannot_activate's reason otherwise.
  // `output`: what it stores where it neither activates nor sends home (bf16_rows: FC2 of the
  // staged combine; the backend asks for it on nvfp4's 16-row tile only, fp32_sums elsewhere).
  PackedGroupedGemm(Precision precision, int groups, int n, int k, int sm_count, int device,
                    PackedTokenTile tile = PackedTokenTile::t64,
                    const PackedFc1Epilogue* epilogue = nullptr,
                    GemmOutput output = GemmOutput::fp32_sums);
  ~PackedGroupedGemm();
  PackedGroupedGemm(const PackedGroupedGemm&) = delete;
  PackedGroupedGemm& operator=(const PackedGroupedGemm&) = delete;

  const PackedGemmArrays& arrays() const { return arrays_; }
  std::size_t device_bytes() const { return device_bytes_; }
  int sm_count() const { return sm_count_; }
  PackedTokenTile tile() const { return tile_; }
  GemmOutput output() const { return output_; }
  bool e4m3_tokens() const { return tile_ == PackedTokenTile::t16_e4m3; }  // (arrays' a8, h8)
  // its FC2 may send home (run()'s `home`): the E4M3 tile without an epilogue
  bool sends_home_kernel() const { return e4m3_tokens() && !epilogue_; }

  // Queues the GEMM over `weights` (rows = N, cols = K, one matrix per group) and whatever
  // arrays() holds when it runs (no host synchronisation), after the previous kernel on `stream`
  // (programmatic dependent launch). With `home` (t16_e4m3 without an epilogue only: Error
  // internal otherwise), the results go home (PackedFc2Home) and D is not written.
  void run(const PackedMatrices& weights, cudaStream_t stream,
           const PackedFc2Home* home = nullptr) const;

  // What run() hands its kernel, for a kernel of another launch that runs the same tile (the
  // persistent round runs the E4M3 tile's two GEMMs: packed_gemm.cuh, e4m3::gemm). The same
  // refusal as run()'s for `home`.
  PackedGemmArgs args(const PackedMatrices& weights, const PackedFc2Home* home = nullptr) const;
  // t16_e4m3: the TMA descriptor of `weights`' codes (encoded on the host when they change).
  const CUtensorMap& codes_map(const PackedMatrices& weights) const;

  // Empty, or why the kernel cannot take these (K a multiple of its 64-wide k tile, ...).
  static const char* cannot_take(Precision precision, int groups, int n, int k);
  // Empty, or why FC1 cannot activate in the epilogue (FC2's input must be MXFP8: mxfp8 and mxfp4
  // layers; N = 2I with I a multiple of 64).
  static const char* cannot_activate(Precision precision, int n);

  // Weight rows of the kernel's output tile (its token rows: PackedTokenTile).
  static constexpr int kWeightRows = 128;

 private:
  Precision precision_;
  PackedTokenTile tile_;
  // t16_e4m3: the TMA descriptor of the weight codes run() was last given, encoded on the host
  mutable CUtensorMap codes_map_{};
  mutable const std::uint8_t* codes_map_of_ = nullptr;
  std::optional<PackedFc1Epilogue> epilogue_;  // an activating FC1's
  GemmOutput output_;
  int groups_, n_, k_, sm_count_;
  std::size_t smem_[2] = {0, 0};  // dynamic shared memory: D's kernel, the one sending home
  PackedGemmArrays arrays_{};
  std::uint8_t* memory_ = nullptr;
  std::size_t device_bytes_ = 0;
};

}  // namespace epmoe::cuda::experts::wgmma

// The Hopper backend (LayerOptions::expert_math = wgmma; docs/design.md §4.1): the expert GEMMs as
// SM90 grouped GEMMs (WGMMA, a persistent scheduler reading each expert's row count on the device)
// on exact bf16 codes of the rows and weights with fp32 accumulation — the same operands as
// tensor_core, with Hopper's tensor-core path (its check rule allows more outliers:
// reference::outlier_fraction). bf16 and fp8_block128 run CUTLASS's (grouped_gemm.hpp: TMA);
// MXFP8, MXFP4 and NVFP4 run PackedGroupedGemm (packed_gemm.hpp), which decodes the weights held
// packed in their format into registers, exactly, for each k tile, or (its E4M3 tile) multiplies
// their E4M3 codes; fp8_block128 runs that E4M3 tile where block_m is 64 (16 token rows:
// core::wgmma_16_row_tile).
// A round is five launches on the caller's stream (steps.cu), one less where FC1's epilogue applies
// the activation (bf16: fc1_epilogue_activates; mxfp8, mxfp4: packed_fc1_activates: no activate
// kernel) and one less where FC2 sends home (the E4M3 tile with token_back=epilogue_warps,
// PackedFc2Home: no home kernel):
//   plan and gather  CTA 0: each expert's M, and the operand pointers, into the GEMMs' device
//             arrays; every CTA, a warp per received row: its pairs appended to the pair list
//             (bucket's step: the round launches no bucket kernel, buckets_pairs) and the row
//             copied once to each pair's place in the expert-contiguous FC1 operand
//   FC1       grouped GEMM: [pairs, 2I] fp32; or, with its epilogue (Bf16GluGroupedGemm), b13,
//             the activation and FC2's input quantization point: h16
//   activate  (all but bf16) scales, b13, the activation, FC2's input quantization
//             point: h16 and its scale (fp8_block128: E4M3 codes and 1 x 128 scales)
//   FC2       grouped GEMM: [pairs, H] fp32; with the staged combine, [pairs, H] bf16 results
//             (scales, b2: GemmOutput::bf16_rows); or (the E4M3 tile) b2 and every result sent
//             home, done published as home does
//   home      scales, b2, every result sent home (bf16 rows: copied); the last CTA publishes done
//             (fc2_round)
// Weights: bf16 as bf16 codes (bf16_code_weights.hpp; w13's gate and up rows interleaved for the
// activating FC1); MXFP8, MXFP4, NVFP4 packed (packed_weights.hpp, tensor_core's and exact's
// layout); fp8_block128 as E4M3 codes with its block scales, for E4M3 GEMMs (fp8_block_weights.hpp;
// the rows' codes straight from the wire). Each takes the format's bytes.
// Knobs, per token bucket: token_back picks, in the E4M3 tile's buckets (mxfp8's, mxfp4's and
// fp8_block128's), whether its FC2 sends the rows home (epilogue_warps) or leaves them to the home
// kernel (dispatch_warps);
// block_n = 256 runs bf16's FC2 GEMM on 128 x 256 tiles, anything else on 128 x 128 (E4M3: always
// 128 x 128; the packed GEMM: always 128 weight rows); block_m picks bf16's activating FC1's tile
// (GluTile: 64 x 128 ping-pong or 128 x 128 cooperative) and the packed GEMM's token rows
// (PackedTokenTile: 64, 128 or 256; 64 runs a tile of 16 rows where an expert gets a few rows,
// core::wgmma_16_row_tile: mxfp8's and mxfp4's the E4M3 tile, nvfp4's the decoding one;
// fp8_block128's 64 is always its E4M3 tile, its 128 CUTLASS's blockwise GEMM); num_sms sizes the
// GEMMs' persistent grids (CUTLASS's hw_info.sm_count, the packed GEMM's CTAs) and the steps'
// grids. with_knobs already moved the knobs onto a tile this backend has (core::wgmma_has_tile); no
// knob sets a pipeline depth (CUTLASS's automatic carveout picks it). Buckets with the same tile
// and SM count share their GEMMs.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cuda/experts/backend.hpp"
#include "cuda/experts/bf16_code_weights.hpp"
#include "cuda/experts/biases.hpp"
#include "cuda/experts/packed_weights.hpp"
#include "cuda/experts/wgmma/grouped_gemm.hpp"
#include "cuda/experts/wgmma/steps.hpp"

namespace epmoe::cuda::experts::wgmma {

class WgmmaBackend final : public ExpertBackend {
 public:
  // Empty, or why this backend cannot run `config` (naming the field).
  static std::string can_implement(const LayerConfig& config);

  WgmmaBackend(const LayerConfig& config, int device);
  ~WgmmaBackend() override;

  const char* name() const override { return "wgmma_grouped"; }
  // its first kernel groups the pairs while it gathers the rows (plan_and_gather)
  bool buckets_pairs() const override { return true; }
  StagedRows staged_rows() const override {
    // the precisions with E4M3 operands (fp8_block128; mxfp8 and mxfp4, whose gather writes either
    // operand from the MXFP8 wire rows: Params::packed_e4m3) take their rows as received
    return e4m3_scale_block(problem_) != 0 ? StagedRows::wire : StagedRows::bf16_codes;
  }
  void prepare(const ExpertWeights& local, cudaStream_t stream) override;
  std::size_t weight_bytes() const override;
  std::size_t scratch_bytes() const override;
  void launch_fc1(const ExpertStep& step, TokenBucket bucket, cudaStream_t stream) const override;
  void launch_fc2(const ExpertStep& step, TokenBucket bucket, cudaStream_t stream) const override;

  // What a bucket's launches run (for tests): the bf16 GEMMs' tile (E4M3: 128 x 128 x 128) and
  // the SM count of its GEMMs' persistent grids.
  Bf16Tile tile(TokenBucket bucket) const;
  int gemm_sms(TokenBucket bucket) const;

  // The persistent round (docs/design.md §4.3) runs a bucket's E4M3 tile (mxfp8 and mxfp4 where
  // core::wgmma_e4m3_tokens holds: runs_e4m3_tile; not fp8_block128's, whose FC1 leaves h to the
  // activate kernel) in its own kernel, with plan_gemms and
  // gather_rows before it (steps.cuh): what that kernel takes for a round. FC2 sends home, or
  // (token_back=dispatch_warps) stages its rows for send_rows_home.
  struct E4m3Round {
    Params params;
    PackedGemmArgs fc1, fc2;
    CUtensorMap w13_codes, w2_codes;  // the weights' TMA descriptors
    bool fc2_sends_home;
  };
  bool runs_e4m3_tile(TokenBucket bucket) const;
  // and its FC2 sends home (token_back=epilogue_warps), as the persistent round's does
  bool fc2_sends_home(TokenBucket bucket) const {
    return runs_[bucket_index(bucket)].fc2_sends_home;
  }
  E4m3Round e4m3_round(const ExpertStep& step, TokenBucket bucket) const;
  const ExpertProblem& problem() const { return problem_; }

 private:
  // One bucket's GEMMs (owned below, shared between buckets of the same tile and SM count) and
  // step grids.
  struct BucketRun {
    const Bf16GluGroupedGemm* glu_fc1 = nullptr;  // bf16 (fc1_epilogue_activates)
    const Bf16GroupedGemm* fc2 = nullptr;
    const Fp8BlockwiseGroupedGemm* fp8_fc1 = nullptr;
    const Fp8BlockwiseGroupedGemm* fp8_fc2 = nullptr;
    const PackedGroupedGemm* packed_fc1 = nullptr;
    const PackedGroupedGemm* packed_fc2 = nullptr;
    // the E4M3 tile's FC2 sends its rows home (token_back=epilogue_warps): no home kernel
    bool fc2_sends_home = false;
    StepShapes shapes{};
    // What its FC2 stores (the home kernel copies bf16 rows or sends fp32 sums).
    GemmOutput fc2_output() const;
  };
  // `max_pairs`: the bucket's bound on a rank's pairs (bucket_pairs), which caps its step grids;
  // `scratch_rows`: the pairs the scratch holds (every bucket's; the E4M3 GEMM's scale extent);
  // `rows16`: block_m 64 runs the 16-row tile (core::wgmma_16_row_tile: mxfp8's and mxfp4's
  // t16_e4m3, nvfp4's t16).
  BucketRun make_bucket_run(const Knobs& knobs, int device, std::int64_t max_pairs,
                            std::int64_t scratch_rows, bool rows16);
  Params params(const ExpertStep& step, const BucketRun& run) const;
  bool fp8() const { return runs_e4m3(problem_); }
  bool packed() const { return runs_packed(problem_); }

  ExpertProblem problem_;
  // What the FC2 GEMMs store (but the E4M3 tile's: its sums, or sent home): bf16 rows, unscaled
  // and with b2, for the staged combine, which takes bf16 rows; the fp32 sums for
  // in_kernel_reduce, which adds weight x result.
  GemmOutput fc2_output_;
  // One kind of weights and GEMMs: bf16 codes, packed, or (fp8_block128) E4M3 with block scales.
  std::unique_ptr<DeviceBf16CodeWeights> weights_;
  std::unique_ptr<DevicePackedWeights> packed_weights_;
  std::unique_ptr<DeviceFp8BlockWeights> fp8_weights_;
  DeviceBiases biases_;
  struct Fp8Gemms {
    std::unique_ptr<Fp8BlockwiseGroupedGemm> fc1, fc2;
  };
  std::vector<std::unique_ptr<Bf16GluGroupedGemm>> glu_gemms_;  // one per (tile, SM count)
  std::vector<std::unique_ptr<Bf16GroupedGemm>> gemms_;         // FC2's, one per (tile, SM count)
  std::vector<Fp8Gemms> fp8_gemms_;                             // one pair per SM count
  struct PackedGemms {
    std::unique_ptr<PackedGroupedGemm> fc1, fc2;
  };
  std::vector<PackedGemms> packed_gemms_;  // one pair per (SM count, token tile)
  std::uint8_t* scratch_memory_ = nullptr;
  std::size_t scratch_bytes_ = 0;
  Scratch scratch_{};
  PerBucket<BucketRun> runs_{};
};

}  // namespace epmoe::cuda::experts::wgmma

// The wgmma backend's kernels around its two grouped GEMMs (wgmma_backend.hpp): what they take,
// and their launchers.
#pragma once

#include <cuda_runtime.h>

#include "cuda/experts/bf16_code_weights.hpp"
#include "cuda/experts/biases.hpp"
#include "cuda/experts/fp8_block_weights.hpp"
#include "cuda/experts/inputs.hpp"
#include "cuda/experts/packed_weights.hpp"
#include "cuda/experts/wgmma/grouped_gemm.hpp"
#include "cuda/experts/wgmma/packed_gemm.hpp"
#include "cuda/kernels.hpp"
#include "formats/codec.hpp"  // the E4M3 operands' blocks
#include "protocol/wire.hpp"  // activation_format

namespace epmoe::cuda::experts::wgmma {

// Per-pair scratch, rows in pair order (grouped by expert: pair_offset), so each expert's rows
// are one contiguous GEMM operand.
// bf16 operands (bf16, nvfp4) or E4M3 ones with their scales (fp8_block128): one set is
// allocated, the other's pointers are null. mxfp8 and mxfp4 run either by their bucket's tile
// (PackedTokenTile::t16_e4m3): both sets, each E4M3 array inside its bf16 one (a round uses one of
// them).
struct Scratch {
  float* d;  // [max_pairs, max(2I, H)] FC1's output, then FC2's (FC1's is spent by then)
  // bf16
  std::uint16_t* a1;   // [max_pairs, H] FC1's operand: the pair's staged row (bf16 codes)
  std::uint16_t* h16;  // [max_pairs, I] FC2's operand: bf16(quantized h * h_scale), exact
  float* h_scale;      // [max_pairs] (1, and not stored, when fc1_epilogue_activates)
  // E4M3: the rows' codes and their blocks' scales (fp32 values) along K, as on the wire: 1 x 128
  // (fp8_block128) or 1 x 32 (mxfp8, mxfp4: MXFP8 rows), e4m3_scale_block
  std::uint8_t* a8;  // [max_pairs, H] FC1's operand: the pair's received row
  float* a8_scale;   // [max_pairs, H / block]
  std::uint8_t* h8;  // [max_pairs, I] FC2's operand: h at its quantization point
  float* h8_scale;   // [max_pairs, I / block]
  // mxfp8, mxfp4, fp8_block128: each pair's home slot, for the E4M3 tile's FC2, which sends the
  // results home itself (PackedFc2Home; plan_and_gather writes them in the buckets that run it)
  protocol::HomeSlot* homes;  // [max_pairs]
};

// fp8_block128 runs E4M3 operands and GEMMs with the format's block scales; every other precision
// bf16 codes.
EPMOE_HD bool runs_e4m3(const ExpertProblem& problem) {
  return problem.precision == Precision::fp8_block128;
}
// MXFP8, MXFP4 and NVFP4 weights stay packed in their format (packed_weights.hpp) and run
// PackedGroupedGemm; bf16 runs CUTLASS's GEMMs over its codes.
EPMOE_HD bool runs_packed(const ExpertProblem& problem) {
  return packed_with_block_scales(problem.precision);
}
// The block along K of a precision's E4M3 operands' scales: 128 (fp8_block128), 32 (mxfp8 and
// mxfp4, whose rows are MXFP8 and whose E4M3 tile multiplies E4M3 codes: packed_gemm.hpp,
// t16_e4m3), or 0 (bf16 operands only).
EPMOE_HD int e4m3_scale_block(const ExpertProblem& problem) {
  if (runs_e4m3(problem)) return formats::kFp8Block128;
  return problem.precision == Precision::mxfp8 || problem.precision == Precision::mxfp4
             ? formats::kMxfp8Block
             : 0;
}
// Of the packed precisions, those whose FC2 input is MXFP8 (mxfp8, mxfp4) activate in the packed
// FC1's epilogue (PackedFc1Epilogue): no activate kernel; NVFP4 (a per-row s_enc over all of I)
// keeps it.
EPMOE_HD bool packed_fc1_activates(const ExpertProblem& problem) {
  return runs_packed(problem) && protocol::activation_format(problem.precision) == Precision::mxfp8;
}

struct Params {
  ExpertStep step;
  ExpertProblem problem;
  Bf16CodeWeights weights;       // bf16
  PackedWeights packed_weights;  // packed
  Fp8BlockWeights fp8_weights;   // fp8
  Biases biases;                 // fp32, never quantized; nullptr = none
  Scratch scratch;
  GluGemmArrays glu_fc1;                    // FC1 with the activation (fc1_epilogue_activates)
  GroupedGemmArrays fc2;                    // the GEMMs' device arrays, written by plan (bf16)
  PackedGemmArrays packed_fc1, packed_fc2;  // (packed)
  Fp8GroupedGemmArrays fp8_fc1, fp8_fc2;    // (fp8)
  // this bucket's packed GEMMs multiply E4M3 codes (t16_e4m3: mxfp8, mxfp4, fp8_block128): FC1
  // reads the received rows' codes and block scales (a8), its epilogue writes h the same way (h8;
  // fp8_block128's FC1 writes d, from which activate makes h8), and FC2 may send the results home
  // (scratch.homes; no home kernel)
  bool packed_e4m3 = false;
  // this bucket's FC2 sends the results home from its epilogue (a 16-row tile with
  // token_back=epilogue_warps: PackedFc2Home): plan_and_gather writes each pair's home slot
  bool fc2_sends_home = false;
  // what FC2 stores in scratch.d: fp32 sums, or (staged combine) the bf16 results, scales and b2
  // applied, which home only copies (GemmOutput)
  GemmOutput fc2_output = GemmOutput::fp32_sums;
  EPMOE_HD bool fp8() const { return runs_e4m3(problem); }
  EPMOE_HD bool packed() const { return runs_packed(problem); }
  EPMOE_HD bool glu() const { return fc1_epilogue_activates(problem); }
  // FC1's epilogue produced h16 (and h_scale is 1): bf16's activating GEMM or the packed one.
  EPMOE_HD bool fc1_made_h() const { return glu() || packed_fc1_activates(problem); }
  EPMOE_HD bool fc2_made_rows() const { return fc2_output == GemmOutput::bf16_rows; }
};

struct StepShapes {
  KernelShape gather, activate, home;
  int activate_group;  // threads per h row in activate (a RowGroup slice)
};
// On `num_sms` SMs by occupancy, each capped by the CTAs `max_pairs` pairs can use (the bucket's
// bucket_pairs, round_grid_caps.hpp): a warp per pair for gather and home, a RowGroup for activate.
// `fc2_output`: what the bucket's FC2 stores, which picks its home kernel (launch_home).
StepShapes step_shapes(const ExpertProblem& problem, int device, int num_sms,
                       std::int64_t max_pairs, GemmOutput fc2_output);

// Each expert's M and operand pointers for both GEMMs (M = 0 for every expert when this rank's
// round already failed: the GEMMs then do nothing), and each pair's row into FC1's operand.
void launch_plan_and_gather(const Params& p, const StepShapes& s, cudaStream_t stream);
void launch_activate(const Params& p, const StepShapes& s, cudaStream_t stream);
void launch_home(const Params& p, const StepShapes& s, cudaStream_t stream);

}  // namespace epmoe::cuda::experts::wgmma

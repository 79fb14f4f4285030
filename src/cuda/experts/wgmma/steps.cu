// The wgmma backend's kernels around its grouped GEMMs (wgmma_backend.hpp): plan and gather,
// activate (nvfp4 and fp8_block128: bf16's, mxfp8's and mxfp4's FC1 epilogues activate) and home.
// Each joins the round like every kernel of the chain (nothing at all when this rank's round
// already failed); home closes the expert step (fc2_round).
#include "cuda/experts/common.cuh"
#include "cuda/experts/fc2_input.cuh"
#include "cuda/experts/wgmma/steps.cuh"  // plan_gemms, gather_rows
#include "cuda/experts/wgmma/steps.hpp"
#include "math/activation.hpp"

namespace epmoe::cuda::experts::wgmma {
namespace {

// CTA 0 first plans the GEMMs (plan_gemms: route placed every expert's part of the pair list);
// then every CTA groups the received rows' pairs by expert and gathers each row into FC1's operand
// at its pairs' places (bucket_and_gather_rows: the chain runs no bucket kernel for this backend).
__global__ void __launch_bounds__(kThreads) plan_and_gather_kernel(Params p) {
  const RoundStart start = join_round(p.step.state, RoundPhase::fc1);
  const PhaseEnd phase_end{start};
  if (blockIdx.x == 0) plan_gemms(p, start.skip);
  if (start.skip) return;
  bucket_and_gather_rows<kThreads>(p, start.round);
}

// The round's pairs, a warp per pair, grid-stride (no CTA barrier between them):
// body(pair, lane).
template <class Body>
__device__ __forceinline__ void for_each_pair_by_warp(const Params& p, Body body) {
  constexpr int kWarps = kThreads / 32;
  const std::uint32_t pairs = p.step.in.pair_offset[p.problem.local_experts];
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (std::uint32_t pair = blockIdx.x * kWarps + threadIdx.x / 32; pair < pairs;
       pair += gridDim.x * kWarps)
    body(pair, lane);
}

// A pair's FC1 sums in scratch d (gate then up, I each) and its expert's b13 halves (nullptr
// without biases).
struct Fc1Sums {
  const float *gate, *up, *b13, *b13_up;
};
__device__ inline Fc1Sums fc1_sums(const Params& p, std::uint32_t pair, int e) {
  const std::int64_t inter = p.problem.intermediate;
  const float* gate = p.scratch.d + static_cast<std::size_t>(pair) * 2 * inter;
  const float* b13 = p.biases.b13 == nullptr ? nullptr : p.biases.b13 + e * 2 * inter;
  return Fc1Sums{gate, gate + inter, b13, b13 == nullptr ? nullptr : b13 + inter};
}

// Shared memory of one activate row: the h row in fp32, then FC2's input quantization's own.
EPMOE_HD std::size_t activate_row_smem(const ExpertProblem& problem) {
  return protocol::align16(static_cast<std::size_t>(problem.intermediate) * sizeof(float) +
                           fc2_input_smem(problem));
}

// Threads per activate row: a warp while the CTA's rows fit kActivateSmem, more for long rows.
// A warp per row keeps 8 rows' loads in flight per CTA where one CTA per row had one, and its
// barriers are __syncwarp (qwen3 at T = 8192: 65536 rows of 768, the kernel was at 1/6 of HBM).
constexpr std::size_t kActivateSmem = 48 * 1024;
int activate_group_size(const ExpertProblem& problem) {
  int size = 32;
  while (size < kThreads && (kThreads / size) * activate_row_smem(problem) > kActivateSmem)
    size *= 2;
  return size;
}

// nvfp4's activate for rows too long for activate_held_nvfp4_kernel (I > 2048: gpt-oss's 2880,
// Mixtral's 14336): a RowGroup (activate_group_size threads) per pair: FC1's sums over both scales
// (unscaled), b13, the activation into the group's shared memory, then FC2's input quantization
// point there (one NVFP4 group: the row's s_enc needs all of it); only h16 and its scale go back
// to global memory.
__global__ void __launch_bounds__(kThreads) activate_kernel(Params p, int group_size) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  const RoundStart start = join_round(p.step.state, RoundPhase::fc1);
  const PhaseEnd phase_end{start};
  if (start.skip) return;
  const ExpertInputs& in = p.step.in;
  const ExpertProblem& problem = p.problem;
  const std::int64_t inter = problem.intermediate;
  const RowGroup g = RowGroup::slice(group_size);
  const int groups = kThreads / group_size;
  std::uint8_t* row_smem = smem + g.index * activate_row_smem(problem);
  float* h = reinterpret_cast<float*>(row_smem);
  std::uint8_t* quantize_smem = row_smem + inter * sizeof(float);
  const std::uint32_t pairs = in.pair_offset[problem.local_experts];
  for (std::uint32_t pair = blockIdx.x * groups + g.index; pair < pairs;
       pair += gridDim.x * groups) {
    const int e = expert_of_pair(in, problem.local_experts, pair);
    const float x_scale = in.x_scale[x_row_of_pair(in, in.pairs[pair])];
    const RowUnscale value(x_scale, weight_factors(p, true, e));  // FC1's sums as values
    // I is a multiple of 64, so each half of the row is float4-aligned.
    const auto* gate4 =
        reinterpret_cast<const float4*>(p.scratch.d + static_cast<std::size_t>(pair) * 2 * inter);
    const float4* up4 = gate4 + inter / 4;
    const float* b13 = p.biases.b13 == nullptr ? nullptr : p.biases.b13 + e * 2 * inter;
    const float* b13_up = b13 == nullptr ? nullptr : b13 + inter;
    const std::int64_t quads = inter / 4;
    g.sync();  // the previous pair is done with h
    // kLoads float4 of gate and of up in flight per lane before any is used: the loads of a row
    // are independent, and one at a time they left the kernel latency-bound.
    for (std::int64_t first = g.rank; first < quads; first += kLoads * g.size) {
      float4 gv[kLoads], uv[kLoads];
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        const std::int64_t j4 = first + l * g.size;
        if (j4 < quads) gv[l] = gate4[j4], uv[l] = up4[j4];
      }
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        const std::int64_t j4 = first + l * g.size;
        if (j4 >= quads) break;
        const float gates[4] = {gv[l].x, gv[l].y, gv[l].z, gv[l].w};
        const float ups[4] = {uv[l].x, uv[l].y, uv[l].z, uv[l].w};
        float out[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const std::int64_t j = 4 * j4 + k;
          out[k] =
              math::activation_f32(problem.activation, math::biased(value(gates[k]), b13, j),
                                   math::biased(value(ups[k]), b13_up, j), problem.swiglu_limit);
        }
        reinterpret_cast<float4*>(h)[j4] = make_float4(out[0], out[1], out[2], out[3]);
      }
    }
    g.sync();  // the row is complete before its quantization
    quantize_h_row(g, problem, quantize_smem, h,
                   p.scratch.h16 + static_cast<std::size_t>(pair) * inter,
                   p.scratch.h_scale + pair);
  }
}

// fp8_block128's activate, in registers: a warp per pair, and per 1 x 128 block of h each lane's
// four columns (FC1's sums, the GEMM applied both scales), b13, the activation, the block's amax
// across the warp (a max of bit patterns, as encode_row_block) and their E4M3 codes, stored as one
// word per lane. The generic kernel's shared h row, barriers and byte stores held fp8 at 27 % of
// HBM's bandwidth at T = 8192 (65536 rows of 768); here kBlocksAhead blocks' sums are in flight
// per lane before any is used. The bytes are encode_row_block's: the same amax, scale and
// per-element encode (I is a multiple of 128: Fp8BlockwiseGroupedGemm::cannot_take's K of FC2).
constexpr int kBlocksAhead = 4;
__global__ void __launch_bounds__(kThreads) activate_fp8_kernel(Params p) {
  const RoundStart start = join_round(p.step.state, RoundPhase::fc1);
  const PhaseEnd phase_end{start};
  if (start.skip) return;
  using formats::kFp8Block128;
  const ExpertProblem& problem = p.problem;
  const std::int64_t inter = problem.intermediate;
  const std::int64_t blocks = inter / kFp8Block128;
  for_each_pair_by_warp(p, [&](std::uint32_t pair, int lane) {
    // the pair's expert is looked up only where there are biases (fc1_sums reads it for b13 alone)
    const int e =
        p.biases.b13 == nullptr ? 0 : expert_of_pair(p.step.in, problem.local_experts, pair);
    const Fc1Sums sums = fc1_sums(p, pair, e);
    std::uint8_t* codes = p.scratch.h8 + static_cast<std::size_t>(pair) * inter;
    float* scales = p.scratch.h8_scale + static_cast<std::size_t>(pair) * blocks;
    for (std::int64_t first = 0; first < blocks; first += kBlocksAhead) {
      float4 gv[kBlocksAhead], uv[kBlocksAhead];
#pragma unroll
      for (int l = 0; l < kBlocksAhead; ++l) {
        const std::int64_t j = (first + l) * kFp8Block128 + 4 * lane;
        if (first + l < blocks) {
          gv[l] = *reinterpret_cast<const float4*>(sums.gate + j);
          uv[l] = *reinterpret_cast<const float4*>(sums.up + j);
        }
      }
#pragma unroll
      for (int l = 0; l < kBlocksAhead; ++l) {
        if (first + l >= blocks) break;  // the warp's: every lane's block count is the same
        const std::int64_t j = (first + l) * kFp8Block128 + 4 * lane;
        const float gates[4] = {gv[l].x, gv[l].y, gv[l].z, gv[l].w};
        const float ups[4] = {uv[l].x, uv[l].y, uv[l].z, uv[l].w};
        float h[4];
        std::uint32_t amax_bits = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          h[k] =
              math::activation_f32(problem.activation, math::biased(gates[k], sums.b13, j + k),
                                   math::biased(ups[k], sums.b13_up, j + k), problem.swiglu_limit);
          amax_bits = max(amax_bits, formats::float_bits(h[k]) & formats::kF32AbsMask);
        }
        const float scale =
            formats::fp8_block128_scale(formats::bits_float(__reduce_max_sync(~0u, amax_bits)));
        *reinterpret_cast<std::uint32_t*>(codes + j) =
            fp8_block128_encode_pair(h[0], h[1], scale) |
            std::uint32_t{fp8_block128_encode_pair(h[2], h[3], scale)} << 16;
        if (lane == 0) scales[first + l] = scale;
      }
    }
  });
}

// nvfp4's activate for rows of at most kSteps x 128 columns (qwen3's 768: 8; deepseek-v3's 2048:
// 16), in registers: a warp per pair holds the row's h (each lane four columns of every 128), so
// the row's s_enc (its finite amax over all of I) needs no shared memory; then each NVFP4 block of
// 16 is four lanes' values (its amax by two shuffles, nvfp4_encode_lane). The arithmetic is
// activate_kernel's and the row codec's: h from the unscaled sums and b13, nvfp4_tensor_scale of
// the finite amax, per block its scale and E2M1 codes, each code's decoded value times s_enc as
// the bf16 code FC2 reads. The divisions repeated per element are RepeatedDivisor's: FC1's sums
// over x's scale and the weights' divisor are correctly rounded wherever the quotient is normal;
// the codes are the codec's; the decoded values are the codec's wherever s_enc is in
// [2^-100, 2^100] (E2M1 x E4M3 products, 0 or 2^-10 .. 2688, stay normal over it; beyond, rows of
// amax below ~2^-88, within an ulp). No branch per element (six IEEE divisions and the E2M1
// encoder's branches held the first version of this kernel at 680 us for qwen3's T = 8192 on an
// H100, its sums' bytes taking 170: bench/RESULTS.md, session 34). kSteps sizes h in registers: 8
// fits qwen3's kernel in 80 registers, 3 CTAs per SM. Longer rows run activate_kernel.
template <int kSteps>
__global__ void __launch_bounds__(kThreads, kSteps <= 8 ? 3 : 2)
    activate_held_nvfp4_kernel(Params p) {
  const RoundStart start = join_round(p.step.state, RoundPhase::fc1);
  const PhaseEnd phase_end{start};
  if (start.skip) return;
  using namespace formats;
  const ExpertInputs& in = p.step.in;
  const ExpertProblem& problem = p.problem;
  const std::int64_t inter = problem.intermediate;
  const int steps = static_cast<int>((inter + 127) / 128);  // the last may be 64 wide
  // 128-column steps loaded at once per lane: two (qwen3's 6 steps in three batches, none
  // computed past the row; 2 KB in flight per warp).
  constexpr int kHeldLoads = 2;
  for_each_pair_by_warp(p, [&](std::uint32_t pair, int lane) {
    const int e = expert_of_pair(in, problem.local_experts, pair);
    const float x_scale = in.x_scale[x_row_of_pair(in, in.pairs[pair])];
    const WeightFactors w = weight_factors(p, true, e);
    const Fc1Sums sums = fc1_sums(p, pair, e);
    const RowUnscale value(x_scale, w);  // FC1's sums as values
    float h[kSteps][4];
    std::uint32_t finite_amax = 0;
#pragma unroll
    for (int first = 0; first < kSteps; first += kHeldLoads) {
      if (first >= steps) break;
      float4 gv[kHeldLoads], uv[kHeldLoads];
      bool in_row[kHeldLoads];
#pragma unroll
      for (int l = 0; l < kHeldLoads; ++l) {
        const std::int64_t j = (first + l) * std::int64_t{128} + 4 * lane;
        in_row[l] = first + l < steps && j < inter;
        gv[l] = uv[l] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (in_row[l]) {
          gv[l] = *reinterpret_cast<const float4*>(sums.gate + j);
          uv[l] = *reinterpret_cast<const float4*>(sums.up + j);
        }
      }
      // Selects, not branches, per element (b13's loads aside: only gpt-oss has biases, and its
      // rows are longer than this kernel holds), so the steps' elements interleave.
#pragma unroll
      for (int l = 0; l < kHeldLoads; ++l) {
        const std::int64_t j = (first + l) * std::int64_t{128} + 4 * lane;
        const float gates[4] = {gv[l].x, gv[l].y, gv[l].z, gv[l].w};
        const float ups[4] = {uv[l].x, uv[l].y, uv[l].z, uv[l].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float v = math::activation_f32(
              problem.activation, math::biased(value(gates[k]), sums.b13, j + k),
              math::biased(value(ups[k]), sums.b13_up, j + k), problem.swiglu_limit);
          h[first + l][k] = in_row[l] ? v : 0.0f;  // past the row: in no amax, never stored
          const std::uint32_t a = float_bits(h[first + l][k]) & kF32AbsMask;
          finite_amax = a < kF32InfBits ? max(finite_amax, a) : finite_amax;  // group_finite_amax's
        }
      }
    }
    const float s_enc = nvfp4_tensor_scale(bits_float(__reduce_max_sync(~0u, finite_amax)));
    const RepeatedDivisor by_s_enc(s_enc);
    std::uint16_t* h16 = p.scratch.h16 + static_cast<std::size_t>(pair) * inter;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      if (step >= steps) break;
      const std::int64_t j = step * std::int64_t{128} + 4 * lane;
      const Nvfp4LaneBlock block = nvfp4_encode_lane(h[step], s_enc);
      if (j < inter) *reinterpret_cast<uint2*>(h16 + j) = nvfp4_lane_bf16(block, s_enc, by_s_enc);
    }
    if (lane == 0) p.scratch.h_scale[pair] = s_enc;
  });
}

// The held kernel's instantiation for problem's rows; nullptr where they are too long to hold.
using ActivateKernel = void (*)(Params);
ActivateKernel held_nvfp4_kernel(const ExpertProblem& problem) {
  if (problem.intermediate <= 8 * 128) return activate_held_nvfp4_kernel<8>;
  if (problem.intermediate <= 16 * 128) return activate_held_nvfp4_kernel<16>;
  return nullptr;
}

// FC2's staged results home (send_rows_home, one warp per pair); the last CTA publishes done to
// every rank (fc2_round). kRows: FC2 stored bf16 rows (copied home) and not fp32 sums; the sums
// kernel compiles without the copy, whose registers (80 against 63) cost it a quarter of its CTAs
// per SM where nvfp4's large tiles send sums.
template <bool kRows>
__global__ void __launch_bounds__(kThreads) home_kernel(Params p) {
  fc2_round<Stamps::end_only>(
      p.step, [&](std::uint32_t round) { send_rows_home<kThreads, kRows>(p, round); });
}

}  // namespace

StepShapes step_shapes(const ExpertProblem& problem, int device, int num_sms,
                       std::int64_t max_pairs, GemmOutput fc2_output) {
  const int group = activate_group_size(problem);
  const std::int64_t warp_ctas = ctas_for(max_pairs, kThreads / 32);
  return StepShapes{
      at_most(occupancy_shape(plan_and_gather_kernel, 0, device, num_sms), warp_ctas),
      runs_e4m3(problem)
          ? at_most(occupancy_shape(activate_fp8_kernel, 0, device, num_sms), warp_ctas)
      : held_nvfp4_kernel(problem) != nullptr
          ? at_most(occupancy_shape(held_nvfp4_kernel(problem), 0, device, num_sms), warp_ctas)
          : at_most(
                occupancy_shape(activate_kernel, (kThreads / group) * activate_row_smem(problem),
                                device, num_sms),
                ctas_for(max_pairs, kThreads / group)),
      at_most(fc2_output == GemmOutput::bf16_rows
                  ? occupancy_shape(home_kernel<true>, 0, device, num_sms)
                  : occupancy_shape(home_kernel<false>, 0, device, num_sms),
              warp_ctas),
      group};
}

void launch_plan_and_gather(const Params& p, const StepShapes& s, cudaStream_t stream) {
  launch_chained(plan_and_gather_kernel, s.gather, stream, p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}
void launch_activate(const Params& p, const StepShapes& s, cudaStream_t stream) {
  if (p.fp8())
    launch_chained(activate_fp8_kernel, s.activate, stream, p);
  else if (const ActivateKernel held = held_nvfp4_kernel(p.problem))
    launch_chained(held, s.activate, stream, p);
  else
    launch_chained(activate_kernel, s.activate, stream, p, s.activate_group);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}
void launch_home(const Params& p, const StepShapes& s, cudaStream_t stream) {
  if (p.fc2_made_rows())
    launch_chained(home_kernel<true>, s.home, stream, p);
  else
    launch_chained(home_kernel<false>, s.home, stream, p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda::experts::wgmma

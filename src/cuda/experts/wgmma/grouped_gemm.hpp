// The wgmma backend's one GEMM (docs/design.md §4.1): a grouped bf16 x bf16 -> fp32 GEMM, one
// group per local expert, D_e [M_e, N] = A_e [M_e, K] . B_e [N, K]^T with every operand K-major
// (A's rows are the expert's rows, B is the expert's weight matrix as stored, row = output
// column). CUTLASS's SM90 pointer-array kernel: TMA loads, WGMMA consumer warpgroups, a
// persistent tile scheduler over (group, m-block, n-block) that reads M_e from device memory, so
// a round's counts never reach the host and a captured graph replays correctly.
//
// Two kinds: bf16 x bf16 (grouped_gemm.cu), and E4M3 x E4M3 with fp32 block scales, 1 x 128 on A
// and 128 x 128 on B, each k128 partial sum promoted into the fp32 accumulator times its two
// scales (grouped_gemm_fp8.cu; fp8_block128). The CUTLASS types stay in those two translation
// units (FC1 and FC2 are the same GEMM with other N and K): bf16 ships two tile shapes (Bf16Tile,
// picked by the knobs block_m / block_n), E4M3 one, each with both outputs (GemmOutput); this
// header is plain C++. Each object's persistent grid is `sm_count` CTAs (Knobs::num_sms), fixed
// when it is made.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/knob_table.hpp"  // wgmma_fc1_activates
#include "cuda/experts/inputs.hpp"

namespace epmoe::cuda::experts::wgmma {

// One group's problem, laid out as CUTLASS's Shape<int, int, int> (static_assert in the .cu).
struct GemmProblem {
  int m, n, k;
};

// What a grouped GEMM's epilogue stores into D [M, N] (row-major).
//   fp32_sums  the fp32 accumulators: FC1's sums for `activate`, and FC2's where the combine is
//              in_kernel_reduce (home adds weight x the fp32 result into the home accumulator).
//   bf16_rows  bf16(sum + bias[n]), the group's bias row added in fp32 first: FC2's results as the
//              staged combine stores them (home's send_home rounds the same fp32 sum the same
//              way), so D is half the bytes and home only copies rows. The bias row is the
//              expert's b2, or a row of zeros for a layer without biases.
enum class GemmOutput : std::uint8_t { fp32_sums, bf16_rows };

// The device arrays the kernel reads, [groups] each; a round's kernel fills them before run().
// One of d (fp32_sums) and d16 with bias (bf16_rows) is read, by the GEMM's output.
struct GroupedGemmArrays {
  GemmProblem* problems;
  const std::uint16_t** a;  // bf16 codes
  const std::uint16_t** b;  // bf16 codes
  float** d;
  std::uint16_t** d16;     // bf16 codes
  const float** bias;      // [N] fp32
  const float* zero_bias;  // [N] zeros, in the GEMM's own memory: the bias of a layer without b2
};

// The bf16 kernel's tiles (M x N x K, both cooperative: two consumer warpgroups of 64 rows each,
// so M is 128). 128 x 256 gives each k step twice the reuse of the A tile, for large M per expert;
// CUTLASS's automatic carveout fits 4 stages of it (static_assert in the .cu) against 7 of
// 128 x 128. Knobs (block_m, block_n) = (128, 256) picks it, every other value 128 x 128
// (docs/tuning.md#knobs).
enum class Bf16Tile : std::uint8_t { m128_n128_k64, m128_n256_k64 };
const char* to_string(Bf16Tile tile);

class Bf16GroupedGemm {
 public:
  // `groups` groups whose N and K are fixed (strides set once here); M per group comes each round
  // through arrays().problems. `sm_count` CTAs at most (the persistent grid).
  Bf16GroupedGemm(int groups, int n, int k, int sm_count, int device,
                  Bf16Tile tile = Bf16Tile::m128_n128_k64,
                  GemmOutput output = GemmOutput::fp32_sums);
  ~Bf16GroupedGemm();
  Bf16GroupedGemm(const Bf16GroupedGemm&) = delete;
  Bf16GroupedGemm& operator=(const Bf16GroupedGemm&) = delete;

  const GroupedGemmArrays& arrays() const { return arrays_; }
  std::size_t device_bytes() const { return device_bytes_; }
  Bf16Tile tile() const { return tile_; }
  GemmOutput output() const { return output_; }
  int sm_count() const { return sm_count_; }
  int n() const { return n_; }
  int k() const { return k_; }

  // Queues the GEMM over whatever arrays() holds when it runs (no host synchronisation).
  void run(cudaStream_t stream) const;

  // Empty, or why the kernel cannot take N and K (TMA needs 16-byte aligned rows).
  static const char* cannot_take(int n, int k);

 private:
  struct Kernel;  // CUTLASS's adapter of (tile, output), initialized with its arguments
  std::unique_ptr<Kernel> kernel_;
  GroupedGemmArrays arrays_{};
  std::uint8_t* memory_ = nullptr;
  std::size_t device_bytes_ = 0;
  Bf16Tile tile_;
  GemmOutput output_;
  int sm_count_;
  int n_, k_;
};

// FC1 with the activation in its epilogue (grouped_gemm_glu.cu): the bf16 GEMM over w13 stored
// with gate and up rows interleaved (row 2j = gate j, row 2j + 1 = up j: GateUp::interleaved), so
// each thread's accumulator pair (2j, 2j + 1) of a row is one h element. The epilogue adds b13,
// applies the activation and FC2's input quantization point from registers and stores h as the
// bf16 codes FC2 reads: no fp32 [pairs, 2I] round trip and no activate kernel. bf16 layers only
// (fc1_epilogue_activates): the other precisions' weights are not bf16 codes (packed_gemm.hpp,
// the E4M3 GEMM), and their FC2 input is quantized in `activate`.
struct GluGemmArrays {
  GemmProblem* problems;
  const std::uint16_t** a;  // bf16 codes [M, H]
  const std::uint16_t** b;  // bf16 codes [2I, H], gate and up rows interleaved
  std::uint16_t** h;        // bf16 codes [M, I]: FC2's operand
  const float** b13;        // the expert's [2I] fp32 biases (gate then up), or nullptr
};

// The precisions whose FC1 runs Bf16GluGroupedGemm (core::wgmma_fc1_activates).
EPMOE_HD bool fc1_epilogue_activates(const ExpertProblem& problem) {
  return core::wgmma_fc1_activates(problem.precision);
}

// Its two tiles (knobs block_m): 128 x 128 x 64 on CUTLASS's cooperative kernel (two consumer
// warpgroups share a tile, then both run its epilogue), and 64 x 128 x 64 on the ping-pong kernel
// (a tile per consumer warpgroup, one's epilogue overlapping the other's mainloop; twice the tiles
// for experts with few rows). Measured on one H200 (bench/RESULTS.md, session 13): 64 x 128 is
// faster up to T = 512 per rank on qwen3-30b-a3b, 128 x 128 at 8192.
enum class GluTile : std::uint8_t { m64_n128_k64, m128_n128_k64 };
const char* to_string(GluTile tile);

class Bf16GluGroupedGemm {
 public:
  // One group per local expert of `problem` (N = 2I, K = H), `sm_count` persistent CTAs.
  Bf16GluGroupedGemm(const ExpertProblem& problem, int sm_count, int device, GluTile tile);
  ~Bf16GluGroupedGemm();
  Bf16GluGroupedGemm(const Bf16GluGroupedGemm&) = delete;
  Bf16GluGroupedGemm& operator=(const Bf16GluGroupedGemm&) = delete;

  const GluGemmArrays& arrays() const { return arrays_; }
  std::size_t device_bytes() const { return device_bytes_; }
  int sm_count() const { return sm_count_; }
  GluTile tile() const { return tile_; }

  void run(cudaStream_t stream) const;

  // Empty, or why the kernel cannot take this FC1 (bf16; I a multiple of 64; 16-byte rows).
  static const char* cannot_take(const ExpertProblem& problem);

 private:
  struct Kernel;
  std::unique_ptr<Kernel> kernel_;
  GluGemmArrays arrays_{};
  std::uint8_t* memory_ = nullptr;
  std::size_t device_bytes_ = 0;
  int sm_count_;
  GluTile tile_;
};

// The E4M3 GEMM's device arrays. Scales are K-major: sfa[g] holds M_g rows of ceil(K / 128)
// scales each (a row's scales follow one another, as on the wire), sfb[g] ceil(N / 128) rows of
// ceil(K / 128) (the checkpoint layout of a weight_scale_inv).
// D is d, or d16 with bias, as in GroupedGemmArrays.
struct Fp8GroupedGemmArrays {
  GemmProblem* problems;
  const std::uint8_t** a;  // E4M3 codes
  const std::uint8_t** b;  // E4M3 codes
  float** d;
  const float** sfa;
  const float** sfb;
  std::uint16_t** d16;
  const float** bias;
  const float* zero_bias;
};

class Fp8BlockwiseGroupedGemm {
 public:
  // rows: the A operand's row capacity (every group's rows lie inside it), with kScalePadRows
  // readable scale rows after it (grouped_gemm_fp8.cu).
  Fp8BlockwiseGroupedGemm(int groups, int n, int k, std::int64_t rows, int sm_count, int device,
                          GemmOutput output = GemmOutput::fp32_sums);
  ~Fp8BlockwiseGroupedGemm();
  Fp8BlockwiseGroupedGemm(const Fp8BlockwiseGroupedGemm&) = delete;
  Fp8BlockwiseGroupedGemm& operator=(const Fp8BlockwiseGroupedGemm&) = delete;

  const Fp8GroupedGemmArrays& arrays() const { return arrays_; }
  std::size_t device_bytes() const { return device_bytes_; }
  int sm_count() const { return sm_count_; }
  GemmOutput output() const { return output_; }

  // Queues the GEMM (its scale layouts are fixed at creation).
  void run(cudaStream_t stream) const;

  // Rows of activation scales the scratch keeps readable after the operand's capacity: a partial
  // tile's rows beyond M read their scales (never stored).
  static constexpr std::int64_t kScalePadRows = 128;

  // Empty, or why the kernel cannot take N and K (K in whole 128-blocks; 16-byte rows).
  static const char* cannot_take(int n, int k);

 private:
  struct Kernel;
  std::unique_ptr<Kernel> kernel_;
  Fp8GroupedGemmArrays arrays_{};
  std::uint8_t* memory_ = nullptr;
  std::size_t device_bytes_ = 0;
  int sm_count_;
  GemmOutput output_;
};

}  // namespace epmoe::cuda::experts::wgmma

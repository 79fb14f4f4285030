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
// picked by the knobs block_m / block_n), E4M3 one; this header is plain C++. Each object's
// persistent grid is `sm_count` CTAs (Knobs::num_sms), fixed when it is made.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace epmoe::cuda::experts::wgmma {

// One group's problem, laid out as CUTLASS's Shape<int, int, int> (static_assert in the .cu).
struct GemmProblem {
  int m, n, k;
};

// The device arrays the kernel reads, [groups] each; a round's kernel fills them before run().
struct GroupedGemmArrays {
  GemmProblem* problems;
  const std::uint16_t** a;  // bf16 codes
  const std::uint16_t** b;  // bf16 codes
  float** d;
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
                  Bf16Tile tile = Bf16Tile::m128_n128_k64);
  ~Bf16GroupedGemm();
  Bf16GroupedGemm(const Bf16GroupedGemm&) = delete;
  Bf16GroupedGemm& operator=(const Bf16GroupedGemm&) = delete;

  const GroupedGemmArrays& arrays() const { return arrays_; }
  std::size_t device_bytes() const { return device_bytes_; }
  Bf16Tile tile() const { return tile_; }
  int sm_count() const { return sm_count_; }

  // Queues the GEMM over whatever arrays() holds when it runs (no host synchronisation).
  void run(cudaStream_t stream) const;

  // Empty, or why the kernel cannot take N and K (TMA needs 16-byte aligned rows).
  static const char* cannot_take(int n, int k);

 private:
  struct Kernel;  // CUTLASS's GemmUniversalAdapter of `tile`, initialized with its arguments
  std::unique_ptr<Kernel> kernel_;
  GroupedGemmArrays arrays_{};
  std::uint8_t* memory_ = nullptr;
  std::size_t device_bytes_ = 0;
  Bf16Tile tile_;
  int sm_count_;
};

// The E4M3 GEMM's device arrays. Scales are K-major: sfa[g] holds M_g rows of ceil(K / 128)
// scales each (a row's scales follow one another, as on the wire), sfb[g] ceil(N / 128) rows of
// ceil(K / 128) (the checkpoint layout of a weight_scale_inv).
struct Fp8GroupedGemmArrays {
  GemmProblem* problems;
  const std::uint8_t** a;  // E4M3 codes
  const std::uint8_t** b;  // E4M3 codes
  float** d;
  const float** sfa;
  const float** sfb;
};

class Fp8BlockwiseGroupedGemm {
 public:
  Fp8BlockwiseGroupedGemm(int groups, int n, int k, int sm_count, int device);
  ~Fp8BlockwiseGroupedGemm();
  Fp8BlockwiseGroupedGemm(const Fp8BlockwiseGroupedGemm&) = delete;
  Fp8BlockwiseGroupedGemm& operator=(const Fp8BlockwiseGroupedGemm&) = delete;

  const Fp8GroupedGemmArrays& arrays() const { return arrays_; }
  std::size_t device_bytes() const { return device_bytes_; }
  int sm_count() const { return sm_count_; }

  // Queues the scale layouts of this round's M (a small kernel), then the GEMM.
  void run(cudaStream_t stream) const;

  // Empty, or why the kernel cannot take N and K (K in whole 128-blocks; 16-byte rows).
  static const char* cannot_take(int n, int k);

 private:
  struct Kernel;
  std::unique_ptr<Kernel> kernel_;
  Fp8GroupedGemmArrays arrays_{};
  std::uint8_t* memory_ = nullptr;
  std::size_t device_bytes_ = 0;
  int groups_ = 0;
  int sm_count_;
};

}  // namespace epmoe::cuda::experts::wgmma

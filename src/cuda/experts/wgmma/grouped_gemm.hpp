// The wgmma backend's one GEMM (docs/design.md §4.1): a grouped bf16 x bf16 -> fp32 GEMM, one
// group per local expert, D_e [M_e, N] = A_e [M_e, K] . B_e [N, K]^T with every operand K-major
// (A's rows are the expert's rows, B is the expert's weight matrix as stored, row = output
// column). CUTLASS's SM90 pointer-array kernel: TMA loads, WGMMA consumer warpgroups, a
// persistent tile scheduler over (group, m-block, n-block) that reads M_e from device memory, so
// a round's counts never reach the host and a captured graph replays correctly.
//
// The CUTLASS types stay in grouped_gemm.cu (one translation unit, one instantiation: FC1 and FC2
// are the same GEMM with other N and K); this header is plain C++.
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

class Bf16GroupedGemm {
 public:
  // `groups` groups whose N and K are fixed (strides set once here); M per group comes each round
  // through arrays().problems. `sm_count` CTAs at most (the persistent grid).
  Bf16GroupedGemm(int groups, int n, int k, int sm_count, int device);
  ~Bf16GroupedGemm();
  Bf16GroupedGemm(const Bf16GroupedGemm&) = delete;
  Bf16GroupedGemm& operator=(const Bf16GroupedGemm&) = delete;

  const GroupedGemmArrays& arrays() const { return arrays_; }
  std::size_t device_bytes() const { return device_bytes_; }

  // Queues the GEMM over whatever arrays() holds when it runs (no host synchronisation).
  void run(cudaStream_t stream) const;

  // Empty, or why the kernel cannot take N and K (TMA needs 16-byte aligned rows).
  static const char* cannot_take(int n, int k);

 private:
  struct Kernel;  // CUTLASS's GemmUniversalAdapter and its arguments
  std::unique_ptr<Kernel> kernel_;
  GroupedGemmArrays arrays_{};
  std::uint8_t* memory_ = nullptr;
  std::size_t device_bytes_ = 0;
};

}  // namespace epmoe::cuda::experts::wgmma

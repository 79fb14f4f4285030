// What the wgmma backend's two CUTLASS translation units (grouped_gemm.cu, grouped_gemm_fp8.cu)
// share around their kernels: one device allocation carved in order, the per-group strides of
// K-major operands, the hardware info and CUTLASS status checks. Includes CUTLASS: only those two
// files include it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/cuda_check.hpp"
#include "cuda/experts/wgmma/grouped_gemm.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/kernel_hardware_info.h"

namespace epmoe::cuda::experts::wgmma::parts {

// (M, N, K) per group, M read on the device each round.
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
static_assert(sizeof(ProblemShape::UnderlyingProblemShape) == sizeof(GemmProblem),
              "GemmProblem mirrors CUTLASS's Shape<int, int, int>");

// Both kernels' epilogue: D = the fp32 accumulators, row-major [M, N], stored with TMA (16-byte
// rows); no C operand. The scales, biases and activation run after it (steps.cu).
using LayoutD = cutlass::layout::RowMajor;
inline constexpr int kAlignD = 4;
template <class TileShape, class ClusterShape>
using Fp32Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, float,
    LayoutD*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<float, float, void>>::CollectiveOp;

// Offsets of 256-byte aligned slices of one allocation, taken in order.
struct Carve {
  std::size_t end = 0;
  std::size_t take(std::size_t bytes) {
    const std::size_t offset = (end + 255) / 256 * 256;
    end = offset + bytes;
    return offset;
  }
};

inline void check(cutlass::Status status, const char* gemm, const char* what) {
  if (status != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string(gemm) + ": " + what + ": " +
                             cutlassGetStatusString(status));
}

inline cutlass::KernelHardwareInfo hardware(int device, int sm_count) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  return hw;
}

// Every group has the same N and K, so the strides go up once: A [M, K] and B [N, K] rows of K
// elements, D [M, N] rows of N (each stride type is CUTLASS's (row stride, 1, 0)).
template <class GemmKernel>
void upload_strides(std::uint8_t* a, std::uint8_t* b, std::uint8_t* d, std::size_t groups, int n,
                    int k) {
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  const std::vector<StrideA> sa(groups, StrideA(std::int64_t{k}, cute::_1{}, cute::_0{}));
  const std::vector<StrideB> sb(groups, StrideB(std::int64_t{k}, cute::_1{}, cute::_0{}));
  const std::vector<StrideD> sd(groups, StrideD(std::int64_t{n}, cute::_1{}, cute::_0{}));
  EPMOE_CUDA_CHECK(cudaMemcpy(a, sa.data(), groups * sizeof(StrideA), cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemcpy(b, sb.data(), groups * sizeof(StrideB), cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemcpy(d, sd.data(), groups * sizeof(StrideD), cudaMemcpyHostToDevice));
}

}  // namespace epmoe::cuda::experts::wgmma::parts

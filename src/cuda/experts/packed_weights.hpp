// Expert weights resident in the layer's precision (docs/design.md §4.1, §6): the bytes the format
// takes, as the checkpoints lay them out, decoded inside the GEMM kernels that read them. The
// tensor-core backend holds every precision it runs this way:
//   bf16   the bf16 value, 2 bytes
//   mxfp8  E4M3 codes, 1 byte, and one UE8M0 scale per 32 along K
//   mxfp4  E2M1 pairs, 0.5 byte (element 2j in the low nibble), and one UE8M0 scale per 32
//   nvfp4  E2M1 pairs, 0.5 byte, one E4M3 scale per 16, and the matrix's fp32 scale
// Weight (e, r, k) = decoded(code, block scale) / divisor[e] * multiplier[e], with
// decoded = the bf16 value, e4m3 * 2^(s - 127), e2m1 * 2^(s - 127) or e2m1 * e4m3(s): exactly
// what the reference decodes (formats/codec.hpp). divisor is NVFP4's s_enc (the layer's own codec,
// or a checkpoint that ships s_enc) and multiplier NVFP4's decode scale as ModelOpt's checkpoints
// ship it (weight_scale_2); both are 1 for the other precisions. A kernel sums decoded * x and
// applies both once per output (the product of an E2M1 and an E4M3 is exact in bf16).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/experts/inputs.hpp"
#include "cuda/experts/weights.hpp"  // DeviceSlices
#include "epmoe/layer.hpp"

namespace epmoe::cuda::experts {

// Bytes of one row of n codes, and the elements one block scale covers (0: no block scales).
std::int64_t packed_row_bytes(Precision precision, std::int64_t n);
int packed_block(Precision precision);
// Whether a precision can be held this way (fp8_block128's 128 x 128 fp32 scales are not).
bool packable(Precision precision);
// The packable precisions with block scales (mxfp8, mxfp4, nvfp4): what the wgmma backend's
// packed-weight GEMM runs.
EPMOE_HD constexpr bool packed_with_block_scales(Precision precision) {
  return precision == Precision::mxfp8 || precision == Precision::mxfp4 ||
         precision == Precision::nvfp4;
}

// One FC's matrices of this rank's experts, [E_local, rows, cols] (cols = K), on the device.
struct PackedMatrices {
  std::uint8_t* codes;   // [E_local, rows, packed_row_bytes(cols)]
  std::uint8_t* scales;  // [E_local, rows, cols / packed_block]; nullptr for bf16
  float* divisor;        // [E_local]
  float* multiplier;     // [E_local]
  std::int64_t rows, cols;
};

// Both FCs (w13's rows: gate rows, then up rows, as the caller gave them).
struct PackedWeights {
  Precision precision;
  PackedMatrices w13, w2;
};

// Owns one rank's weights in that form.
class DevicePackedWeights {
 public:
  explicit DevicePackedWeights(const ExpertProblem& problem);

  // This rank's experts (validated; bf16 / f32 values, host or this GPU, through the weight
  // quantization point on the GPU; or codes and scales already in the precision, copied as they
  // are, never re-quantized), queued on `stream`; returns once `stream` has drained.
  void prepare(const ExpertWeights& local, cudaStream_t stream);

  const PackedWeights& weights() const { return memory_.layout(); }
  std::size_t bytes() const { return memory_.bytes(); }

  // Every weight of `m` (one of weights()'s) decoded on the host from a copy of the device bytes,
  // [E_local, rows, cols] in fp32 (the formula above): for tests against the reference's values.
  std::vector<float> decoded_on_host(const PackedMatrices& m) const;

 private:
  ExpertProblem problem_;
  DeviceSlices<PackedWeights> memory_;
};

}  // namespace epmoe::cuda::experts

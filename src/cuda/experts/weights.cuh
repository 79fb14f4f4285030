// The weight quantization point on the device (docs/design.md §6 point 2), for a backend's weight
// preparation: every block of 32 weights along a matrix row becomes decode(encode(w)) in the
// layer's precision, bit for bit what math::emulate_weight_matrix computes on the host (the same
// codec.hpp functions, block by block; f32 input is quantized as it is, bf16 input decoded
// first): bf16 rounding; MXFP8 / MXFP4 blocks of 32 with the layer's scale rounding; NVFP4 blocks
// of 16 with one s_enc per matrix from the matrix's amax (launch_matrix_amax); fp8_block128 with
// one fp32 scale per 128 x 128 tile from the tile's amax (launch_tile_amax). The backend's Store
// then writes the 32 values in its own layout. Weights given already in the precision
// (ExpertWeights::w13_quantized / w2_quantized) skip the quantization: a decode kernel reads them
// with formats::decode_weight_block into the same Store, so every backend takes them as it takes
// values (prepare_fc_weights, at the end).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_check.hpp"
#include "cuda/experts/weights.hpp"
#include "epmoe/config.hpp"
#include "epmoe/layer.hpp"
#include "formats/codec.hpp"
#include "formats/quantized_weights.hpp"

namespace epmoe::cuda::experts {

// One thread's weights: an MXFP8 / MXFP4 block, two NVFP4 blocks, a part of an fp8_block128 tile
// row (its first column is a multiple of 32).
inline constexpr int kWeightBlock = formats::kWeightBlock;
static_assert(kShapeAlignment % kWeightBlock == 0,
              "a thread's block never straddles a matrix row (H and I are multiples of 64)");

// Store: __device__ void operator()(std::int64_t expert, std::int64_t at, const float (&v)[32],
// float s_enc) const, with `expert` this rank's local expert, `at` the first element's index in
// its matrix, and s_enc the matrix's NVFP4 encode scale (1 for the other precisions). A Store that
// keeps fp8_block128 weights as codes also has
//   __device__ void fp8_block128(std::int64_t expert, std::int64_t at, const std::uint8_t* codes,
//                                float scale) const
// (the 32 E4M3 codes and their 128 x 128 tile's scale), which fp8_block128 weights go to instead.
template <class Store>
concept StoresFp8Block128Codes = requires(const Store& s, const std::uint8_t* codes) {
  s.fp8_block128(std::int64_t{}, std::int64_t{}, codes, 1.0f);
};
// A Store that keeps MXFP8, MXFP4 and NVFP4 weights as codes (packed_weights.hpp) also has
//   __device__ void block_codes(std::int64_t expert, std::int64_t at, const std::uint8_t* codes,
//                               const std::uint8_t* scales, float divisor, float multiplier) const
// (the 32 weights' codes as the format packs them: 32 E4M3 bytes or 16 bytes of E2M1 pairs; their
// one UE8M0 or two E4M3 block scales; the matrix's NVFP4 s_enc and decode multiplier, else 1),
// which those weights go to instead.
template <class Store>
concept StoresBlockCodes = requires(const Store& s, const std::uint8_t* codes) {
  s.block_codes(std::int64_t{}, std::int64_t{}, codes, codes, 1.0f, 1.0f);
};
// amax_bits: NVFP4 one per matrix, fp8_block128 fp8_block128_tiles(rows, cols) per matrix (tile
// row-major), both of this slice's first matrix on; nullptr for the other precisions.
template <class Store>
__global__ void __launch_bounds__(256)
    emulate_weight_blocks_kernel(RawMatrices raw, std::int64_t first_expert, Precision precision,
                                 ScaleRounding rounding, const std::uint32_t* amax_bits,
                                 Store store) {
  using namespace formats;
  const std::int64_t per_matrix = raw.rows * raw.cols / kWeightBlock;
  const std::int64_t blocks = raw.experts * per_matrix;
  for (std::int64_t b = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       b < blocks; b += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t e = b / per_matrix;
    const std::int64_t at = (b % per_matrix) * kWeightBlock;
    const std::int64_t first = b * kWeightBlock;
    float v[kWeightBlock];
    for (int i = 0; i < kWeightBlock; ++i)
      v[i] = raw.dtype == DType::f32
                 ? static_cast<const float*>(raw.data)[first + i]
                 : bf16_to_float(static_cast<const std::uint16_t*>(raw.data)[first + i]);
    float s_enc = 1.0f;
    switch (precision) {
      case Precision::bf16:
        for (int i = 0; i < kWeightBlock; ++i) v[i] = round_to_bf16(v[i]);
        break;
      case Precision::mxfp8: {
        std::uint8_t elements[kMxfp8Block], scale;
        mxfp8_encode_block(v, kMxfp8Block, rounding, elements, &scale);
        if constexpr (StoresBlockCodes<Store>) {
          store.block_codes(first_expert + e, at, elements, &scale, 1.0f, 1.0f);
          continue;
        } else {
          mxfp8_decode_block(elements, scale, kMxfp8Block, v);
        }
        break;
      }
      case Precision::nvfp4: {
        s_enc = nvfp4_tensor_scale(bits_float(amax_bits[e]));
        std::uint8_t packed[kWeightBlock / 2], scales[2];
        for (int half = 0; half < 2; ++half)
          nvfp4_encode_block(v + half * kNvfp4Block, kNvfp4Block, s_enc,
                             packed + half * kNvfp4Block / 2, &scales[half]);
        if constexpr (StoresBlockCodes<Store>) {
          store.block_codes(first_expert + e, at, packed, scales, s_enc, 1.0f);
          continue;
        } else {
          for (int half = 0; half < 2; ++half)
            nvfp4_decode_block(packed + half * kNvfp4Block / 2, scales[half], s_enc, kNvfp4Block,
                               v + half * kNvfp4Block);
        }
        break;
      }
      case Precision::fp8_block128: {
        const float scale =
            fp8_block128_scale(bits_float(amax_bits[fp8_block128_tile(raw.rows, raw.cols, e, at)]));
        std::uint8_t codes[kWeightBlock];
        for (int i = 0; i < kWeightBlock; ++i) codes[i] = fp8_block128_encode_value(v[i], scale);
        if constexpr (StoresFp8Block128Codes<Store>) {
          store.fp8_block128(first_expert + e, at, codes, scale);
          continue;
        } else {
          for (int i = 0; i < kWeightBlock; ++i) v[i] = fp8_block128_decode_value(codes[i], scale);
        }
        break;
      }
      case Precision::mxfp4: {
        std::uint8_t packed[kMxfp8Block / 2], scale;
        mxfp4_encode_block(v, kMxfp8Block, rounding, packed, &scale);
        if constexpr (StoresBlockCodes<Store>) {
          store.block_codes(first_expert + e, at, packed, &scale, 1.0f, 1.0f);
          continue;
        } else {
          mxfp4_decode_block(packed, scale, kMxfp8Block, v);
        }
        break;
      }
    }
    store(first_expert + e, at, v, s_enc);
  }
}

// One FC of this rank's experts (`t`: [E_local, rows, cols], validated, on the host or this GPU)
// through the weight quantization point into `store`, queued on `stream`. Synchronises `stream`
// before it returns (it frees its temporaries).
template <class Store>
void emulate_weights(const TensorView& t, Precision precision, ScaleRounding rounding, Store store,
                     cudaStream_t stream) {
  // NVFP4: [E_local] matrix amax; fp8_block128: [E_local, tiles] tile amax.
  const std::int64_t per_matrix = precision == Precision::nvfp4 ? 1
                                  : precision == Precision::fp8_block128
                                      ? fp8_block128_tiles(t.dim(1), t.dim(2))
                                      : 0;
  std::uint32_t* amax_bits = nullptr;
  if (per_matrix > 0) {
    const auto count = static_cast<std::size_t>(t.dim(0) * per_matrix);
    EPMOE_CUDA_CHECK(
        cudaMalloc(&amax_bits, std::max<std::size_t>(1, count) * sizeof(std::uint32_t)));
    EPMOE_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, count * sizeof(std::uint32_t), stream));
  }
  for_each_device_slice(t, stream, [&](const RawMatrices& raw, std::int64_t first) {
    std::uint32_t* slice_amax = amax_bits == nullptr ? nullptr : amax_bits + first * per_matrix;
    if (precision == Precision::nvfp4) launch_matrix_amax(raw, slice_amax, stream);
    if (precision == Precision::fp8_block128) launch_tile_amax(raw, slice_amax, stream);
    const std::int64_t blocks = raw.experts * raw.rows * raw.cols / kWeightBlock;
    const auto grid =
        static_cast<unsigned>(std::clamp<std::int64_t>((blocks + 255) / 256, 1, 65536));
    emulate_weight_blocks_kernel<<<grid, 256, 0, stream>>>(raw, first, precision, rounding,
                                                           slice_amax, store);
    EPMOE_CUDA_CHECK(cudaGetLastError());
  });
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (amax_bits != nullptr) EPMOE_CUDA_CHECK(cudaFree(amax_bits));
}

// The codes of the 32 weights of matrix `e` from element `at` in pre-quantized `q`, as
// StoresBlockCodes takes them; codes == nullptr for precisions it does not take.
struct BlockCodes {
  const std::uint8_t* codes;
  const std::uint8_t* scales;
  float divisor, multiplier;
};
__device__ inline BlockCodes block_codes_at(const formats::QuantizedMatrixData& q, std::int64_t e,
                                            std::int64_t at) {
  const std::int64_t i = e * q.rows * q.cols + at;  // the first weight's index in the slice
  const auto* scales = static_cast<const std::uint8_t*>(q.scales);
  switch (q.precision) {
    case Precision::mxfp8:
      return {q.codes + i, scales + i / formats::kMxfp8Block, 1.0f, 1.0f};
    case Precision::mxfp4:
      return {q.codes + i / 2, scales + i / formats::kMxfp8Block, 1.0f, 1.0f};
    case Precision::nvfp4:  // s_enc divides; ModelOpt's weight_scale_2 multiplies
      return {q.codes + i / 2, scales + i / formats::kNvfp4Block,
              q.global_is_s_enc ? q.global[e] : 1.0f, q.global_is_s_enc ? 1.0f : q.global[e]};
    default:
      return {nullptr, nullptr, 1.0f, 1.0f};
  }
}

// Pre-quantized weights: each thread decodes one block of 32 (formats::decode_weight_block, the
// CPU executor's decode too) and stores it. `q` points at this slice's first expert.
template <class Store>
__global__ void __launch_bounds__(256)
    decode_weight_blocks_kernel(formats::QuantizedMatrixData q, std::int64_t experts,
                                std::int64_t first_expert, Store store) {
  const std::int64_t per_matrix = q.rows * q.cols / kWeightBlock;
  for (std::int64_t b = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       b < experts * per_matrix; b += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t e = b / per_matrix;
    const std::int64_t at = (b % per_matrix) * kWeightBlock;
    if constexpr (StoresFp8Block128Codes<Store>) {
      if (q.precision == Precision::fp8_block128) {
        store.fp8_block128(
            first_expert + e, at, q.codes + e * q.rows * q.cols + at,
            static_cast<const float*>(q.scales)[formats::fp8_block128_tile(q.rows, q.cols, e, at)]);
        continue;
      }
    }
    if constexpr (StoresBlockCodes<Store>) {
      if (const BlockCodes b = block_codes_at(q, e, at); b.codes != nullptr) {
        store.block_codes(first_expert + e, at, b.codes, b.scales, b.divisor, b.multiplier);
        continue;
      }
    }
    float v[kWeightBlock];
    const float s_enc = formats::decode_weight_block(q, e, at, v);
    store(first_expert + e, at, v, s_enc);
  }
}

// One FC of this rank's pre-quantized experts (validated; [E_local, rows, cols] of values, on the
// host or this GPU) decoded into `store`, queued on `stream`. Synchronises `stream` before it
// returns.
template <class Store>
void decode_weights(const QuantizedMatrices& quantized, std::int64_t rows, std::int64_t cols,
                    Precision precision, Store store, cudaStream_t stream) {
  formats::QuantizedMatrixData q = formats::quantized_matrix_data(quantized, precision, rows, cols);
  std::vector<const TensorView*> tensors{&quantized.codes, &quantized.scales};
  if (q.global != nullptr)
    tensors.push_back(given(quantized.s_enc) ? &quantized.s_enc : &quantized.global_scale);
  for_each_expert_slice(
      tensors, stream,
      [&](const std::vector<const void*>& data, std::int64_t first, std::int64_t count) {
        q.codes = static_cast<const std::uint8_t*>(data[0]);
        q.scales = data[1];
        if (q.global != nullptr) q.global = static_cast<const float*>(data[2]);
        const std::int64_t blocks = count * rows * cols / kWeightBlock;
        const auto grid =
            static_cast<unsigned>(std::clamp<std::int64_t>((blocks + 255) / 256, 1, 65536));
        decode_weight_blocks_kernel<<<grid, 256, 0, stream>>>(q, count, first, store);
        EPMOE_CUDA_CHECK(cudaGetLastError());
      });
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// One FC of this rank's experts as the caller gave it ([E_local, rows, cols]): `values` through
// the weight quantization point, or `quantized` (when given) decoded as it is, into `store`. What
// a backend's prepare() calls for w13 and for w2.
template <class Store>
void prepare_fc_weights(const TensorView& values, const QuantizedMatrices& quantized,
                        std::int64_t rows, std::int64_t cols, Precision precision,
                        ScaleRounding rounding, Store store, cudaStream_t stream) {
  if (given(quantized))
    decode_weights(quantized, rows, cols, precision, store, stream);
  else
    emulate_weights(values, precision, rounding, store, stream);
}

}  // namespace epmoe::cuda::experts

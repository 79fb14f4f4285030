// MXFP8, NVFP4, FP8 block-128 and MXFP4 quantization of fp32 matrices (docs/design.md §6,
// docs/formats.md), on host memory (pointers) or on host or CUDA memory (TensorViews, at the end
// of this file).
//
// A matrix is row-major [rows, cols] and is quantized along cols (the reduction dimension), so
// every row carries its own block scales (fp8_block128 weights: one scale per 128 x 128 tile).
// These functions produce exactly the bytes the CUDA kernels and the reference forward produce
// (they share one codec), and the TensorView versions are what the Python bindings quantize_mxfp8 /
// dequantize_mxfp8 / quantize_nvfp4 / dequantize_nvfp4 / quantize_fp8_block128 / ... /
// dequantize_mxfp4 call.
//
// Every rejected argument throws epmoe::Error(ErrorCode::invalid_argument) naming the function,
// the argument, its value and the rule. A pointer may be null only when rows * cols == 0.
#pragma once

#include <cstdint>

#include "epmoe/config.hpp"  // ScaleRounding
#include "epmoe/tensor.hpp"  // TensorView, Stream

namespace epmoe {

// ---- MXFP8: E4M3 elements, one E8M0 scale (2^(code-127), 0xFF = NaN) per 32 elements. ----
//
// x:        rows * cols fp32; cols must be a multiple of 32.
// elements: rows * cols bytes, E4M3 codes, same layout as x.
// scales:   rows * (cols / 32) bytes, E8M0 codes; scales[r * cols/32 + j] covers
//           x[r, 32j .. 32j+31].
// rounding: rceil (default) picks the smallest scale with which no element saturates;
//           ocp_floor is the OCP MX v1.0 rule 2^(floor(log2 amax) - 8), elements saturate to ±448.
// A block holding NaN or ±Inf gets the NaN scale 0xFF and NaN elements; it decodes to NaNs.
void quantize_mxfp8(const float* x, std::int64_t rows, std::int64_t cols, std::uint8_t* elements,
                    std::uint8_t* scales, ScaleRounding rounding = ScaleRounding::rceil);

// out[r, c] = e4m3(elements[r, c]) * 2^(scales[r, c/32] - 127); NaN for a 0xFF scale.
void dequantize_mxfp8(const std::uint8_t* elements, const std::uint8_t* scales, std::int64_t rows,
                      std::int64_t cols, float* out);

// ---- NVFP4: E2M1 elements, one E4M3 block scale per 16 elements, one fp32 scale per group. ----
//
// The fp32 "tensor scale" is the encode scale s_enc = 448 * 6 / amax(group) of docs/formats.md
// (1.0 when the group's largest finite |x| is 0); a value decodes as e2m1 * block_scale / s_enc.
enum class Nvfp4ScaleGroup : std::uint8_t {
  per_tensor,  // one s_enc for the whole matrix (weights: per expert, per FC)
  per_row,     // one s_enc per row (activations: every row on the wire carries its own)
};
const char* to_string(Nvfp4ScaleGroup group);

// x:             rows * cols fp32; cols must be a multiple of 16.
// packed:        rows * cols / 2 bytes; element c of a row sits in byte c/2, low nibble when c is
//                even, high nibble when odd.
// scales:        rows * (cols / 16) bytes, E4M3 block-scale codes.
// tensor_scales: written; 1 float (per_tensor) or rows floats (per_row), the s_enc used.
// NaN and ±Inf are left out of the group amax; a block holding one gets the NaN block scale 0x7F
// and decodes to NaNs. Every other code is CUDA's conversion of docs/formats.md's steps, bit for
// bit, signed zero included: a negative value that rounds to zero (also in a block whose scale
// rounds to zero) is 0x8, -0.
void quantize_nvfp4(const float* x, std::int64_t rows, std::int64_t cols, Nvfp4ScaleGroup group,
                    std::uint8_t* packed, std::uint8_t* scales, float* tensor_scales);

// As quantize_nvfp4 with one given s_enc for the whole matrix (a static scale from a checkpoint;
// note that a checkpoint's "input_scale"/"weight_scale_2" is usually the decode scale 1 / s_enc).
// tensor_scale must be finite and > 0.
void quantize_nvfp4_static(const float* x, std::int64_t rows, std::int64_t cols, float tensor_scale,
                           std::uint8_t* packed, std::uint8_t* scales);

// out[r, c] = e2m1(packed) * e4m3(scales[r, c/16]) / tensor_scales[0 or r]; NaN for a NaN block
// scale. tensor_scales holds 1 float (per_tensor) or rows floats (per_row).
void dequantize_nvfp4(const std::uint8_t* packed, const std::uint8_t* scales,
                      const float* tensor_scales, std::int64_t rows, std::int64_t cols,
                      Nvfp4ScaleGroup group, float* out);

// ---- FP8 with 128-blocks (fp8_block128; DeepSeek-V3/R1 checkpoints): E4M3 elements, fp32 scales.
//
// A scale is the dequantization multiplier (a checkpoint's weight_scale_inv): value = e4m3 *
// scale. Encoding (DeepSeek-V3's reference act_quant / weight_quant, docs/formats.md): scale =
// amax(block) / 448, element = e4m3(x / scale), RNE, saturating at ±448. A block holding NaN or
// ±Inf gets a NaN scale and NaN elements (0x7F); a block whose scale is 0 (all zero) gets signed
// zero elements. Blocks at the matrix edges cover what is there: any rows and cols are accepted.
enum class Fp8Blocks : std::uint8_t {
  tile_128x128,  // weights: one scale per 128 x 128 tile; scales [ceil(rows/128), ceil(cols/128)]
  row_1x128,     // activations: one scale per 128 values of a row; scales [rows, ceil(cols/128)]
};
const char* to_string(Fp8Blocks blocks);

// x:        rows * cols fp32, one matrix.
// elements: rows * cols bytes, E4M3 codes, same layout as x.
// scales:   fp32, row-major [ceil(rows/128), ceil(cols/128)] (tile_128x128: scales[i, j] covers
//           x[128i .. 128i+127, 128j .. 128j+127]) or [rows, ceil(cols/128)] (row_1x128:
//           scales[r, j] covers x[r, 128j .. 128j+127]); a last tile or run may be shorter.
void quantize_fp8_block128(const float* x, std::int64_t rows, std::int64_t cols, Fp8Blocks blocks,
                           std::uint8_t* elements, float* scales);

// out[r, c] = e4m3(elements[r, c]) * scales[block of (r, c)], one fp32 rounding; NaN where either
// is NaN. The scales may come from a checkpoint: any fp32 is taken as is.
void dequantize_fp8_block128(const std::uint8_t* elements, const float* scales, std::int64_t rows,
                             std::int64_t cols, Fp8Blocks blocks, float* out);

// ---- MXFP4 (OCP MX v1.0; gpt-oss checkpoints): E2M1 elements, one E8M0 scale per 32. ----
//
// x:        rows * cols fp32; cols must be a multiple of 32.
// packed:   rows * cols / 2 bytes; element c of a row sits in byte c/2, low nibble when c is even,
//           high nibble when odd (gpt-oss's *_blocks [..., cols/32, 16] is this, viewed as
//           [..., cols/2]).
// scales:   rows * (cols / 32) bytes, E8M0 codes (gpt-oss's *_scales); scales[r * cols/32 + j]
//           covers x[r, 32j .. 32j+31].
// rounding: rceil (default) picks the smallest scale 2^ceil(log2(amax / 6)) with which no element
//           saturates; ocp_floor is the OCP MX v1.0 rule 2^(floor(log2 amax) - 2), elements
//           saturate to ±6.
// A block holding NaN or ±Inf gets the NaN scale 0xFF (and elements 0); it decodes to NaNs.
void quantize_mxfp4(const float* x, std::int64_t rows, std::int64_t cols, std::uint8_t* packed,
                    std::uint8_t* scales, ScaleRounding rounding = ScaleRounding::rceil);

// out[r, c] = e2m1(packed[r, c]) * 2^(scales[r, c/32] - 127); NaN for a 0xFF scale.
void dequantize_mxfp4(const std::uint8_t* packed, const std::uint8_t* scales, std::int64_t rows,
                      std::int64_t cols, float* out);

// ---- The same codecs on tensors: host memory or CUDA memory, dispatched on where they live. ----
//
// Each tensor is contiguous and holds a matrix [..., cols] taken along its last dimension (rows =
// the product of the others); outputs have the input's leading dimensions:
//   x, out:        f32 [..., cols]
//   elements:      u8  [..., cols]        (MXFP8 E4M3 codes)
//   scales:        u8  [..., cols / 32]   (MXFP8 E8M0) or [..., cols / 16] (NVFP4 E4M3)
//   packed:        u8  [..., cols / 2]    (NVFP4 E2M1 pairs)
//   tensor_scales: f32, 1 element (per_tensor) or rows elements (per_row), any shape
// All tensors of a call live on one device. Host tensors run the pointer functions above (the
// stream is ignored; they return when done). CUDA tensors run the same per-block codec in kernels
// queued on `stream` (cudaStream_t; null = the legacy default stream) on the tensors' device, and
// return at once: no host synchronisation, no allocation, capturable into a CUDA graph. Both give
// the same bytes. A CUDA tensor in a build without CUDA throws Error(unsupported); one on a device
// this process cannot use throws too, naming the argument.
void quantize_mxfp8(const TensorView& x, const TensorView& elements, const TensorView& scales,
                    ScaleRounding rounding = ScaleRounding::rceil, Stream stream = {});
void dequantize_mxfp8(const TensorView& elements, const TensorView& scales, const TensorView& out,
                      Stream stream = {});
void quantize_nvfp4(const TensorView& x, Nvfp4ScaleGroup group, const TensorView& packed,
                    const TensorView& scales, const TensorView& tensor_scales, Stream stream = {});
// With the static s_enc `tensor_scale` (finite, > 0), also written to tensor_scales (1 element).
void quantize_nvfp4_static(const TensorView& x, float tensor_scale, const TensorView& packed,
                           const TensorView& scales, const TensorView& tensor_scales,
                           Stream stream = {});
void dequantize_nvfp4(const TensorView& packed, const TensorView& scales,
                      const TensorView& tensor_scales, Nvfp4ScaleGroup group, const TensorView& out,
                      Stream stream = {});

// fp8_block128: x, out f32 and elements u8 [..., cols]. row_1x128: scales f32 [...,
// ceil(cols/128)]. tile_128x128: x is a stack of matrices [..., rows, cols] (at least 2-D), each
// tiled on its own (a checkpoint's experts), scales f32 [..., ceil(rows/128), ceil(cols/128)].
void quantize_fp8_block128(const TensorView& x, Fp8Blocks blocks, const TensorView& elements,
                           const TensorView& scales, Stream stream = {});
void dequantize_fp8_block128(const TensorView& elements, const TensorView& scales, Fp8Blocks blocks,
                             const TensorView& out, Stream stream = {});
// mxfp4: packed u8 [..., cols / 2], scales u8 [..., cols / 32].
void quantize_mxfp4(const TensorView& x, const TensorView& packed, const TensorView& scales,
                    ScaleRounding rounding = ScaleRounding::rceil, Stream stream = {});
void dequantize_mxfp4(const TensorView& packed, const TensorView& scales, const TensorView& out,
                      Stream stream = {});

}  // namespace epmoe

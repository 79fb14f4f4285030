// Device-side checks of the codecs against the device conversions of cuda_fp4.h / cuda_fp8.h
// (codec_check.cu holds the kernels; gpu_codec_test.cpp the tests). The host side of the same
// comparisons is tests/formats_test.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "epmoe/config.hpp"
#include "epmoe/formats.hpp"

namespace epmoe::test {

// How many inputs gave different bytes, and the fp32 bits of the smallest such input.
struct Disagreements {
  std::uint64_t count = 0;
  std::uint32_t first_bits = 0xffffffffu;
};

// Every fp32 bit pattern x, on the device: codec.hpp's float_to_e2m1 of (x, -x) packed as one
// byte against __nv_cvt_float2_to_fp4x2({x, -x}, __NV_E2M1, cudaRoundNearest).
Disagreements e2m1_vs_cuda_on_every_float();

// Every fp32 bit pattern x: float_to_e4m3 of (x, -x) against __nv_cvt_float2_to_fp8x2({x, -x},
// __NV_SATFINITE, __NV_E4M3); for a NaN both must give a NaN code (CUDA's may carry the sign).
Disagreements e4m3_vs_cuda_on_every_float();

// Every code byte and every scale code: the GEMM kernels' decode of packed weights (decode8,
// cuda/experts/packed_weights.cuh) against the host codec's decode. first_bits = code << 8 | scale.
Disagreements packed_decode_on_every_code(Precision precision);

// Every code byte and every scale code: the packed GEMM's E2M1 decode to bf16 (byte permutes and
// a bf16x2 multiply, cuda/experts/e2m1_bf16.hpp) against the host codec's value rounded to bf16;
// MX scales (E8M0), or NVFP4's (E4M3) when `nvfp4`. first_bits = code << 8 | scale.
Disagreements e2m1_bf16_decode_on_every_code(bool nvfp4);

struct Nvfp4Bytes {
  std::vector<std::uint8_t> packed;  // [rows, cols / 2]
  std::vector<std::uint8_t> scales;  // [rows, cols / 16]
  std::vector<float> s_enc;          // 1 (per_tensor) or rows (per_row)
};

// x: [rows, cols] finite floats in host memory, quantized on device 0 twice: `library` by epmoe's
// CUDA codec (quantize_nvfp4_cuda), `cuda` by a kernel that runs the documented steps with
// cuda_fp8.h / cuda_fp4.h conversions (block scale e4m3((amax / 6) * s_enc), elements
// e2m1((x * s_enc) / block_scale), or e2m1(x * 0) when the block scale is 0) on library's s_enc.
void nvfp4_on_device(const std::vector<float>& x, std::int64_t rows, std::int64_t cols,
                     Nvfp4ScaleGroup group, Nvfp4Bytes* library, Nvfp4Bytes* cuda);

struct Fp8Block128Bytes {
  std::vector<std::uint8_t> elements;  // [rows, cols]
  std::vector<float> scales;           // [ceil(rows/128) or rows, ceil(cols/128)]
};

// x: one [rows, cols] matrix of finite floats in host memory, quantized on device 0 twice:
// `library` by epmoe's CUDA codec (quantize_fp8_block128_cuda), `cuda` by a kernel, one thread per
// block, that runs the documented steps with cuda_fp8.h's conversion (scale = amax / 448, element
// = e4m3(x / scale), or e4m3(x * 0) when the scale is 0).
void fp8_block128_on_device(const std::vector<float>& x, std::int64_t rows, std::int64_t cols,
                            Fp8Blocks blocks, Fp8Block128Bytes* library, Fp8Block128Bytes* cuda);

struct Mxfp4Bytes {
  std::vector<std::uint8_t> packed;  // [rows, cols / 2]
  std::vector<std::uint8_t> scales;  // [rows, cols / 32]
};

// x: [rows, cols] finite floats, quantized on device 0 twice: `library` by quantize_mxfp4_cuda,
// `cuda` by a kernel using cuda_fp8.h / cuda_fp4.h: scale code max(0, e8m0_round_down(amax) - 2)
// (ocp_floor) or e8m0_round_up(amax / 6) (rceil, where amax / 6 is an fp32 normal; library's code
// below that), elements __nv_cvt_double2_to_fp4x2 of x * 2^(127 - code) on `cuda`'s own codes.
void mxfp4_on_device(const std::vector<float>& x, std::int64_t rows, std::int64_t cols,
                     ScaleRounding rounding, Mxfp4Bytes* library, Mxfp4Bytes* cuda);

// Rows of bf16 codes x: [rows, n] (n a multiple of 64), each encoded on device 0 by one CTA of
// `warps` warps with cuda/row_codec.cuh's encode_bf16_row (dispatch's wire rows straight from x's
// codes): each row's payload (its first protocol::wire_payload_bytes(precision, n) bytes of a
// 16-byte aligned stride) and s_enc.
struct WireRows {
  std::vector<std::uint8_t> payload;  // [rows, stride]
  std::size_t stride = 0;
  std::vector<float> s_enc;  // [rows]
};
WireRows encode_bf16_rows_on_device(const std::vector<std::uint16_t>& x, std::int64_t rows,
                                    std::int64_t n, Precision precision, ScaleRounding rounding,
                                    int warps);

// Rows of 128 floats x, each by one warp on device 0 as nvfp4's held activate encodes h (a lane
// four elements: cuda/row_codec.cuh's nvfp4_encode_lane, then nvfp4_lane_bf16): the row's s_enc
// (nvfp4_tensor_scale of its finite amax), the packed E2M1 codes and block scales (wire layout:
// 64 bytes of codes, 8 scales) and the bf16 codes of the decoded values times s_enc.
struct Nvfp4LaneRows {
  std::vector<std::uint8_t> packed;  // [rows, 64]
  std::vector<std::uint8_t> scales;  // [rows, 8]
  std::vector<float> s_enc;          // [rows]
  std::vector<std::uint16_t> h16;    // [rows, 128]
};
Nvfp4LaneRows nvfp4_lane_rows_on_device(const std::vector<float>& x, std::int64_t rows);

}  // namespace epmoe::test

// One activation row encoded into / decoded from its wire payload by a RowGroup (the CTA, or a
// slice of it: device_common.cuh). Encoding, a warp takes a block (MXFP8's 32, two NVFP4 16s, a
// 1 x 128 fp8_block128 run), a lane an element: the block's amax is a max of |x|'s bit patterns
// (abs_max_bits: order-free), then each lane runs the format's per-element function of codec.hpp.
// Decoding is element by element. So the bytes are exactly those of the serial
// protocol/wire_codec.hpp the CPU executor and the reference use, with every lane busy (a thread
// per block left 3/4 of a CTA idle on a 2048-wide MXFP8 row). The layer's precision picks its
// activation_format (mxfp4 layers: MXFP8). Rows are multiples of 64 long, so MXFP8 and NVFP4 blocks
// are whole.
#pragma once

#include <cuda_fp8.h>  // the E4M3 conversions of the register encoders

#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/repeated_divisor.hpp"
#include "formats/codec.hpp"
#include "protocol/wire.hpp"

namespace epmoe::cuda {

// x: [n] floats in shared memory; payload: wire bytes (shared or global). Returns s_enc (NVFP4)
// or 1. `scratch`: one float per warp of the group. Every thread of the group must call it.
__device__ inline float encode_row_block(const RowGroup& g, const float* x, std::int64_t n,
                                         Precision precision, ScaleRounding rounding,
                                         std::uint8_t* payload, float* scratch) {
  using namespace formats;
  switch (protocol::activation_format(precision)) {
    case Precision::bf16: {
      auto* out = reinterpret_cast<std::uint16_t*>(payload);
      for (std::int64_t i = g.rank; i < n; i += g.size) out[i] = float_to_bf16(x[i]);
      return 1.0f;
    }
    case Precision::mxfp8: {
      const int lane = g.rank % 32;
      for (std::int64_t b = g.warp(); b * kMxfp8Block < n; b += g.warps()) {
        const std::int64_t i = b * kMxfp8Block + lane;
        const float v = x[i];
        const std::uint8_t code = mxfp8_scale_code(
            bits_float(__reduce_max_sync(0xffffffffu, float_bits(v) & kF32AbsMask)), rounding);
        if (lane == 0) payload[n + b] = code;
        payload[i] = mxfp8_encode_value(v, code, mxfp8_inverse_scale(code));
      }
      return 1.0f;
    }
    case Precision::nvfp4: {
      const float s_enc = nvfp4_tensor_scale(group_finite_amax(g, x, n, scratch));
      // A warp per two blocks of 16, a half-warp each; each even lane packs its odd neighbour.
      const int lane = g.rank % 32;
      for (std::int64_t pair = g.warp(); pair * 2 * kNvfp4Block < n; pair += g.warps()) {
        const std::int64_t i = pair * 2 * kNvfp4Block + lane;
        const float v = x[i];
        std::uint32_t amax_bits = float_bits(v) & kF32AbsMask;
        for (int offset = kNvfp4Block / 2; offset > 0; offset /= 2)
          amax_bits = max(amax_bits, __shfl_xor_sync(0xffffffffu, amax_bits, offset));
        const std::uint8_t bs = nvfp4_block_scale(amax_bits, s_enc);
        if (lane % kNvfp4Block == 0) payload[n / 2 + i / kNvfp4Block] = bs;
        const unsigned q = e4m3_is_nan(bs) ? 0u : nvfp4_encode_value(v, s_enc, e4m3_to_float(bs));
        const unsigned odd = __shfl_down_sync(0xffffffffu, q, 1);
        if (lane % 2 == 0) payload[i / 2] = static_cast<std::uint8_t>(q | odd << 4);
      }
      return s_enc;
    }
    case Precision::fp8_block128: {
      // NOTES: n is a multiple of 64, so the last run is 64 or 128 long and the fp32 scales after
      // the n E4M3 bytes are 4-byte aligned (the payload itself is 16-byte aligned).
      // A warp per run, the lanes over its elements: fp8_block128_encode_block's bytes (the run's
      // amax is abs_max_bits, a max of |x|'s bit patterns, so the order does not matter).
      auto* scales = reinterpret_cast<float*>(payload + n);
      const int lane = g.rank % 32;
      for (std::int64_t b = g.warp(); b * kFp8Block128 < n; b += g.warps()) {
        const std::int64_t off = b * kFp8Block128;
        const int len = static_cast<int>(n - off < kFp8Block128 ? n - off : kFp8Block128);
        std::uint32_t amax_bits = 0;
        for (int i = lane; i < len; i += 32)
          amax_bits = max(amax_bits, float_bits(x[off + i]) & kF32AbsMask);
        amax_bits = __reduce_max_sync(0xffffffffu, amax_bits);
        const float scale = fp8_block128_scale(bits_float(amax_bits));
        if (lane == 0) scales[b] = scale;
        for (int i = lane; i < len; i += 32)
          payload[off + i] = fp8_block128_encode_value(x[off + i], scale);
      }
      return 1.0f;
    }
    case Precision::mxfp4:  // activation_format: never an activation format
      break;
  }
  return 1.0f;
}

// One lane's four elements of an NVFP4 block of 16 (lanes 4 b .. 4 b + 3 of the warp; every lane
// calls it: the block's amax, abs_max_bits with NaN and Inf included, by two shuffles):
// formats::nvfp4_encode_block's block scale and E2M1 codes,
// bit for bit, with its divisions by the block scale RepeatedDivisor's (the quotients that
// decide a code, |q| > 0.25, are normal: the elements' scaled magnitudes are at most 2688 and a
// non-zero scale at least 2^-9) and the block scale's E4M3 by CUDA's conversion of a finite
// non-negative float (the host encoder's bytes:
// GpuCodec.E4m3EncoderMatchesCudaFp8SatfiniteOnEveryFloat).
struct Nvfp4LaneBlock {
  std::uint8_t scale;     // E4M3; 0x7F (NaN) where the block has a NaN or an Inf
  float scale_value;      // e4m3_to_float(scale)
  std::uint8_t codes[4];  // E2M1 (0 in a NaN block)
};
__device__ __forceinline__ Nvfp4LaneBlock nvfp4_encode_lane(const float (&v)[4], float s_enc) {
  using namespace formats;
  std::uint32_t block_amax_bits = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k)
    block_amax_bits = max(block_amax_bits, float_bits(v[k]) & kF32AbsMask);
  block_amax_bits = max(block_amax_bits, __shfl_xor_sync(~0u, block_amax_bits, 1));
  block_amax_bits = max(block_amax_bits, __shfl_xor_sync(~0u, block_amax_bits, 2));
  Nvfp4LaneBlock block{};
  if (block_amax_bits >= kF32InfBits) {
    block.scale = kE4m3Nan;
    block.scale_value = quiet_nan();
    return block;
  }
  block.scale = static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(
      bits_float(block_amax_bits) / kE2m1Max * s_enc, __NV_SATFINITE, __NV_E4M3));
  block.scale_value = e4m3_to_float(block.scale);
  const RepeatedDivisor by_scale(block.scale_value);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    // a zero block scale: the zero of the element's sign (nvfp4_encode_value's)
    const std::uint8_t zero = static_cast<std::uint8_t>(float_bits(v[k]) >> 28 & 0x8u);
    block.codes[k] =
        block.scale_value == 0.0f ? zero : float_to_e2m1(by_scale.divide(v[k] * s_enc));
  }
  return block;
}

// The bf16 codes of a lane's four NVFP4 elements decoded and times s_enc (FC2's input, the codec's
// float_to_bf16(nvfp4_decode_value(...) * s_enc)), packed two per word, with the division by s_enc
// by_s_enc's (RepeatedDivisor(s_enc)): the codec's bytes wherever nvfp4_in_reciprocal_range(s_enc),
// within an ulp of the quotients beyond (the activate's rows, one warp's each, take no branch).
__device__ __forceinline__ uint2 nvfp4_lane_bf16(const Nvfp4LaneBlock& block, float s_enc,
                                                 const RepeatedDivisor& by_s_enc) {
  using namespace formats;
  std::uint32_t codes[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float decoded = e4m3_is_nan(block.scale)
                              ? quiet_nan()
                              : by_s_enc.divide(e2m1_to_float(block.codes[k]) * block.scale_value);
    codes[k] = float_to_bf16(decoded * s_enc);
  }
  return make_uint2(codes[0] | codes[1] << 16, codes[2] | codes[3] << 16);
}

// formats::fp8_block128_encode_value of two elements: CUDA's conversion of the same quotients
// (cvt.rn.satfinite.e4m3x2, whose bytes are the host encoder's on every float but NaN:
// GpuCodec.E4m3EncoderMatchesCudaFp8SatfiniteOnEveryFloat), except where the host's early returns
// decide: a NaN scale's block (one with a NaN or an Inf) is all NaN codes 0x7F, as the host's,
// where the conversion of a NaN quotient may keep a sign; a zero scale's block, all ±0, keeps each
// sign, where the conversion of 0 / 0 is NaN.
__device__ __forceinline__ std::uint16_t fp8_block128_encode_pair(float a, float b, float scale) {
  using namespace formats;
  if ((float_bits(scale) & kF32AbsMask) > kF32InfBits)
    return static_cast<std::uint16_t>(0x0101u * kE4m3Nan);
  if (scale == 0.0f)
    return static_cast<std::uint16_t>((float_bits(a) >> 24 & 0x80u) |
                                      (float_bits(b) >> 16 & 0x8000u));
  return __nv_cvt_float2_to_fp8x2(make_float2(a / scale, b / scale), __NV_SATFINITE, __NV_E4M3);
}

// formats::mxfp8_encode_value of two elements of a block with scale code `code` and its
// mxfp8_inverse_scale: CUDA's conversion of the same products (as fp8_block128_encode_pair), or
// NaN codes for a NaN scale.
__device__ __forceinline__ std::uint16_t mxfp8_encode_pair(float a, float b, std::uint8_t code,
                                                           float inv_scale) {
  if (code == formats::kE8m0Nan) return static_cast<std::uint16_t>(0x0101u * formats::kE4m3Nan);
  return __nv_cvt_float2_to_fp8x2(make_float2(a * inv_scale, b * inv_scale), __NV_SATFINITE,
                                  __NV_E4M3);
}

// Whether encode_bf16_row encodes rows of `precision`: the activation formats with block scales
// (fp8_block128; MXFP8, also mxfp4 layers'; NVFP4).
EPMOE_HD bool encodes_bf16_rows(Precision precision) {
  const Precision format = protocol::activation_format(precision);
  return format == Precision::fp8_block128 || format == Precision::mxfp8 ||
         format == Precision::nvfp4;
}

// A bf16 row (n a multiple of 64, the row 8-byte aligned) into its wire payload, encode_row_block's
// bytes for fp8_block128 and MXFP8 rows, by the CTA's warps from registers: a warp takes 128
// elements per step, a lane 4 (one 8-byte load of x, no fp32 row in shared memory); fp8_block128's
// 1 x 128 block is the warp (its amax by a warp reduction), an MXFP8 block of 32 eight lanes (three
// shuffles); each lane stores its four codes as one word. Every thread of the CTA calls it.
__device__ inline void encode_bf16_row_e4m3(const std::uint16_t* row, std::int64_t n,
                                            Precision precision, ScaleRounding rounding,
                                            std::uint8_t* payload) {
  using namespace formats;
  const bool mx = protocol::activation_format(precision) == Precision::mxfp8;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  constexpr int kAhead = 2;  // steps' loads in flight per lane
  for (std::int64_t first = threadIdx.x / 32; first * 128 < n; first += kAhead * warps) {
    uint2 codes[kAhead];
#pragma unroll
    for (int l = 0; l < kAhead; ++l) {
      const std::int64_t j = (first + l * warps) * 128 + 4 * lane;
      codes[l] = j < n ? *reinterpret_cast<const uint2*>(row + j) : make_uint2(0u, 0u);
    }
#pragma unroll
    for (int l = 0; l < kAhead; ++l) {
      const std::int64_t step = first + l * warps;
      if (step * 128 >= n) break;  // the warp's: its steps are the same for every lane
      const std::int64_t j = step * 128 + 4 * lane;
      const std::uint32_t words[2] = {codes[l].x, codes[l].y};
      float v[4];
      std::uint32_t amax_bits = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[k] = bf16_to_float(static_cast<std::uint16_t>(words[k / 2] >> (16 * (k % 2))));
        amax_bits = max(amax_bits, float_bits(v[k]) & kF32AbsMask);
      }
      std::uint32_t word;
      if (mx) {
#pragma unroll
        for (int offset = 1; offset < kMxfp8Block / 4; offset *= 2)
          amax_bits = max(amax_bits, __shfl_xor_sync(~0u, amax_bits, offset));
        const std::uint8_t code = mxfp8_scale_code(bits_float(amax_bits), rounding);
        const float inv_scale = mxfp8_inverse_scale(code);
        if (j < n && lane % (kMxfp8Block / 4) == 0) payload[n + j / kMxfp8Block] = code;
        word = mxfp8_encode_pair(v[0], v[1], code, inv_scale) |
               std::uint32_t{mxfp8_encode_pair(v[2], v[3], code, inv_scale)} << 16;
      } else {
        const float scale = fp8_block128_scale(bits_float(__reduce_max_sync(~0u, amax_bits)));
        if (lane == 0) reinterpret_cast<float*>(payload + n)[step] = scale;
        word = fp8_block128_encode_pair(v[0], v[1], scale) |
               std::uint32_t{fp8_block128_encode_pair(v[2], v[3], scale)} << 16;
      }
      if (j < n) *reinterpret_cast<std::uint32_t*>(payload + j) = word;
    }
  }
}

// An NVFP4 bf16 row into its wire payload, encode_row_block's bytes and s_enc, from registers, in
// two passes over the row (the second from cache): the row's finite amax (group_finite_amax's) by
// each warp's lanes, a warp reduction and one float per warp in `scratch` across a barrier; then
// a warp takes 128 elements per step, a lane 4 (one 8-byte load), each block of 16 four lanes (its
// amax by two shuffles: NaN and Inf included, as encode_row_block's), each lane storing its four
// E2M1 codes as 16 bits. Every thread of the CTA calls it.
__device__ inline float encode_bf16_row_nvfp4(const std::uint16_t* row, std::int64_t n,
                                              std::uint8_t* payload, float* scratch) {
  using namespace formats;
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  const auto values = [&](std::int64_t j, float(&v)[4]) {  // a lane's four, 0 past the row
    const uint2 codes = j < n ? *reinterpret_cast<const uint2*>(row + j) : make_uint2(0u, 0u);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      v[k] =
          bf16_to_float(static_cast<std::uint16_t>((k < 2 ? codes.x : codes.y) >> (16 * (k % 2))));
  };
  std::uint32_t finite_amax = 0;
  for (std::int64_t step = warp; step * 128 < n; step += warps) {
    float v[4];
    values(step * 128 + 4 * lane, v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::uint32_t a = float_bits(v[k]) & kF32AbsMask;
      if (a < kF32InfBits) finite_amax = max(finite_amax, a);
    }
  }
  finite_amax = __reduce_max_sync(~0u, finite_amax);
  if (lane == 0) scratch[warp] = bits_float(finite_amax);
  __syncthreads();
  std::uint32_t row_amax = 0;
  for (int w = 0; w < warps; ++w) row_amax = max(row_amax, float_bits(scratch[w]));
  const float s_enc = nvfp4_tensor_scale(bits_float(row_amax));
  for (std::int64_t step = warp; step * 128 < n; step += warps) {
    const std::int64_t j = step * 128 + 4 * lane;
    float v[4];
    values(j, v);
    const Nvfp4LaneBlock block = nvfp4_encode_lane(v, s_enc);
    std::uint32_t packed = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) packed |= std::uint32_t{block.codes[k]} << (4 * k);
    if (j < n) {
      *reinterpret_cast<std::uint16_t*>(payload + j / 2) = static_cast<std::uint16_t>(packed);
      if (lane % 4 == 0) payload[n / 2 + j / kNvfp4Block] = block.scale;
    }
  }
  return s_enc;
}

// A bf16 row (encodes_bf16_rows' formats; n a multiple of 64, the row 8-byte aligned) straight
// into its wire payload, without an fp32 row: returns s_enc (NVFP4) or 1. Every thread of the CTA
// calls it; `scratch` holds one float per warp.
__device__ inline float encode_bf16_row(const std::uint16_t* row, std::int64_t n,
                                        Precision precision, ScaleRounding rounding,
                                        std::uint8_t* payload, float* scratch) {
  if (protocol::activation_format(precision) == Precision::nvfp4)
    return encode_bf16_row_nvfp4(row, n, payload, scratch);
  encode_bf16_row_e4m3(row, n, precision, rounding, payload);
  return 1.0f;
}

__device__ inline void decode_row_block(const RowGroup& g, const std::uint8_t* payload,
                                        std::int64_t n, Precision precision, float row_scale,
                                        float* out) {
  using namespace formats;
  switch (protocol::activation_format(precision)) {
    case Precision::bf16: {
      const auto* in = reinterpret_cast<const std::uint16_t*>(payload);
      for (std::int64_t i = g.rank; i < n; i += g.size) out[i] = bf16_to_float(in[i]);
      return;
    }
    case Precision::mxfp8:
      for (std::int64_t i = g.rank; i < n; i += g.size)
        out[i] = mxfp8_decode_value(payload[i], payload[n + i / kMxfp8Block]);
      return;
    case Precision::nvfp4:
      for (std::int64_t i = g.rank; i < n; i += g.size)
        out[i] = nvfp4_decode_value(e2m1_code_at(payload, i), payload[n / 2 + i / kNvfp4Block],
                                    row_scale);
      return;
    case Precision::fp8_block128: {
      // Element by element (fp8_block128_decode_block's values), every thread busy.
      const auto* scales = reinterpret_cast<const float*>(payload + n);
      for (std::int64_t i = g.rank; i < n; i += g.size)
        out[i] = fp8_block128_decode_value(payload[i], scales[i / kFp8Block128]);
      return;
    }
    case Precision::mxfp4:  // activation_format: never an activation format
      return;
  }
}

// A quantization point in place (the FC2 input): decode(encode(x)). `bytes`: scratch of
// wire_payload_bytes(precision, n). Returns the row's s_enc (NVFP4) or 1.
__device__ inline float quantize_row_block(const RowGroup& g, float* x, std::int64_t n,
                                           Precision precision, ScaleRounding rounding,
                                           std::uint8_t* bytes, float* scratch) {
  const float s_enc = encode_row_block(g, x, n, precision, rounding, bytes, scratch);
  g.sync();
  decode_row_block(g, bytes, n, precision, s_enc, x);
  g.sync();
  return s_enc;
}

// A decoded row as a tensor-core operand: bf16(x * scale), exact because x * scale is the row's
// code value (NVFP4: e2m1 * block scale, at most 6 significant bits, off by at most two fp32
// roundings; MXFP8 (mxfp8 and mxfp4 layers) and bf16: scale 1, already bf16 values). Not exact
// for fp8_block128 (e4m3 * an fp32 scale), which the tensor-core backend rejects. Every thread of
// the group calls it after the row is complete in `x`.
__device__ inline void to_bf16_codes(const RowGroup& g, const float* x, std::int64_t n, float scale,
                                     std::uint16_t* out) {
  for (std::int64_t i = g.rank; i < n; i += g.size) out[i] = formats::float_to_bf16(x[i] * scale);
}

// Eight bf16 codes (16 bytes, little-endian: the lower half of a word is the earlier element) as
// floats.
__device__ inline void bf16x8_to_float(const uint4& codes, float (&out)[8]) {
  const std::uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
  for (int j = 0; j < 8; ++j)
    out[j] = formats::bf16_to_float(static_cast<std::uint16_t>(words[j / 2] >> (16 * (j % 2))));
}

// A received row straight to the tensor-core operand (StagedRows::bf16_codes): bf16(decoded x *
// scale), the codes decode_row_block and then to_bf16_codes give, without the fp32 row between
// them. Eight elements per thread and step: one load of their codes (bf16: 16 bytes; MXFP8: 8
// and their block's scale; NVFP4: 4 and their block's scale), one 16-byte store; the payload and
// `out` are 16-byte aligned and n a multiple of 64. Rows in bf16, MXFP8 or NVFP4 only
// (fp8_block128 never stages bf16 codes: to_bf16_codes is not exact for it).
__device__ inline void decode_row_to_bf16_codes(const RowGroup& g, const std::uint8_t* payload,
                                                std::int64_t n, Precision precision,
                                                float row_scale, float scale, std::uint16_t* out) {
  using namespace formats;
  const Precision format = protocol::activation_format(precision);
  // Eight decoded values to eight bf16 codes in one 16-byte store.
  const auto store = [&](std::int64_t q, const float(&v)[8]) {
    std::uint32_t packed[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      packed[j] = static_cast<std::uint32_t>(float_to_bf16(v[2 * j] * scale)) |
                  static_cast<std::uint32_t>(float_to_bf16(v[2 * j + 1] * scale)) << 16;
    reinterpret_cast<uint4*>(out)[q] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  };
  if (format == Precision::nvfp4) {
    // NVFP4's quotients over s_enc by a reciprocal and a correction where that is the IEEE
    // quotient (nvfp4_in_reciprocal_range), else by nvfp4_decode_value's division: the choice is
    // the row's, so no element branches.
    const auto decode_nvfp4 = [&](auto over_s_enc) {
      for (std::int64_t q = g.rank; q < n / 8; q += g.size) {
        const std::uint32_t codes = reinterpret_cast<const std::uint32_t*>(payload)[q];
        const std::uint8_t block_scale = payload[n / 2 + 8 * q / kNvfp4Block];
        const float block_scale_value = e4m3_to_float(block_scale);
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
          v[j] =
              e4m3_is_nan(block_scale)
                  ? quiet_nan()
                  : over_s_enc(e2m1_to_float(static_cast<std::uint8_t>(codes >> (4 * j) & 0xFu)) *
                               block_scale_value);
        store(q, v);
      }
    };
    if (nvfp4_in_reciprocal_range(row_scale)) {
      const RepeatedDivisor by_s_enc(row_scale);
      decode_nvfp4([&](float product) { return by_s_enc.divide(product); });
    } else {
      decode_nvfp4([&](float product) { return product / row_scale; });
    }
    return;
  }
  for (std::int64_t q = g.rank; q < n / 8; q += g.size) {
    float v[8];
    if (format == Precision::bf16) {
      bf16x8_to_float(reinterpret_cast<const uint4*>(payload)[q], v);
    } else {  // mxfp8
      const uint2 codes = reinterpret_cast<const uint2*>(payload)[q];
      const std::uint8_t block_scale = payload[n + 8 * q / kMxfp8Block];
#pragma unroll
      for (int j = 0; j < 8; ++j)
        v[j] = mxfp8_decode_value(
            static_cast<std::uint8_t>((j < 4 ? codes.x : codes.y) >> (8 * (j % 4))), block_scale);
    }
    store(q, v);
  }
}

// 16-byte copies of a group-staged buffer to (peer) global memory; `bytes` is a multiple of 16.
__device__ inline void copy_16B(const RowGroup& g, std::uint8_t* dst, const std::uint8_t* src,
                                std::size_t bytes) {
  auto* d = reinterpret_cast<uint4*>(dst);
  const auto* s = reinterpret_cast<const uint4*>(src);
  for (std::size_t i = g.rank; i < bytes / 16; i += g.size) d[i] = s[i];
}

}  // namespace epmoe::cuda

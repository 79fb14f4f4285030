// Kernels of codec_check.hpp: codec.hpp's encoders against cuda_fp4.h / cuda_fp8.h, both on the
// device. On sm_90 the fp4 conversion is CUDA's own emulation (sm_100 has the instruction); the fp8
// one is the cvt.rn.satfinite.e4m3x2.f32 instruction.
#include <cuda_fp4.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/experts/e2m1_bf16.hpp"
#include "cuda/experts/packed_weights.cuh"
#include "cuda/row_codec.cuh"
#include "formats/codec.hpp"
#include "formats/codec_device.hpp"
#include "gpu/codec_check.hpp"

namespace epmoe::test {
namespace {

using namespace formats;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

constexpr int kThreads = 256;
constexpr int kBlocks = 4096;
constexpr std::uint64_t kPositivePatterns = std::uint64_t{1} << 31;  // x >= +0; -x covers the rest

struct DeviceCount {
  unsigned long long count;
  unsigned int first_bits;
};

__device__ void record(DeviceCount* out, std::uint32_t bits) {
  atomicAdd(&out->count, 1ull);
  atomicMin(&out->first_bits, bits);
}

__global__ void e2m1_vs_cuda_kernel(DeviceCount* out) {
  for (std::uint64_t u = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x;
       u < kPositivePatterns; u += std::uint64_t{gridDim.x} * blockDim.x) {
    const float x = bits_float(static_cast<std::uint32_t>(u));
    const float neg = bits_float(static_cast<std::uint32_t>(u) | 0x80000000u);
    const unsigned ours = float_to_e2m1(x) | (unsigned{float_to_e2m1(neg)} << 4);
    const unsigned cuda =
        __nv_cvt_float2_to_fp4x2(make_float2(x, neg), __NV_E2M1, cudaRoundNearest);
    if (ours != cuda) record(out, static_cast<std::uint32_t>(u));
  }
}

__device__ bool e4m3_agrees(float x, std::uint8_t ours, std::uint8_t cuda) {
  const bool nan = (float_bits(x) & kF32AbsMask) > kF32InfBits;
  return nan ? ours == kE4m3Nan && e4m3_is_nan(cuda) : ours == cuda;
}

__global__ void e4m3_vs_cuda_kernel(DeviceCount* out) {
  for (std::uint64_t u = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x;
       u < kPositivePatterns; u += std::uint64_t{gridDim.x} * blockDim.x) {
    const float x = bits_float(static_cast<std::uint32_t>(u));
    const float neg = bits_float(static_cast<std::uint32_t>(u) | 0x80000000u);
    const unsigned cuda = __nv_cvt_float2_to_fp8x2(make_float2(x, neg), __NV_SATFINITE, __NV_E4M3);
    if (!e4m3_agrees(x, float_to_e4m3(x), static_cast<std::uint8_t>(cuda & 0xffu)) ||
        !e4m3_agrees(neg, float_to_e4m3(neg), static_cast<std::uint8_t>(cuda >> 8)))
      record(out, static_cast<std::uint32_t>(u));
  }
}

// One thread per block of 16: the steps of docs/formats.md, each rounded by a CUDA conversion.
__global__ void nvfp4_cuda_reference_kernel(const float* x, std::int64_t nblocks,
                                            std::int64_t blocks_per_row, const float* s_enc,
                                            bool per_row, std::uint8_t* packed,
                                            std::uint8_t* scales) {
  for (std::int64_t b = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; b < nblocks;
       b += std::int64_t{gridDim.x} * blockDim.x) {
    const float* xb = x + b * kNvfp4Block;
    const float s = s_enc[per_row ? b / blocks_per_row : 0];
    float amax = 0.0f;
    for (int i = 0; i < kNvfp4Block; ++i) amax = fmaxf(amax, fabsf(xb[i]));
    const __nv_fp8_storage_t bs = __nv_cvt_float_to_fp8(amax / 6.0f * s, __NV_SATFINITE, __NV_E4M3);
    const float bs_value = __half2float(__half(__nv_cvt_fp8_to_halfraw(bs, __NV_E4M3)));
    scales[b] = bs;
    for (int i = 0; i < kNvfp4Block; i += 2) {
      // NOTES: a zero block scale scales by 0, as CUDA's NVFP4 quantize kernels do.
      const float2 q = bs_value == 0.0f
                           ? make_float2(xb[i] * 0.0f, xb[i + 1] * 0.0f)
                           : make_float2(xb[i] * s / bs_value, xb[i + 1] * s / bs_value);
      packed[b * (kNvfp4Block / 2) + i / 2] =
          __nv_cvt_float2_to_fp4x2(q, __NV_E2M1, cudaRoundNearest);
    }
  }
}

// One thread per fp8_block128 block of one [rows, cols] matrix: a 1 x 128 run (rows_per_block 1)
// or a 128 x 128 tile (rows_per_block 128), each step a CUDA conversion.
__global__ void fp8_block128_cuda_reference_kernel(const float* x, std::int64_t rows,
                                                   std::int64_t cols, std::int64_t rows_per_block,
                                                   std::uint8_t* elements, float* scales) {
  const std::int64_t per_row = (cols + 127) / 128;
  const std::int64_t nblocks = (rows + rows_per_block - 1) / rows_per_block * per_row;
  for (std::int64_t b = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; b < nblocks;
       b += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r0 = b / per_row * rows_per_block, c0 = b % per_row * 128;
    const std::int64_t r1 = r0 + rows_per_block < rows ? r0 + rows_per_block : rows;
    const std::int64_t c1 = c0 + 128 < cols ? c0 + 128 : cols;
    float amax = 0.0f;
    for (std::int64_t r = r0; r < r1; ++r)
      for (std::int64_t c = c0; c < c1; ++c) amax = fmaxf(amax, fabsf(x[r * cols + c]));
    const float scale = amax / 448.0f;
    scales[b] = scale;
    for (std::int64_t r = r0; r < r1; ++r)
      for (std::int64_t c = c0; c < c1; ++c) {
        const float v = x[r * cols + c];
        // NOTES: a zero scale scales by 0, as NVFP4's zero block scale does.
        elements[r * cols + c] =
            __nv_cvt_float_to_fp8(scale == 0.0f ? v * 0.0f : v / scale, __NV_SATFINITE, __NV_E4M3);
      }
  }
}

// One thread per MXFP4 block of 32; `library_scales` only where CUDA's E8M0 conversion of
// amax / 6 would see an fp32 subnormal (rceil).
__global__ void mxfp4_cuda_reference_kernel(const float* x, std::int64_t nblocks, bool rceil,
                                            const std::uint8_t* library_scales,
                                            std::uint8_t* packed, std::uint8_t* scales) {
  for (std::int64_t b = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; b < nblocks;
       b += std::int64_t{gridDim.x} * blockDim.x) {
    const float* xb = x + b * kMxfp8Block;
    float amax = 0.0f;
    for (int i = 0; i < kMxfp8Block; ++i) amax = fmaxf(amax, fabsf(xb[i]));
    int code;
    if (!rceil) {
      code = static_cast<int>(__nv_cvt_float_to_e8m0(amax, __NV_SATFINITE, cudaRoundZero)) - 2;
      code = code < 0 ? 0 : code;
    } else if (amax / 6.0f >= 1.17549435e-38f) {
      code = __nv_cvt_float_to_e8m0(amax / 6.0f, __NV_SATFINITE, cudaRoundPosInf);
    } else {
      code = library_scales[b];
    }
    scales[b] = static_cast<std::uint8_t>(code);
    for (int i = 0; i < kMxfp8Block; i += 2) {
      const double2 q = make_double2(ldexp(static_cast<double>(xb[i]), 127 - code),
                                     ldexp(static_cast<double>(xb[i + 1]), 127 - code));
      packed[b * (kMxfp8Block / 2) + i / 2] =
          __nv_cvt_double2_to_fp4x2(q, __NV_E2M1, cudaRoundNearest);
    }
  }
}

Disagreements run_every_float(void (*kernel)(DeviceCount*)) {
  check(cudaSetDevice(0), "cudaSetDevice");
  DeviceCount* d = nullptr;
  check(cudaMalloc(&d, sizeof *d), "cudaMalloc");
  const DeviceCount init{0, 0xffffffffu};
  check(cudaMemcpy(d, &init, sizeof init, cudaMemcpyHostToDevice), "cudaMemcpy");
  kernel<<<kBlocks, kThreads>>>(d);
  check(cudaGetLastError(), "launch");
  DeviceCount h{};
  check(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaFree(d), "cudaFree");
  return {h.count, h.first_bits};
}

template <class T>
T* device_alloc(std::size_t n) {
  T* p = nullptr;
  check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc");
  return p;
}

template <class T>
std::vector<T> to_host(const T* p, std::size_t n) {
  std::vector<T> v(n);
  check(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return v;
}

// Thread (code byte, scale code): a load of 16 equal code bytes through decode8's first group
// against the host codec's decode of the same code and scale (formats/codec.hpp, on the device);
// any NaN matches any NaN. NVFP4's weights are the code values, e2m1 * e4m3(scale).
template <Precision P>
__global__ void packed_decode_kernel(DeviceCount* out) {
  const std::uint32_t code = blockIdx.x, scale = threadIdx.x;  // 256 x 256
  const std::uint32_t word = code * 0x01010101u;
  const std::uint32_t scale_codes = P == Precision::nvfp4 ? scale * 0x0101u : scale;
  float got[8];
  cuda::experts::decode8<P>(make_uint4(word, word, word, word), 0,
                            cuda::experts::group_scale<P>(scale_codes, 0), got);
  for (int k = 0; k < 8; ++k) {
    const auto u8 = static_cast<std::uint8_t>(code), s8 = static_cast<std::uint8_t>(scale);
    const std::uint8_t nibble = (k % 2 == 0 ? u8 : u8 >> 4) & 0xfu;
    float want = 0;
    if constexpr (P == Precision::mxfp8) want = mxfp8_decode_value(u8, s8);
    if constexpr (P == Precision::mxfp4)
      want = s8 == kE8m0Nan ? quiet_nan() : e2m1_to_float(nibble) * e8m0_to_float(s8);
    if constexpr (P == Precision::nvfp4)
      want = e4m3_is_nan(s8) ? quiet_nan() : e2m1_to_float(nibble) * e4m3_to_float(s8);
    const bool same = (isnan(got[k]) && isnan(want)) || float_bits(got[k]) == float_bits(want);
    if (!same) record(out, code << 8 | scale);
  }
}

template <Precision P>
Disagreements packed_decode_check() {
  check(cudaSetDevice(0), "cudaSetDevice");
  DeviceCount* d = nullptr;
  check(cudaMalloc(&d, sizeof *d), "cudaMalloc");
  const DeviceCount init{0, 0xffffffffu};
  check(cudaMemcpy(d, &init, sizeof init, cudaMemcpyHostToDevice), "cudaMemcpy");
  packed_decode_kernel<P><<<256, 256>>>(d);
  check(cudaGetLastError(), "launch");
  DeviceCount h{};
  check(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaFree(d), "cudaFree");
  return {h.count, h.first_bits};
}

// Thread (code byte, scale code): the packed GEMM's E2M1 decode (e2m1_bf16.hpp: byte permutes and
// the hardware's bf16x2 multiply) of a word of that byte against the host codec's value rounded to
// bf16, MX (E8M0 scale) when `nvfp4` is false, else NVFP4 (E4M3 scale); any NaN matches any NaN.
// It checks on the device what tests/e2m1_bf16_test.cpp checks with the multiply emulated: that
// mul.rn.bf16x2 keeps subnormal operands (MX scale 2^-127) and rounds once.
__global__ void e2m1_bf16_kernel(bool nvfp4, DeviceCount* out) {
  const std::uint32_t code = blockIdx.x, scale = threadIdx.x;  // 256 x 256
  const auto s8 = static_cast<std::uint8_t>(scale);
  const float scale_value = nvfp4 ? e4m3_to_float(s8) : e8m0_to_float(s8);
  std::uint32_t got[4];
  cuda::experts::e2m1x8_to_bf16(code * 0x01010101u, cuda::experts::bf16x2_scale(scale_value), got);
  for (int k = 0; k < 8; ++k) {
    const auto g = static_cast<std::uint16_t>(got[k / 2] >> (16 * (k % 2)));
    const auto nibble = static_cast<std::uint8_t>((k % 2 == 0 ? code : code >> 4) & 0xfu);
    const std::uint16_t want = float_to_bf16(e2m1_to_float(nibble) * scale_value);
    const bool g_nan = (g & 0x7f80u) == 0x7f80u && (g & 0x7fu) != 0;
    const bool w_nan = (want & 0x7f80u) == 0x7f80u && (want & 0x7fu) != 0;
    if (!(g == want || (g_nan && w_nan))) record(out, code << 8 | scale);
  }
}

// One CTA per row: encode_bf16_row into the row's payload (global memory) and its s_enc.
__global__ void encode_bf16_rows_kernel(const std::uint16_t* x, std::int64_t n, Precision precision,
                                        ScaleRounding rounding, std::uint8_t* payload,
                                        std::size_t stride, float* s_enc) {
  __shared__ float scratch[32];
  const float s = cuda::encode_bf16_row(x + blockIdx.x * n, n, precision, rounding,
                                        payload + blockIdx.x * stride, scratch);
  if (threadIdx.x == 0) s_enc[blockIdx.x] = s;
}

// A warp per row of 128: the held activate's encode of one 128-column step.
__global__ void nvfp4_lane_rows_kernel(const float* x, std::uint8_t* packed, std::uint8_t* scales,
                                       float* s_enc_out, std::uint16_t* h16) {
  const int lane = static_cast<int>(threadIdx.x);
  const float* row = x + blockIdx.x * 128;
  float v[4];
  std::uint32_t finite_amax = 0;
  for (int k = 0; k < 4; ++k) {
    v[k] = row[4 * lane + k];
    const std::uint32_t a = float_bits(v[k]) & kF32AbsMask;
    if (a < kF32InfBits) finite_amax = max(finite_amax, a);
  }
  const float s_enc = nvfp4_tensor_scale(bits_float(__reduce_max_sync(~0u, finite_amax)));
  const cuda::Nvfp4LaneBlock block = cuda::nvfp4_encode_lane(v, s_enc);
  const std::size_t r = blockIdx.x;
  packed[r * 64 + 2 * lane] = static_cast<std::uint8_t>(block.codes[0] | block.codes[1] << 4);
  packed[r * 64 + 2 * lane + 1] = static_cast<std::uint8_t>(block.codes[2] | block.codes[3] << 4);
  if (lane % 4 == 0) scales[r * 8 + lane / 4] = block.scale;
  *reinterpret_cast<uint2*>(h16 + r * 128 + 4 * lane) =
      cuda::nvfp4_lane_bf16(block, s_enc, cuda::RepeatedDivisor(s_enc));
  if (lane == 0) s_enc_out[r] = s_enc;
}

}  // namespace

Disagreements e2m1_bf16_decode_on_every_code(bool nvfp4) {
  check(cudaSetDevice(0), "cudaSetDevice");
  DeviceCount* d = nullptr;
  check(cudaMalloc(&d, sizeof *d), "cudaMalloc");
  const DeviceCount init{0, 0xffffffffu};
  check(cudaMemcpy(d, &init, sizeof init, cudaMemcpyHostToDevice), "cudaMemcpy");
  e2m1_bf16_kernel<<<256, 256>>>(nvfp4, d);
  check(cudaGetLastError(), "launch");
  DeviceCount h{};
  check(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaFree(d), "cudaFree");
  return {h.count, h.first_bits};
}

Disagreements packed_decode_on_every_code(Precision precision) {
  switch (precision) {
    case Precision::mxfp8:
      return packed_decode_check<Precision::mxfp8>();
    case Precision::mxfp4:
      return packed_decode_check<Precision::mxfp4>();
    case Precision::nvfp4:
      return packed_decode_check<Precision::nvfp4>();
    default:
      throw std::runtime_error("packed_decode_on_every_code: mxfp8, mxfp4 or nvfp4");
  }
}

Disagreements e2m1_vs_cuda_on_every_float() {
  return run_every_float(e2m1_vs_cuda_kernel);
}

Disagreements e4m3_vs_cuda_on_every_float() {
  return run_every_float(e4m3_vs_cuda_kernel);
}

void nvfp4_on_device(const std::vector<float>& x, std::int64_t rows, std::int64_t cols,
                     Nvfp4ScaleGroup group, Nvfp4Bytes* library, Nvfp4Bytes* cuda) {
  check(cudaSetDevice(0), "cudaSetDevice");
  const auto n = static_cast<std::size_t>(rows * cols);
  const std::int64_t nblocks = rows * cols / kNvfp4Block;
  const bool per_row = group == Nvfp4ScaleGroup::per_row;
  const std::size_t n_scales = per_row ? static_cast<std::size_t>(rows) : 1;
  float* dx = device_alloc<float>(n);
  float* s_enc = device_alloc<float>(n_scales);
  std::uint8_t* packed[2] = {device_alloc<std::uint8_t>(n / 2), device_alloc<std::uint8_t>(n / 2)};
  std::uint8_t* scales[2] = {device_alloc<std::uint8_t>(n / kNvfp4Block),
                             device_alloc<std::uint8_t>(n / kNvfp4Block)};
  check(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  quantize_nvfp4_cuda({"quantize_nvfp4", "x", 0, nullptr}, dx, rows, cols, group, nullptr,
                      packed[0], scales[0], s_enc);
  nvfp4_cuda_reference_kernel<<<kBlocks, kThreads>>>(dx, nblocks, cols / kNvfp4Block, s_enc,
                                                     per_row, packed[1], scales[1]);
  check(cudaGetLastError(), "launch");
  Nvfp4Bytes* out[2] = {library, cuda};
  for (int k = 0; k < 2; ++k) {
    out[k]->packed = to_host(packed[k], n / 2);
    out[k]->scales = to_host(scales[k], n / kNvfp4Block);
    out[k]->s_enc = to_host(s_enc, n_scales);
    check(cudaFree(packed[k]), "cudaFree");
    check(cudaFree(scales[k]), "cudaFree");
  }
  check(cudaFree(dx), "cudaFree");
  check(cudaFree(s_enc), "cudaFree");
}

void fp8_block128_on_device(const std::vector<float>& x, std::int64_t rows, std::int64_t cols,
                            Fp8Blocks blocks, Fp8Block128Bytes* library, Fp8Block128Bytes* cuda) {
  check(cudaSetDevice(0), "cudaSetDevice");
  const auto n = static_cast<std::size_t>(rows * cols);
  const std::int64_t rows_per_block = blocks == Fp8Blocks::row_1x128 ? 1 : 128;
  const auto n_scales =
      static_cast<std::size_t>((rows + rows_per_block - 1) / rows_per_block * ((cols + 127) / 128));
  float* dx = device_alloc<float>(n);
  std::uint8_t* elements[2] = {device_alloc<std::uint8_t>(n), device_alloc<std::uint8_t>(n)};
  float* scales[2] = {device_alloc<float>(n_scales), device_alloc<float>(n_scales)};
  check(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  quantize_fp8_block128_cuda({"quantize_fp8_block128", "x", 0, nullptr}, dx, 1, rows, cols, blocks,
                             elements[0], scales[0]);
  fp8_block128_cuda_reference_kernel<<<kBlocks, kThreads>>>(dx, rows, cols, rows_per_block,
                                                            elements[1], scales[1]);
  check(cudaGetLastError(), "launch");
  Fp8Block128Bytes* out[2] = {library, cuda};
  for (int k = 0; k < 2; ++k) {
    out[k]->elements = to_host(elements[k], n);
    out[k]->scales = to_host(scales[k], n_scales);
    check(cudaFree(elements[k]), "cudaFree");
    check(cudaFree(scales[k]), "cudaFree");
  }
  check(cudaFree(dx), "cudaFree");
}

void mxfp4_on_device(const std::vector<float>& x, std::int64_t rows, std::int64_t cols,
                     ScaleRounding rounding, Mxfp4Bytes* library, Mxfp4Bytes* cuda) {
  check(cudaSetDevice(0), "cudaSetDevice");
  const auto n = static_cast<std::size_t>(rows * cols);
  const std::int64_t nblocks = rows * cols / kMxfp8Block;
  float* dx = device_alloc<float>(n);
  std::uint8_t* packed[2] = {device_alloc<std::uint8_t>(n / 2), device_alloc<std::uint8_t>(n / 2)};
  std::uint8_t* scales[2] = {device_alloc<std::uint8_t>(n / kMxfp8Block),
                             device_alloc<std::uint8_t>(n / kMxfp8Block)};
  check(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  quantize_mxfp4_cuda({"quantize_mxfp4", "x", 0, nullptr}, dx, rows, cols, rounding, packed[0],
                      scales[0]);
  mxfp4_cuda_reference_kernel<<<kBlocks, kThreads>>>(dx, nblocks, rounding == ScaleRounding::rceil,
                                                     scales[0], packed[1], scales[1]);
  check(cudaGetLastError(), "launch");
  Mxfp4Bytes* out[2] = {library, cuda};
  for (int k = 0; k < 2; ++k) {
    out[k]->packed = to_host(packed[k], n / 2);
    out[k]->scales = to_host(scales[k], n / kMxfp8Block);
    check(cudaFree(packed[k]), "cudaFree");
    check(cudaFree(scales[k]), "cudaFree");
  }
  check(cudaFree(dx), "cudaFree");
}

WireRows encode_bf16_rows_on_device(const std::vector<std::uint16_t>& x, std::int64_t rows,
                                    std::int64_t n, Precision precision, ScaleRounding rounding,
                                    int warps) {
  WireRows out;
  out.stride = (protocol::wire_payload_bytes(precision, n) + 15) / 16 * 16;
  out.payload.resize(static_cast<std::size_t>(rows) * out.stride);
  out.s_enc.resize(static_cast<std::size_t>(rows));
  std::uint16_t* x_d = nullptr;
  std::uint8_t* payload_d = nullptr;
  float* s_enc_d = nullptr;
  check(cudaMalloc(&x_d, x.size() * sizeof(std::uint16_t)), "cudaMalloc");
  check(cudaMalloc(&payload_d, out.payload.size()), "cudaMalloc");
  check(cudaMalloc(&s_enc_d, out.s_enc.size() * sizeof(float)), "cudaMalloc");
  check(cudaMemcpy(x_d, x.data(), x.size() * sizeof(std::uint16_t), cudaMemcpyHostToDevice),
        "cudaMemcpy");
  check(cudaMemset(payload_d, 0xa5, out.payload.size()), "cudaMemset");  // bytes never written show
  encode_bf16_rows_kernel<<<static_cast<unsigned>(rows), static_cast<unsigned>(32 * warps)>>>(
      x_d, n, precision, rounding, payload_d, out.stride, s_enc_d);
  check(cudaGetLastError(), "encode_bf16_rows_kernel");
  check(cudaMemcpy(out.payload.data(), payload_d, out.payload.size(), cudaMemcpyDeviceToHost),
        "cudaMemcpy");
  check(cudaMemcpy(out.s_enc.data(), s_enc_d, out.s_enc.size() * sizeof(float),
                   cudaMemcpyDeviceToHost),
        "cudaMemcpy");
  check(cudaFree(x_d), "cudaFree");
  check(cudaFree(payload_d), "cudaFree");
  check(cudaFree(s_enc_d), "cudaFree");
  return out;
}

Nvfp4LaneRows nvfp4_lane_rows_on_device(const std::vector<float>& x, std::int64_t rows) {
  check(cudaSetDevice(0), "cudaSetDevice");
  const auto n = static_cast<std::size_t>(rows) * 128;
  float* x_d = device_alloc<float>(n);
  std::uint8_t* packed_d = device_alloc<std::uint8_t>(n / 2);
  std::uint8_t* scales_d = device_alloc<std::uint8_t>(n / kNvfp4Block);
  float* s_enc_d = device_alloc<float>(static_cast<std::size_t>(rows));
  std::uint16_t* h16_d = device_alloc<std::uint16_t>(n);
  check(cudaMemcpy(x_d, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  nvfp4_lane_rows_kernel<<<static_cast<unsigned>(rows), 32>>>(x_d, packed_d, scales_d, s_enc_d,
                                                              h16_d);
  check(cudaGetLastError(), "nvfp4_lane_rows_kernel");
  Nvfp4LaneRows out;
  out.packed = to_host(packed_d, n / 2);
  out.scales = to_host(scales_d, n / kNvfp4Block);
  out.s_enc = to_host(s_enc_d, static_cast<std::size_t>(rows));
  out.h16 = to_host(h16_d, n);
  check(cudaFree(x_d), "cudaFree");
  check(cudaFree(packed_d), "cudaFree");
  check(cudaFree(scales_d), "cudaFree");
  check(cudaFree(s_enc_d), "cudaFree");
  check(cudaFree(h16_d), "cudaFree");
  return out;
}

}  // namespace epmoe::test

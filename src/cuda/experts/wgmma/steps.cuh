// The wgmma backend's steps around its GEMMs as device functions of the whole grid: plan (each
// expert's M and operand pointers), gather (each pair's row into FC1's operand) and, after FC2,
// sending its staged rows home. Run by the chain's kernels (steps.cu) and by the persistent round
// (docs/design.md §4.3).
#pragma once

#include "cuda/experts/common.cuh"
#include "cuda/experts/packed_weights.cuh"  // e4m3x2_scaled_to_bf16x2
#include "cuda/experts/pair_list.cuh"
#include "cuda/experts/wgmma/steps.hpp"
#include "formats/quantized_weights.hpp"  // fp8_block128_tile
#include "math/expert_row.hpp"            // math::biased, math::unscaled

namespace epmoe::cuda::experts::wgmma {

// FC2's output as bf16 rows (GemmOutput::bf16_rows): [pairs, H] codes in scratch.d.
__device__ inline std::uint16_t* fc2_rows(const Params& p) {
  return reinterpret_cast<std::uint16_t*>(p.scratch.d);
}
// The bias row that FC2's bf16_rows epilogue adds for expert e: its b2, or the GEMM's zero row.
__device__ inline const float* fc2_bias(const Params& p, int e, const float* zero_bias) {
  return p.biases.b2 == nullptr ? zero_bias : p.biases.b2 + e * p.problem.hidden;
}

// Each expert's M and operand pointers into both GEMMs' device arrays (M = 0 for every expert when
// this rank's round already failed, `skip`: the GEMMs then do nothing), by one CTA's threads. Run
// by CTA 0 of plan_and_gather, the GEMMs' previous kernel (its own launch cost a kernel boundary
// per round: 3.7 us at T = 1, ncu), or in the persistent round.
__device__ inline void plan_gemms(const Params& p, bool skip) {
  const std::int64_t hidden = p.problem.hidden, inter = p.problem.intermediate;
  const int h = static_cast<int>(hidden), i = static_cast<int>(inter);
  constexpr std::int64_t kBlock = formats::kFp8Block128;
  for (int e = static_cast<int>(threadIdx.x); e < p.problem.local_experts; e += blockDim.x) {
    const std::uint32_t first = skip ? 0u : p.step.in.pair_offset[e];
    const int m = skip ? 0 : static_cast<int>(p.step.in.pair_offset[e + 1] - first);
    if (p.fp8() && !p.packed_e4m3) {  // CUTLASS's blockwise GEMMs
      const Fp8BlockWeights& w = p.fp8_weights;
      p.fp8_fc1.problems[e] = GemmProblem{m, 2 * i, h};
      p.fp8_fc1.a[e] = p.scratch.a8 + first * hidden;
      p.fp8_fc1.sfa[e] = p.scratch.a8_scale + first * (hidden / kBlock);
      p.fp8_fc1.b[e] = w.w13.codes + e * 2 * inter * hidden;
      p.fp8_fc1.sfb[e] = w.w13.scales + formats::fp8_block128_tile(2 * inter, hidden, e, 0);
      p.fp8_fc1.d[e] = p.scratch.d + first * 2 * inter;
      p.fp8_fc2.problems[e] = GemmProblem{m, h, i};
      p.fp8_fc2.a[e] = p.scratch.h8 + first * inter;
      p.fp8_fc2.sfa[e] = p.scratch.h8_scale + first * (inter / kBlock);
      p.fp8_fc2.b[e] = w.w2.codes + e * hidden * inter;
      p.fp8_fc2.sfb[e] = w.w2.scales + formats::fp8_block128_tile(hidden, inter, e, 0);
      p.fp8_fc2.d[e] = p.scratch.d + first * hidden;
      p.fp8_fc2.d16[e] = fc2_rows(p) + first * hidden;
      p.fp8_fc2.bias[e] = fc2_bias(p, e, p.fp8_fc2.zero_bias);
      continue;
    }
    if (p.packed() || p.packed_e4m3) {
      p.packed_fc1.problems[e] = GemmProblem{m, 2 * i, h};
      p.packed_fc1.b13[e] = p.biases.b13 == nullptr ? nullptr : p.biases.b13 + e * 2 * inter;
      p.packed_fc2.problems[e] = GemmProblem{m, h, i};
      p.packed_fc2.b13[e] = nullptr;
      p.packed_fc2.d[e] = p.scratch.d + first * hidden;
      p.packed_fc2.d16[e] = fc2_rows(p) + first * hidden;
      p.packed_fc2.row_scale[e] = p.fc1_made_h() || p.fp8() ? nullptr : p.scratch.h_scale + first;
      p.packed_fc2.bias[e] = p.biases.b2 == nullptr ? nullptr : p.biases.b2 + e * hidden;
      if (p.packed_e4m3) {  // E4M3 rows: codes and 1 x 32 (MXFP8) or 1 x 128 scale values
        const std::int64_t block = e4m3_scale_block(p.problem);
        p.packed_fc1.a8[e] = p.scratch.a8 + first * hidden;
        p.packed_fc1.a8_scale[e] = p.scratch.a8_scale + first * (hidden / block);
        p.packed_fc1.d[e] = p.scratch.d + first * 2 * inter;  // (fp8_block128: activate reads it)
        p.packed_fc1.h8[e] = p.scratch.h8 + first * inter;    // (mxfp8, mxfp4: FC1 activates)
        p.packed_fc1.h8_scale[e] = p.scratch.h8_scale + first * (inter / block);
        p.packed_fc2.a8[e] = p.scratch.h8 + first * inter;
        p.packed_fc2.a8_scale[e] = p.scratch.h8_scale + first * (inter / block);
      } else {
        p.packed_fc1.a[e] = p.scratch.a1 + first * hidden;
        p.packed_fc1.d[e] = p.scratch.d + first * 2 * inter;
        p.packed_fc1.h[e] = p.scratch.h16 + first * inter;  // these two read when FC1 activates
        p.packed_fc2.a[e] = p.scratch.h16 + first * inter;
      }
      continue;
    }
    // bf16: FC1 activates in its epilogue (glu)
    p.glu_fc1.problems[e] = GemmProblem{m, 2 * i, h};
    p.glu_fc1.a[e] = p.scratch.a1 + first * hidden;
    p.glu_fc1.b[e] = p.weights.w13 + e * 2 * inter * hidden;
    p.glu_fc1.h[e] = p.scratch.h16 + first * inter;
    p.glu_fc1.b13[e] = p.biases.b13 == nullptr ? nullptr : p.biases.b13 + e * 2 * inter;
    p.fc2.problems[e] = GemmProblem{m, h, i};
    p.fc2.a[e] = p.scratch.h16 + first * inter;
    p.fc2.b[e] = p.weights.w2 + e * hidden * inter;
    p.fc2.d[e] = p.scratch.d + first * hidden;
    p.fc2.d16[e] = fc2_rows(p) + first * hidden;
    p.fc2.bias[e] = fc2_bias(p, e, p.fc2.zero_bias);
  }
}

// 8 E4M3 codes (two words, low byte first) of one MX block times its scale value, as bf16 codes:
// the wire codec's decode (mxfp8_decode_value) rounded by float_to_bf16, as route stages rows
// for the other precisions, bit for bit (e4m3x2_scaled_to_bf16x2).
__device__ inline uint4 mxfp8x8_to_bf16(std::uint32_t lo, std::uint32_t hi, float scale) {
  const std::uint32_t words[2] = {lo, hi};
  std::uint32_t out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    out[j] =
        e4m3x2_scaled_to_bf16x2(static_cast<std::uint16_t>(words[j / 2] >> (16 * (j % 2))), scale);
  return make_uint4(out[0], out[1], out[2], out[3]);
}

constexpr int kLoads = 4;  // 16-byte loads in flight per lane and operand (gather, activate, home)

// A warp's walk over a row of `count` 16-byte vectors (strided_vectors over its lanes).
template <int kAhead = kLoads, class Vector, class Use>
__device__ __forceinline__ void lane_vectors(const Vector* row, std::int64_t count, int lane,
                                             Use use) {
  strided_vectors<kAhead>(row, count, lane, 32, use);
}

// One received row into FC1's operand at `count` pairs' places, to(k) for k < count (called per
// 16-byte vector by the lanes that hold it, so not by every lane alike where H / 16 is not a
// multiple of 32: it must not shuffle; kOnePlace: count is 1), by one warp with 16-byte copies (H
// is a multiple of 64; lane_vectors' loads in flight), the row loaded once: the staged bf16 row
// (x16's row `x_row`), or (E4M3 operands) the received row's wire payload itself, its E4M3 codes
// and its block scales as fp32 values (fp8_block128's 1 x 128 fp32 scales; MXFP8's 1 x 32 E8M0
// codes decoded: mxfp8, mxfp4), or (MXFP8 rows in a bucket whose GEMMs take bf16 rows) that payload
// decoded to bf16 codes, exact (an E4M3 value times a power of two). Route checked the rows and
// staged nothing for them. kAhead: loads in flight per lane. (The places are read per store, not
// held in an array: an array of kMaxTopK places took the kernel from 80 to 157 registers.)
template <int kAhead, bool kOnePlace, class To>
__device__ inline void gather_row(const Params& p, const std::uint8_t* payload, std::uint32_t x_row,
                                  int count, To to, int lane) {
  const std::int64_t hidden = p.problem.hidden;
  // store(pair) at every place
  const auto to_every_place = [&](auto store) {
    if constexpr (kOnePlace) {
      store(static_cast<std::size_t>(to(0)));
    } else {
#pragma unroll 1
      for (int k = 0; k < count; ++k) store(static_cast<std::size_t>(to(k)));
    }
  };
  if (const int block = e4m3_scale_block(p.problem); block != 0) {
    const auto* codes = reinterpret_cast<const uint4*>(payload);
    if (p.packed() && !p.packed_e4m3) {  // MXFP8 rows as bf16 (mxfp8, mxfp4)
      // 8 codes per lane and vector, so that each lane's 16 bf16 bytes lie next to its
      // neighbours': a warp's store is 512 contiguous bytes (16 codes per lane stored 32-byte
      // strided halves, twice the stores' sectors at every place)
      lane_vectors<kAhead>(reinterpret_cast<const uint2*>(payload), hidden / 8, lane,
                           [&](std::int64_t v, uint2 c) {  // 8 codes of one MX block
                             const float scale =
                                 formats::e8m0_to_float(payload[hidden + 8 * v / block]);
                             const uint4 bf16 = mxfp8x8_to_bf16(c.x, c.y, scale);
                             to_every_place([&](std::size_t pair) {
                               reinterpret_cast<uint4*>(p.scratch.a1 + pair * hidden)[v] = bf16;
                             });
                           });
      return;
    }
    lane_vectors<kAhead>(codes, hidden / 16, lane, [&](std::int64_t v, uint4 c) {
      to_every_place(
          [&](std::size_t pair) { reinterpret_cast<uint4*>(p.scratch.a8 + pair * hidden)[v] = c; });
    });
    const std::int64_t blocks = hidden / block;
    for (std::int64_t b = lane; b < blocks; b += 32) {
      const float scale = p.fp8() ? reinterpret_cast<const float*>(payload + hidden)[b]
                                  : formats::e8m0_to_float(payload[hidden + b]);  // (MXFP8)
      to_every_place([&](std::size_t pair) { p.scratch.a8_scale[pair * blocks + b] = scale; });
    }
    return;
  }
  const auto* src = reinterpret_cast<const uint4*>(p.step.in.x16 + x_row * hidden);
  lane_vectors<kAhead>(src, hidden / 8, lane, [&](std::int64_t v, uint4 c) {
    to_every_place(
        [&](std::size_t pair) { reinterpret_cast<uint4*>(p.scratch.a1 + pair * hidden)[v] = c; });
  });
}

// This rank's receive row of `packed`'s pair this round, past its header and entries.
__device__ inline const std::uint8_t* pair_payload(const Params& p, std::uint32_t round,
                                                   std::uint32_t packed) {
  const TokenBackTarget& t = p.step.home;
  return t.peer_windows[t.rank] + t.layout.recv_row(round, pair_src(packed), pair_row(packed)) +
         protocol::wire_payload_offset(t.top_k);
}

// The round's pairs into FC1's operand, one warp per pair (gather_row with one place), grid-stride
// over the pair list bucket wrote (`round`: whose receive rows), with each pair's home slot where
// FC2 sends the results home (Params::fc2_sends_home). The persistent E4M3 round runs it after its
// bucket step. kCtaThreads: the CTA's threads (blockDim.x); kAhead: loads in flight per lane (the
// persistent E4M3 round takes 1: more made it spill).
template <int kCtaThreads, int kAhead = kLoads>
__device__ inline void gather_rows(const Params& p, std::uint32_t round) {
  const ExpertInputs& in = p.step.in;
  const std::uint32_t pairs = in.pair_offset[p.problem.local_experts];
  const std::uint32_t warps = kCtaThreads / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (std::uint32_t pair = blockIdx.x * warps + warp; pair < pairs; pair += gridDim.x * warps) {
    const std::uint32_t packed = in.pairs[pair];
    if (p.fc2_sends_home && lane == 0)  // (FC2 sends the results home: their slots)
      p.scratch.homes[pair] = home_slot(p.step.home, round, packed);
    gather_row<kAhead, true>(
        p, pair_payload(p, round, packed), x_row_of_pair(in, packed), 1, [&](int) { return pair; },
        static_cast<int>(lane));
  }
}

// bucket and the gather in one step, one warp per received row, grid-stride (the chain's first
// kernel of the wgmma backend: ExpertBackend::buckets_pairs): the row's entries appended to their
// experts' parts of the pair list (a lane per entry, with its home slot where FC2 sends home:
// Params::fc2_sends_home), then the row copied once into FC1's operand at each of its pairs' places
// (which the lanes leave in shared memory for the whole warp). Route has counted, checked and
// placed every expert's part (pair_offset). kCtaThreads: blockDim.x.
template <int kCtaThreads>
__device__ inline void bucket_and_gather_rows(const Params& p, std::uint32_t round) {
  const ExpertInputs& in = p.step.in;
  const TokenBackTarget& t = p.step.home;
  __shared__ std::uint32_t places[kCtaThreads / 32][kMaxTopK];
  const std::uint32_t* rows_from = p.step.state->rows_from;
  const std::uint32_t total = received_rows(p.step.state, t.layout.world);
  const std::uint32_t warps = kCtaThreads / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (std::uint32_t item = blockIdx.x * warps + warp; item < total; item += gridDim.x * warps) {
    int src;
    std::uint32_t r;
    locate_row(rows_from, item, src, r);
    const std::uint8_t* row = t.peer_windows[t.rank] + t.layout.recv_row(round, src, r);
    const auto* header = reinterpret_cast<const protocol::WireRowHeader*>(row);
    const int count = header->num_entries;  // (checked by route: at most top_k)
    if (static_cast<int>(lane) < count) {
      const protocol::WireEntry entry =
          reinterpret_cast<const protocol::WireEntry*>(row + protocol::wire_entries_offset())[lane];
      const std::uint32_t at = append_pair(p.step.sink, in.pair_offset, entry.local_expert, src,
                                           static_cast<int>(lane), r);
      if (p.fc2_sends_home) p.scratch.homes[at] = protocol::home_slot(src, *header, entry);
      places[warp][lane] = at;
    }
    __syncwarp();
    gather_row<kLoads, false>(
        p, row + protocol::wire_payload_offset(t.top_k),
        static_cast<std::uint32_t>(src * in.max_tokens) + r, count,
        [&](int k) { return places[warp][k]; }, static_cast<int>(lane));
    __syncwarp();  // (every lane past its reads of `places` before the next row writes them)
  }
}

// Expert e's weights of one FC (WeightFactors): bf16's are the values; fp8's GEMM applied its
// block scales.
__device__ inline WeightFactors weight_factors(const Params& p, bool fc1, int e) {
  if (p.packed()) return weight_factors(fc1 ? p.packed_weights.w13 : p.packed_weights.w2, e);
  return WeightFactors{};
}

// One warp per pair (warps in flight per CTA, no CTA barrier between them), grid-stride over the
// round's pairs: FC2's staged fp32 sums (scratch d) over both scales (RowUnscale), b2, the result
// home (send_home_n), four columns per lane per step; or FC2's bf16 rows (fc2_made_rows) copied
// home, eight columns per lane per step. The chain's home kernel runs it, and the persistent E4M3
// round with token_back=dispatch_warps. kCtaThreads: the CTA's threads; kMayCopyRows: whether FC2
// may have stored bf16 rows (the E4M3 tile stores sums: the persistent E4M3 round compiles without
// the copy, whose registers made it spill).
template <int kCtaThreads, bool kMayCopyRows = true>
__device__ inline void send_rows_home(const Params& p, std::uint32_t round) {
  const ExpertInputs& in = p.step.in;
  const std::int64_t hidden = p.problem.hidden;
  const std::uint32_t pairs = in.pair_offset[p.problem.local_experts];
  const std::uint32_t warps = kCtaThreads / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (std::uint32_t pair = blockIdx.x * warps + warp; pair < pairs; pair += gridDim.x * warps) {
    HomeSlot home{};
    int e = 0;
    if (lane == 0) {
      home = home_slot(p.step.home, round, in.pairs[pair]);
      if (!(kMayCopyRows && p.fc2_made_rows()))
        e = expert_of_pair(in, p.problem.local_experts, pair);
    }
    home.rank = __shfl_sync(0xffffffffu, home.rank, 0);
    home.token = __shfl_sync(0xffffffffu, home.token, 0);
    home.slot = __shfl_sync(0xffffffffu, home.slot, 0);
    home.weight = __shfl_sync(0xffffffffu, home.weight, 0);
    if (kMayCopyRows && p.fc2_made_rows()) {  // bf16(sum + b2), as below, already: copies
      const auto* rows = reinterpret_cast<const uint4*>(fc2_rows(p) + pair * hidden);
      lane_vectors(rows, hidden / 8, lane, [&](std::int64_t c8, uint4 codes) {
        send_home_bf16x8(p.step.home, home, c8, codes);
      });
      continue;
    }
    e = __shfl_sync(0xffffffffu, e, 0);
    const float h_scale = p.fp8() || p.fc1_made_h() ? 1.0f : p.scratch.h_scale[pair];
    const RowUnscale value(h_scale, weight_factors(p, false, e));
    const auto* d =
        reinterpret_cast<const float4*>(p.scratch.d + static_cast<std::size_t>(pair) * hidden);
    const float* b2 = p.biases.b2 == nullptr ? nullptr : p.biases.b2 + e * hidden;
    lane_vectors(d, hidden / 4, lane, [&](std::int64_t c4, float4 v) {
      const float sums[4] = {v.x, v.y, v.z, v.w};
      float out[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) out[i] = math::biased(value(sums[i]), b2, 4 * c4 + i);
      send_home_n<4>(p.step.home, home, c4, out);
    });
  }
}

}  // namespace epmoe::cuda::experts::wgmma

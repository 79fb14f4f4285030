// A tile's weight rows as the backends' pipelines read them (docs/design.md §4.1): 128 weight rows
// in two groups of 64 consecutive matrix rows (FC1: 64 gate rows and the 64 up rows of the same
// columns; FC2: 128 hidden rows, a tail group past the hidden size repeating the first group),
// resident in the layer's format (resident.hpp). One k slab of them is copied into shared memory
// as it is stored (compressed elements and scale records, 16-byte cp.async copies), and each
// thread then decodes one run of 32 elements of one row with resident.hpp's decoders into the
// operand layout of its tile.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/experts/common.cuh"
#include "cuda/experts/resident.hpp"

namespace epmoe::cuda::experts {

inline constexpr int kSlabRows = 2 * kRowGroup;  // weight rows of a tile

// Where a tile's weight rows live: raw row i (0..127) of the tile is matrix row
// first_row[i / 64] + i % 64 of one expert; both first rows are multiples of 64. Pointers are
// taken once per tile, so the pipeline's copies cost an add per row.
struct WeightTile {
  const std::uint8_t* rows;     // group 0's first row, k = 0
  const std::uint8_t* records;  // group 0's scale record for slab 0 (slab s: + s * record bytes)
  std::int64_t record_delta;    // bytes from group 0's records to group 1's
  int row_delta;                // rows from group 0 to group 1 (at most 2 x 65,536)
  int row_bytes;                // bytes per matrix row (at most 2 x 65,536)

  // NOTES: one base pointer and small offsets, not a pointer per group: the mma tile's loop keeps
  // this next to 80 registers of fragments, at 128 registers.
  __device__ const std::uint8_t* row(int i) const {
    return rows +
           static_cast<std::int64_t>((i < kRowGroup ? 0 : row_delta) + i % kRowGroup) * row_bytes;
  }
  __device__ const std::uint8_t* record(int g) const {
    return records + (g == 0 ? 0 : record_delta);
  }
};

// The tile of rows [first_row0, + 64) and [first_row1, + 64) of `expert` in `m` (in precision P).
template <Precision P>
__device__ inline WeightTile weight_tile(const ResidentMatrices& m, std::int64_t expert,
                                         std::int64_t first_row0, std::int64_t first_row1) {
  WeightTile t{};
  t.rows = m.run(expert, first_row0, 0);
  t.row_delta = static_cast<int>(first_row1 - first_row0);
  t.row_bytes = static_cast<int>(m.row_bytes());
  if constexpr (P != Precision::bf16) {
    t.records = m.scale_record(expert, first_row0 / kRowGroup, 0);
    t.record_delta = m.scale_record(expert, first_row1 / kRowGroup, 0) - t.records;
  }
  return t;
}

// The matrix's NVFP4 s_enc (1 for the other formats).
template <Precision P>
__device__ inline float weight_s_enc(const ResidentMatrices& m, std::int64_t expert) {
  return P == Precision::nvfp4 ? m.s_enc[expert] : 1.0f;
}

// One k slab of a tile's weight rows in shared memory, as stored. kScaleSlab k per slab.
template <Precision P>
struct RawSlab {
  static constexpr int kRowBytes = kScaleSlab * element_bits(P) / 8;       // 128, 64 or 32
  static constexpr int kRecordBytes = kRowGroup * scales_per_slab_row(P);  // 0, 128 or 256
  std::uint8_t rows[kSlabRows][kRowBytes];
  std::uint8_t scales[2][kRecordBytes > 0 ? kRecordBytes : 16];

  // Row i's run `half` (k 32 half ... 32 half + 31 of the slab) and its first scale.
  __device__ const std::uint8_t* run(int i, int half) const {
    return rows[i] + half * run_bytes(P);
  }
  __device__ const std::uint8_t* run_scale(int i, int half) const {
    return scales[i / kRowGroup] + (i % kRowGroup) * scales_per_slab_row(P) + half * run_scales(P);
  }
};

// Queues the cp.async copies of slab `slab` of `tile` into `raw` (every thread of the CTA calls
// it; the caller commits).
template <Precision P, int Threads>
__device__ __forceinline__ void load_raw_slab(RawSlab<P>& raw, const WeightTile& tile, int slab) {
  constexpr int kRowCopies = RawSlab<P>::kRowBytes / 16;
  constexpr int kRecordCopies = RawSlab<P>::kRecordBytes / 16;
  static_assert(kSlabRows * kRowCopies % Threads == 0, "every thread copies as many rows");
  const int offset = slab * RawSlab<P>::kRowBytes;  // of the slab in a row
#pragma unroll
  for (int j = 0; j < kSlabRows * kRowCopies / Threads; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * Threads;
    const int row = i / kRowCopies, q = i % kRowCopies;
    cp_async_16(&raw.rows[row][16 * q], tile.row(row) + offset + 16 * q);
  }
  if constexpr (kRecordCopies > 0) {
    for (int i = threadIdx.x; i < 2 * kRecordCopies; i += Threads) {
      const int g = i / kRecordCopies, q = i % kRecordCopies;
      cp_async_16(&raw.scales[g][16 * q],
                  tile.record(g) + slab * RawSlab<P>::kRecordBytes + 16 * q);
    }
  }
}

// A run of raw bytes from shared memory into registers, 16 bytes at a time.
template <int Bytes>
struct alignas(16) RunBytes {
  std::uint8_t b[Bytes];
};
template <int Bytes>
__device__ __forceinline__ RunBytes<Bytes> load_run(const std::uint8_t* smem) {
  static_assert(Bytes % 16 == 0, "runs are whole 16-byte vectors");
  RunBytes<Bytes> r;
#pragma unroll
  for (int i = 0; i < Bytes / 16; ++i)
    reinterpret_cast<uint4*>(r.b)[i] = reinterpret_cast<const uint4*>(smem)[i];
  return r;
}

}  // namespace epmoe::cuda::experts

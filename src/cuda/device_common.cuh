// Device-side pieces every epmoe kernel uses: the protocol's platform (clock + backoff), peers as
// LSA base pointers, the failure path of a bounded wait, the "last CTA publishes" ticket, and the
// per-phase timing stamps.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/pdl.cuh"
#include "cuda/round_params.hpp"
#include "epmoe/errors.hpp"
#include "protocol/round.hpp"

namespace epmoe::cuda {

struct DevicePlatform {
  __host__ __device__ std::uint64_t now_ns() const {
#if defined(__CUDA_ARCH__)
    std::uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#else
    return 0;
#endif
  }
  // __nanosleep from 64 ns doubling to 2 us: cheap for the NVLink round trip, polite to the SM.
  __host__ __device__ void pause(std::uint32_t attempt) const {
#if defined(__CUDA_ARCH__)
    const std::uint32_t shift = attempt < 16 ? attempt / 4 : 5;
    __nanosleep(64u << shift);
#else
    (void)attempt;
#endif
  }
};

// Per-phase timing (docs/design.md §4.2). Thread 0 of every CTA stamps the clock when its kernel of
// a phase starts (atomicMin into the round's begin) and when it leaves (atomicMax into the end), so
// a phase spans its kernels' first CTA start to last CTA end. Off (the default) the record is null
// and a stamp costs a branch.
struct PhaseClock {
  PhaseRecord* record;  // this round's, or nullptr when timing is off

  __device__ void begin(RoundPhase p) const {
    if (record != nullptr && threadIdx.x == 0)
      atomicMin(slot(record->begin[static_cast<int>(p)]), DevicePlatform{}.now_ns());
  }
  __device__ void end(RoundPhase p) const {
    if (record != nullptr && threadIdx.x == 0)
      atomicMax(slot(record->end[static_cast<int>(p)]), DevicePlatform{}.now_ns());
  }

 private:
  __device__ static unsigned long long* slot(std::uint64_t& t) {
    static_assert(sizeof(unsigned long long) == sizeof(std::uint64_t));
    return reinterpret_cast<unsigned long long*>(&t);
  }
};

// Round `round`'s record when timing is on (read by thread 0 with the round).
__device__ inline PhaseClock phase_clock(RoundState* state, std::uint32_t round) {
  return PhaseClock{state->timing != 0 ? &state->phases[round & 1u] : nullptr};
}

// How a kernel stamps its phase: both ends, or only the end when the kernel before it in the same
// phase cannot stamp (wgmma's home, after CUTLASS's FC2 GEMM): that phase then begins where the one
// before it ended (phase_times, core/phase_record.hpp).
enum class Stamps : std::uint8_t { begin_and_end, end_only };

struct DevicePeers {
  std::uint8_t* const* windows;
  __host__ __device__ std::uint8_t* window(int rank) const { return windows[rank]; }
};
using DeviceSession = protocol::RoundSession<DevicePeers>;

__device__ inline void publish_health(HealthRecord* h) {
  __threadfence_system();
  protocol::system_ref<std::uint32_t>(h->published).store(1, ::cuda::std::memory_order_release);
}

// I3 on the GPU: the first failing thread of this rank writes the record, raises abort on every
// peer (only when it detected the failure itself), and marks the round state failed so every
// later kernel of this rank returns at once. One thread calls it; the kernel then returns.
__device__ inline void fail_round(const RoundParams& p, const DeviceSession& session,
                                  const protocol::WaitOutcome& w, Phase phase) {
  using protocol::WaitStatus;
  const int culprit =
      w.status == WaitStatus::violation ? session.violation_culprit(w.peer) : w.peer;
  if (w.status != WaitStatus::aborted) session.raise_abort(phase, culprit);
  protocol::system_ref<std::uint32_t>(p.state->failed).store(1, ::cuda::std::memory_order_relaxed);
  std::uint32_t expected = 0;
  if (!protocol::system_ref<std::uint32_t>(p.health->claimed)
           .compare_exchange_strong(expected, 1u, ::cuda::std::memory_order_acq_rel))
    return;
  HealthRecord* h = p.health;
  h->rank = p.rank;
  h->round = session.round();
  h->expected = session.round();
  h->observed = w.observed;
  if (w.status == WaitStatus::aborted) {
    const protocol::AbortRecord a = protocol::unpack_abort(w.abort_word);
    h->code = static_cast<std::uint32_t>(ErrorCode::peer_aborted);
    h->peer = a.culprit == protocol::kUnknownRank ? -1 : static_cast<std::int32_t>(a.culprit);
    h->reporter = static_cast<std::int32_t>(a.reporter);
    h->phase = a.phase;
    h->round = a.round;
  } else {
    h->code = static_cast<std::uint32_t>(
        w.status == WaitStatus::timeout ? ErrorCode::timeout : ErrorCode::protocol_violation);
    h->peer = culprit;
    h->reporter = p.rank;
    h->phase = static_cast<std::uint32_t>(phase);
  }
  publish_health(h);
}

// Whether this rank's round already failed (read by one thread per CTA at kernel start).
__device__ inline bool round_failed(RoundState* state) {
  return protocol::system_ref<std::uint32_t>(state->failed)
             .load(::cuda::std::memory_order_relaxed) != 0;
}

// What every CTA of a round's kernel knows when it starts: the round, whether to do nothing
// because this rank's round already failed (or failed in this kernel's wait), and the phase the
// kernel belongs to with the round's clock (PhaseEnd stamps its end).
struct RoundStart {
  std::uint32_t round;
  bool skip;
  RoundPhase phase;
  PhaseClock clock;
};

// Stamps the end of the kernel's phase when the kernel leaves the scope it is declared in (right
// after the prologue), whichever way it leaves.
struct PhaseEnd {
  const RoundStart& start;
  __device__ ~PhaseEnd() { start.clock.end(start.phase); }
};

// Thread 0's part of every prologue: the round, the failed flag, the clock, `phase`'s begin stamp.
__device__ inline void read_round(RoundState* state, RoundPhase phase, Stamps stamps,
                                  RoundStart& start) {
  start.skip = round_failed(state);
  start.round = state->round;
  start.phase = phase;
  start.clock = phase_clock(state, start.round);
  if (stamps == Stamps::begin_and_end) start.clock.begin(phase);
}

// The wait a phase holds (PhaseClock): step 4's inside route, step 7's inside combine.
__device__ inline RoundPhase wait_phase(Phase phase) {
  return phase == Phase::dispatch_counts ? RoundPhase::wait_counts : RoundPhase::wait_done;
}

// The prologue of every kernel of a round that waits for its peers, called by every thread of the
// CTA: thread 0 reads the round and the failed flag, and, when the round has not failed, runs
// `wait`, a bounded wait (e.g. `await_counts`), and fails the round on anything but ok (I3). Every
// thread gets the same answer.
template <class Wait>
__device__ RoundStart start_round(const RoundParams& p, RoundPhase kernel_phase, Phase phase,
                                  Wait wait) {
  __shared__ RoundStart start;
  wait_for_previous_kernel();
  if (threadIdx.x == 0) {
    read_round(p.state, kernel_phase, Stamps::begin_and_end, start);
    if (!start.skip) {
      const DeviceSession session(p.layout, DevicePeers{p.peer_windows}, p.rank, start.round);
      DevicePlatform platform;
      start.clock.begin(wait_phase(phase));
      const protocol::WaitOutcome w =
          wait(session, protocol::deadline_after_ms(platform, p.timeout_ms), platform);
      start.clock.end(wait_phase(phase));
      if (w.status != protocol::WaitStatus::ok) {
        fail_round(p, session, w, phase);
        start.skip = true;
      }
    }
  }
  __syncthreads();
  return start;
}

// The prologue of a kernel that waits for nothing (the expert backends' kernels too): the round,
// and whether it already failed. Every thread of the CTA calls it and gets the same answer.
__device__ inline RoundStart join_round(RoundState* state, RoundPhase phase,
                                        Stamps stamps = Stamps::begin_and_end) {
  __shared__ RoundStart start;
  wait_for_previous_kernel();
  if (threadIdx.x == 0) read_round(state, phase, stamps, start);
  __syncthreads();
  return start;
}
__device__ inline RoundStart start_round(const RoundParams& p, RoundPhase phase) {
  return join_round(p.state, phase);
}

// Every CTA calls this once when its part of the kernel is done (all its stores issued); returns
// true in exactly one thread of the last CTA, after every other CTA's stores are visible system
// wide (kSystem) or GPU wide. That thread then publishes the round's message and re-arms the
// ticket. System scope where that message goes to other ranks (a count, done); GPU scope where only
// this GPU reads what the last CTA writes (route's offsets), a cheaper fence.
template <bool kSystem = true>
__device__ inline bool last_cta_done(std::uint32_t* ticket) {
  const auto fence = [] {
    if constexpr (kSystem)
      __threadfence_system();
    else
      __threadfence();
  };
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) {
    fence();
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    if (last) {
      fence();
      *ticket = 0;
    }
  }
  return last;
}

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ inline double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The threads that encode or decode one row together (row_codec.cuh): the whole CTA, or one of
// the CTA's equal slices of `size` threads (a multiple of 32), each slice with its own row and
// its own barrier. A slice keeps a short row (qwen3's I = 768 floats) from leaving most of 256
// threads idle between barriers, and lets a CTA have several rows' loads in flight at once.
struct RowGroup {
  int rank;     // this thread within the group
  int size;     // threads in the group
  int index;    // the slice's index within the CTA (0 for the CTA itself)
  int barrier;  // 0: the CTA's barrier (__syncthreads); else the slice's named barrier

  __device__ static RowGroup cta() {
    return RowGroup{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), 0, 0};
  }
  // Slice threadIdx.x / size of the CTA; named barrier 1 + that (15 slices at most).
  __device__ static RowGroup slice(int size) {
    const int index = static_cast<int>(threadIdx.x) / size;
    return RowGroup{static_cast<int>(threadIdx.x) % size, size, index, 1 + index};
  }
  __device__ int warp() const { return rank / 32; }
  __device__ int warps() const { return size / 32; }
  __device__ void sync() const {
    if (barrier == 0)
      __syncthreads();
    else if (size == 32)
      __syncwarp();
    else
      asm volatile("bar.sync %0, %1;" ::"r"(barrier), "r"(size) : "memory");
  }
};

// A strided walk over `count` vectors (16 bytes each, usually): this thread takes vectors first,
// first + stride, ..., kAhead of them loaded before any is used (`use(index, vector)`), so their
// latencies overlap where one load at a time waited for each. A warp's lanes (first = lane,
// stride 32), or a CTA's threads (threadIdx.x, blockDim.x).
template <int kAhead, class Vector, class Use>
__device__ __forceinline__ void strided_vectors(const Vector* row, std::int64_t count,
                                                std::int64_t first, std::int64_t stride, Use use) {
  for (; first < count; first += kAhead * stride) {
    Vector v[kAhead];
#pragma unroll
    for (int l = 0; l < kAhead; ++l)
      if (first + stride * l < count) v[l] = row[first + stride * l];
#pragma unroll
    for (int l = 0; l < kAhead; ++l)
      if (first + stride * l < count) use(first + stride * l, v[l]);
  }
}

// Max of |x| over finite values (the NVFP4 group amax) across the group; `scratch` holds one float
// per warp of the group. Max is order-free, so this equals the host's formats::nvfp4_group_amax
// exactly.
__device__ inline float group_finite_amax(const RowGroup& g, const float* x, std::int64_t n,
                                          float* scratch) {
  float m = 0.0f;
  for (std::int64_t i = g.rank; i < n; i += g.size) {
    const float a = fabsf(x[i]);
    if (a <= 3.402823466e38f) m = fmaxf(m, a);  // skips NaN and Inf
  }
  for (int offset = 16; offset > 0; offset /= 2)
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (g.warps() == 1) return m;
  if (g.rank % 32 == 0) scratch[g.warp()] = m;
  g.sync();
  float r = 0.0f;
  for (int w = 0; w < g.warps(); ++w) r = fmaxf(r, scratch[w]);
  g.sync();
  return r;
}

}  // namespace epmoe::cuda

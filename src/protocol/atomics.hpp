// System-scope atomics on window words, the same code on host threads and on the GPU
// (libcu++ ::cuda::atomic_ref). Payload is written with plain stores; the flag that publishes it is
// a release store, read by the consumer with an acquire load (NCCL_DEVICE_API.md).
#pragma once

#include <cstdint>

#include <cuda/atomic>

#include "formats/codec.hpp"  // EPMOE_HD

namespace epmoe::protocol {

template <class T>
using system_ref = ::cuda::atomic_ref<T, ::cuda::thread_scope_system>;

EPMOE_HD std::uint64_t load_acquire(const std::uint64_t* word) {
  return system_ref<std::uint64_t>(*const_cast<std::uint64_t*>(word))
      .load(::cuda::std::memory_order_acquire);
}
EPMOE_HD std::uint64_t load_relaxed(const std::uint64_t* word) {
  return system_ref<std::uint64_t>(*const_cast<std::uint64_t*>(word))
      .load(::cuda::std::memory_order_relaxed);
}
EPMOE_HD void store_release(std::uint64_t* word, std::uint64_t value) {
  system_ref<std::uint64_t>(*word).store(value, ::cuda::std::memory_order_release);
}
EPMOE_HD void store_relaxed(std::uint64_t* word, std::uint64_t value) {
  system_ref<std::uint64_t>(*word).store(value, ::cuda::std::memory_order_relaxed);
}
// Stores `desired` only if the word is still `expected`; true when this call stored it.
EPMOE_HD bool compare_exchange(std::uint64_t* word, std::uint64_t expected, std::uint64_t desired) {
  return system_ref<std::uint64_t>(*word).compare_exchange_strong(
      expected, desired, ::cuda::std::memory_order_acq_rel, ::cuda::std::memory_order_relaxed);
}
// The in-kernel reduce: weighted FC2 rows added into the home rank's fp32 accumulator.
EPMOE_HD void add_relaxed(float* target, float value) {
  system_ref<float>(*target).fetch_add(value, ::cuda::std::memory_order_relaxed);
}

}  // namespace epmoe::protocol

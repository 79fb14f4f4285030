// Host vectors to and from the GPU for the GPU tests: a device copy freed with its object, and a
// device array read back.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

namespace epmoe::test {

// A device copy of a host vector (or `count` elements of 0xFF bytes), freed with the object.
template <class T>
struct DeviceCopy {
  T* ptr = nullptr;
  explicit DeviceCopy(const std::vector<T>& host) {
    EXPECT_EQ(cudaMalloc(&ptr, host.size() * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  explicit DeviceCopy(std::size_t count) {
    EXPECT_EQ(cudaMalloc(&ptr, count * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemset(ptr, 0xFF, count * sizeof(T)), cudaSuccess);
  }
  ~DeviceCopy() { cudaFree(ptr); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
};

// `n` elements of a device array, once the device has finished its work.
template <class T>
std::vector<T> from_device(const T* d, std::size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

}  // namespace epmoe::test

// The chain's route and bucket kernels (route_steps.cuh), each launched after its predecessor with
// programmatic dependent launch.
#include "cuda/cuda_check.hpp"
#include "cuda/experts.hpp"
#include "cuda/route_steps.cuh"

namespace epmoe::cuda {
namespace {

__global__ void __launch_bounds__(kThreads) route_kernel(RoundParams p) {
  route_step(p);
}

__global__ void __launch_bounds__(kThreads) bucket_kernel(RoundParams p) {
  bucket_step(p);
}

}  // namespace

KernelShape route_shape(const RoundParams& /*p*/, int device, int num_sms) {
  return occupancy_shape(route_kernel, 0, device, num_sms);
}
KernelShape bucket_shape(const RoundParams& /*p*/, int device, int num_sms) {
  return occupancy_shape(bucket_kernel, 0, device, num_sms);
}

void launch_route(const RoundParams& p, const KernelShape& s, cudaStream_t stream) {
  launch_chained(route_kernel, s, stream, p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}
void launch_bucket(const RoundParams& p, const KernelShape& s, cudaStream_t stream) {
  launch_chained(bucket_kernel, s, stream, p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda

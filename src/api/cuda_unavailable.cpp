// A build without CUDA: the CUDA executor's entry points say so instead of failing to link.
#include "epmoe/comm.hpp"
#include "epmoe/errors.hpp"

#if !defined(EPMOE_HAS_CUDA)
namespace epmoe {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw Error(ErrorCode::unsupported,
              std::string(what) +
                  ": this build of epmoe has no CUDA executor (nvcc was not found "
                  "at configure time, or -DEPMOE_ENABLE_CUDA=OFF)");
}
}  // namespace

UniqueId get_unique_id() {
  no_cuda("get_unique_id");
}
std::unique_ptr<Communicator> make_nccl_communicator(const UniqueId&, int, int, int,
                                                     std::uint32_t) {
  no_cuda("make_nccl_communicator");
}
std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(std::span<const int>,
                                                                   std::uint32_t) {
  no_cuda("make_nccl_communicators");
}
int cuda_device_count() {
  return 0;
}
}  // namespace epmoe
#endif

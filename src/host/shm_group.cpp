// The CPU executor with ranks as processes: every rank's window is a POSIX shared-memory segment
// that the other rank processes map. Segment names are derived from the group name, the layer's
// creation index and the rank, so a restarted rank process finds (and keeps) the window its
// predecessor left behind, which the survivors still have mapped.
//
//   segment "/epmoe-<group>-<layer>-<rank>":  [header page][window: bytes]
//   header: magic, window bytes, config description, ready flag (release-stored last)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "epmoe/errors.hpp"
#include "host/host_group.hpp"
#include "protocol/atomics.hpp"
#include "protocol/workspace.hpp"

namespace epmoe {
namespace {

constexpr std::uint64_t kMagic = 0x65706d6f65776e31ull;  // "epmoewn1"
constexpr std::size_t kHeaderBytes = protocol::kWindowAlignment;
constexpr std::size_t kDescribeBytes = kHeaderBytes - 64;

struct SegmentHeader {
  std::uint64_t magic;
  std::uint64_t bytes;
  std::uint64_t ready;  // 1 once the header is complete
  char describe[kDescribeBytes];
};
static_assert(sizeof(SegmentHeader) <= kHeaderBytes);

std::string segment_name(const std::string& group, std::uint64_t layer, int rank) {
  return "/epmoe-" + group + "-" + std::to_string(layer) + "-" + std::to_string(rank);
}

[[noreturn]] void system_error(const std::string& what) {
  throw Error(ErrorCode::internal, what + ": " + std::strerror(errno));
}

struct Mapping {
  void* base = nullptr;
  std::size_t length = 0;
};

// One layer's windows in this process: its own segment and its peers', all mapped.
struct ShmWindows final : HostLayerWindows {
  std::vector<Mapping> mappings;
  std::string own_name;
  ~ShmWindows() override {
    for (const Mapping& m : mappings)
      if (m.base != nullptr) munmap(m.base, m.length);
    // A rank that leaves cleanly removes its window; a killed one leaves it for its successor.
    if (!own_name.empty()) shm_unlink(own_name.c_str());
  }
};

class SharedMemoryHostGroup final : public HostGroup {
 public:
  SharedMemoryHostGroup(std::string name, int world) : name_(std::move(name)), world_(world) {
    if (world < 1)
      throw Error(ErrorCode::invalid_argument,
                  "attach_shared_memory_group: world=" + std::to_string(world) + ": must be >= 1");
    if (name_.empty() || name_.find('/') != std::string::npos || name_.size() > 200)
      throw Error(ErrorCode::invalid_argument, "attach_shared_memory_group: name='" + name_ +
                                                   "': must be 1 to 200 characters without '/'");
  }
  int world() const override { return world_; }

  std::shared_ptr<HostLayerWindows> join_layer(int rank, std::size_t window_bytes,
                                               const std::string& describe,
                                               std::chrono::milliseconds timeout) override {
    if (describe.size() >= kDescribeBytes)
      throw Error(ErrorCode::internal, "Layer: config description too long for the header");
    const std::uint64_t layer = layers_created_++;
    auto out = std::make_shared<ShmWindows>();
    out->windows.resize(static_cast<std::size_t>(world_));
    out->mappings.resize(static_cast<std::size_t>(world_));
    out->bytes = window_bytes;
    const std::size_t length = kHeaderBytes + window_bytes;

    // This rank's own segment: created zeroed, or found again after a restart.
    out->own_name = segment_name(name_, layer, rank);
    int fd = shm_open(out->own_name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 && errno == EEXIST) {
      out->rejoined = true;
      fd = shm_open(out->own_name.c_str(), O_RDWR, 0600);
    }
    if (fd < 0) system_error("Layer: shm_open " + out->own_name);
    struct stat st {};
    if (fstat(fd, &st) != 0) system_error("Layer: fstat " + out->own_name);
    if (!out->rejoined && ftruncate(fd, static_cast<off_t>(length)) != 0)
      system_error("Layer: ftruncate " + out->own_name);
    if (out->rejoined && static_cast<std::size_t>(st.st_size) != length)
      throw Error(ErrorCode::invalid_argument,
                  "Layer creation on rank " + std::to_string(rank) + ": the window left by a " +
                      "previous rank " + std::to_string(rank) + " process has " +
                      std::to_string(st.st_size) + " bytes, this config needs " +
                      std::to_string(length) + " (a different config)");
    map(*out, rank, fd, length);
    auto* own = static_cast<SegmentHeader*>(out->mappings[static_cast<std::size_t>(rank)].base);
    own->magic = kMagic;
    own->bytes = window_bytes;
    std::memset(own->describe, 0, kDescribeBytes);
    std::memcpy(own->describe, describe.data(), describe.size());
    protocol::system_ref<std::uint64_t>(own->ready).store(1, ::cuda::std::memory_order_release);

    // Every peer's segment, once its header is complete (bounded like every wait).
    std::vector<std::string> describes(static_cast<std::size_t>(world_));
    describes[static_cast<std::size_t>(rank)] = describe;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int peer = 0; peer < world_; ++peer) {
      if (peer == rank) continue;
      const std::string name = segment_name(name_, layer, peer);
      for (;;) {
        const int pfd = shm_open(name.c_str(), O_RDWR, 0600);
        if (pfd >= 0) {
          struct stat pst {};
          if (fstat(pfd, &pst) == 0 && static_cast<std::size_t>(pst.st_size) == length) {
            map(*out, peer, pfd, length);
            auto* h =
                static_cast<SegmentHeader*>(out->mappings[static_cast<std::size_t>(peer)].base);
            if (protocol::system_ref<std::uint64_t>(h->ready).load(
                    ::cuda::std::memory_order_acquire) == 1 &&
                h->magic == kMagic) {
              describes[static_cast<std::size_t>(peer)] = std::string(h->describe);
              break;
            }
          } else {
            close(pfd);
          }
        }
        if (timeout.count() != 0 && std::chrono::steady_clock::now() > deadline)
          throw Error(ErrorCode::timeout, "Layer creation on rank " + std::to_string(rank) +
                                              ": rank " + std::to_string(peer) +
                                              " did not create layer #" + std::to_string(layer) +
                                              " within " + std::to_string(timeout.count()) +
                                              " ms (shared-memory group '" + name_ + "')");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    check_same_config(describes);
    return out;
  }

 private:
  // Maps (or re-maps) `rank`'s segment; the window starts after the header page.
  static void map(ShmWindows& w, int rank, int fd, std::size_t length) {
    auto& m = w.mappings[static_cast<std::size_t>(rank)];
    if (m.base != nullptr) munmap(m.base, m.length);
    void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) system_error("Layer: mmap of rank " + std::to_string(rank));
    m = Mapping{base, length};
    w.windows[static_cast<std::size_t>(rank)] = static_cast<std::byte*>(base) + kHeaderBytes;
  }

  std::string name_;
  int world_;
  std::uint64_t layers_created_ = 0;
};

}  // namespace

std::shared_ptr<HostGroup> attach_shared_memory_group(const std::string& name, int world) {
  return std::make_shared<SharedMemoryHostGroup>(name, world);
}

void remove_shared_memory_group(const std::string& name, int world, int layers) {
  for (int layer = 0; layer < layers; ++layer)
    for (int rank = 0; rank < world; ++rank)
      shm_unlink(segment_name(name, static_cast<std::uint64_t>(layer), rank).c_str());
}

}  // namespace epmoe

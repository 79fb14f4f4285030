// Layer creation as a bounded meeting (docs/design.md §6.1), shared by the host and the GPU.
//
// The CUDA executor's communicator owns one small symmetric "control window" per rank, registered
// once with the communicator. The k-th layer creation on a rank (k counts from 1 on each
// communicator) writes this rank's config line (LayerConfig::describe()) into every rank's control
// window, then its hello (k), and waits, bounded, until every rank said hello to k. So the ranks
// agree on the config before any NCCL collective of the layer starts, and a rank that never comes
// is named, like a missing rank in a round (I3), instead of hanging an NCCL collective.
//
// A rank that gives up on creation k (its wait expired, or it failed after its hello) marks k as
// given up in every rank's control window: a late rank then fails at once instead of waiting, and
// the ranks' creation numbers stay in step, so every rank can simply create the layer again.
//
//   control window (every rank the same size)
//     hello[kMaxWorld]      u64 (creation k, 0)    written by src when it reaches creation k
//     gave_up[kMaxWorld]    u64 (creation k, culprit + 1)   written by src when it gives up on
//                           creation k: the rank it waited for in vain, 0 when it failed itself
//     (padding to 4 KiB)
//     config lines [2 parity][world src][4 KiB]   src's describe(), NUL-padded; parity k % 2
//
// Config lines are double-buffered by creation parity: a peer may be one creation ahead (it left
// the meeting first), and its next line must not overwrite the one this rank is about to read.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epmoe/config.hpp"
#include "protocol/atomics.hpp"
#include "protocol/message.hpp"
#include "protocol/wait.hpp"

namespace epmoe::protocol {

inline constexpr std::size_t kConfigLineBytes = 4096;  // one rank's describe(), NUL-padded

struct CreationLayout {
  int world = 1;

  EPMOE_HD std::size_t hello_word(int src) const { return 8u * static_cast<std::size_t>(src); }
  EPMOE_HD std::size_t gave_up_word(int src) const {
    return 8u * static_cast<std::size_t>(kMaxWorld + src);
  }
  EPMOE_HD std::size_t config_line(int src, std::uint32_t creation) const {
    return kConfigLineBytes *
           (1u + (creation & 1u) * static_cast<std::size_t>(world) + static_cast<std::size_t>(src));
  }
  EPMOE_HD std::size_t total() const {
    return kConfigLineBytes * (1u + 2u * static_cast<std::size_t>(world));
  }
};
static_assert(16 * kMaxWorld <= kConfigLineBytes, "the hello and gave-up words fit one page");

// One rank's side of creation `creation` (>= 1). `Peers` maps a rank to the base of its control
// window, as in RoundSession.
template <class Peers>
class CreationSession {
 public:
  EPMOE_HD CreationSession(const CreationLayout& layout, const Peers& peers, int rank,
                           std::uint32_t creation)
      : layout_(layout), peers_(peers), rank_(rank), creation_(creation) {}

  EPMOE_HD std::uint32_t creation() const { return creation_; }

  // This rank's config line (kConfigLineBytes, NUL-padded, 8-byte aligned) into every rank's
  // window, then its hello: a release store, so whoever sees the hello sees the line.
  EPMOE_HD void say_hello(const std::uint64_t* line) const {
    constexpr std::size_t kWords = kConfigLineBytes / sizeof(std::uint64_t);
    for (int dest = 0; dest < layout_.world; ++dest) {
      std::uint64_t* to = word(dest, layout_.config_line(rank_, creation_));
      for (std::size_t i = 0; i < kWords; ++i) to[i] = line[i];
    }
    for (int dest = 0; dest < layout_.world; ++dest)
      store_release(word(dest, layout_.hello_word(rank_)), pack_inbox(creation_, 0));
  }

  // Waits until every rank said hello to this creation (or to the next one: it left first).
  //   timeout:   peer = the first rank still missing, observed = the last creation it reached
  //   aborted:   peer = a rank that gave up on this creation, abort_word = its gave-up word
  //              (culprit_of says whom it waited for)
  //   violation: peer = a rank more than one creation ahead (the ranks are out of step)
  template <class Platform>
  EPMOE_HD WaitOutcome await_hellos(Deadline deadline, Platform& platform) const {
    for (int src = 0; src < layout_.world; ++src) {
      for (std::uint32_t attempt = 0;; ++attempt) {
        const int quitter = gave_up_rank();
        if (quitter >= 0)
          return WaitOutcome{WaitStatus::aborted, quitter, creation_,
                             load_acquire(word(rank_, layout_.gave_up_word(quitter)))};
        const std::uint32_t observed = hello_from(src);
        const std::uint32_t ahead = observed - creation_;  // modulo 2^32
        if (ahead <= 1u) break;
        if (static_cast<std::int32_t>(ahead) > 0)
          return WaitOutcome{WaitStatus::violation, src, observed, 0};
        if (!deadline.forever() && platform.now_ns() > deadline.at_ns)
          return WaitOutcome{WaitStatus::timeout, src, observed, 0};
        platform.pause(attempt);
      }
    }
    return WaitOutcome{};
  }

  // Tells every rank (this one included) that this rank gave up on this creation, waiting in vain
  // for `culprit` (-1: it failed itself).
  EPMOE_HD void give_up(int culprit) const {
    const std::uint64_t w =
        pack_inbox(creation_, culprit < 0 ? 0u : static_cast<std::uint32_t>(culprit) + 1u);
    for (int dest = 0; dest < layout_.world; ++dest)
      store_release(word(dest, layout_.gave_up_word(rank_)), w);
  }
  // The rank a gave-up word's writer waited for in vain; -1 when it failed itself.
  EPMOE_HD static int culprit_of(std::uint64_t gave_up_word) {
    return static_cast<int>(inbox_value(gave_up_word)) - 1;
  }

  // The lowest rank that gave up on this creation, as seen in this rank's window; -1 when none.
  EPMOE_HD int gave_up_rank() const {
    for (int src = 0; src < layout_.world; ++src)
      if (inbox_round(load_acquire(word(rank_, layout_.gave_up_word(src)))) == creation_)
        return src;
    return -1;
  }

  // The last creation `src` said hello to, as seen in this rank's window (0: none yet).
  EPMOE_HD std::uint32_t hello_from(int src) const {
    return inbox_round(load_acquire(word(rank_, layout_.hello_word(src))));
  }

  // `src`'s config line for this creation in this rank's window (valid after await_hellos).
  EPMOE_HD const char* config_line(int src) const {
    return reinterpret_cast<const char*>(peers_.window(rank_) +
                                         layout_.config_line(src, creation_));
  }

 private:
  EPMOE_HD std::uint64_t* word(int owner, std::size_t offset) const {
    return reinterpret_cast<std::uint64_t*>(peers_.window(owner) + offset);
  }

  const CreationLayout& layout_;
  Peers peers_;
  int rank_;
  std::uint32_t creation_;
};

}  // namespace epmoe::protocol

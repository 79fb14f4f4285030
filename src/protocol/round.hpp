// The messages of one round (docs/design.md §3 steps 3, 4, 6, 7) and the abort, as a session object
// shared by both executors. The executor supplies `Peers`, which maps a rank to the base address
// of its window (an LSA pointer on the GPU, a shared host allocation on the CPU), and a platform
// (clock + backoff). Payload movement (steps 2 and 5) is the executor's; this object only orders
// it: rows are written before publish_count, read after await_counts; results are written before
// publish_done, read after await_done.
#pragma once

#include <cstdint>

#include "epmoe/errors.hpp"
#include "protocol/atomics.hpp"
#include "protocol/message.hpp"
#include "protocol/wait.hpp"
#include "protocol/workspace.hpp"

namespace epmoe::protocol {

template <class Peers>
class RoundSession {
 public:
  EPMOE_HD RoundSession(const WorkspaceLayout& layout, const Peers& peers, int rank,
                        std::uint32_t round)
      : layout_(layout), peers_(peers), rank_(rank), round_(round) {}

  EPMOE_HD std::uint32_t round() const { return round_; }
  EPMOE_HD int world() const { return layout_.world; }

  // Step 3: (round, rows) into count_inbox[rank] of `dest`. Sent to every rank, rows may be 0.
  EPMOE_HD void publish_count(int dest, std::uint32_t rows) const {
    store_release(word(dest, layout_.count_word(rank_)), pack_inbox(round_, rows));
  }
  // Step 6: round into done_inbox[rank] of `dest`. Sent to every rank.
  EPMOE_HD void publish_done(int dest) const {
    store_release(word(dest, layout_.done_word(rank_)), pack_inbox(round_, 0));
  }

  // Step 4: wait until every count_inbox[src] shows this round; rows_from[src] = rows it sent. A
  // count above max_tokens (more rows than src's receive block holds) is a violation by src (I4),
  // so no executor ever reads past a receive block.
  template <class Platform>
  EPMOE_HD WaitOutcome await_counts(Deadline deadline, Platform& platform,
                                    std::uint32_t* rows_from) const {
    for (int src = 0; src < layout_.world; ++src) {
      const std::uint64_t* inbox = word(rank_, layout_.count_word(src));
      WaitOutcome w = wait_for_round(inbox, round_, src, abort_word(), deadline, platform);
      if (w.status != WaitStatus::ok) return w;
      const std::uint32_t rows = inbox_value(load_acquire(inbox));
      if (std::int64_t{rows} > layout_.max_tokens)
        return WaitOutcome{WaitStatus::violation, src, round_, 0};
      rows_from[src] = rows;
    }
    return WaitOutcome{};
  }

  // Step 7: wait until every done_inbox[src] shows this round.
  template <class Platform>
  EPMOE_HD WaitOutcome await_done(Deadline deadline, Platform& platform) const {
    for (int src = 0; src < layout_.world; ++src) {
      WaitOutcome w = wait_for_round(word(rank_, layout_.done_word(src)), round_, src, abort_word(),
                                     deadline, platform);
      if (w.status != WaitStatus::ok) return w;
    }
    return WaitOutcome{};
  }

  // I3: tell every rank (this one included) who gave up waiting for whom, where and when. The first
  // record raised on a rank wins, so every survivor reports the original failure.
  EPMOE_HD void raise_abort(Phase phase, int culprit) const {
    AbortRecord a;
    a.reporter = static_cast<std::uint32_t>(rank_);
    a.culprit = culprit < 0 ? kUnknownRank : static_cast<std::uint32_t>(culprit);
    a.phase = static_cast<std::uint32_t>(phase);
    a.round = round_;
    const std::uint64_t record = pack_abort(a);
    for (int dest = 0; dest < layout_.world; ++dest)
      compare_exchange(word(dest, layout_.abort_word), 0, record);
  }
  EPMOE_HD std::uint64_t local_abort() const { return load_acquire(abort_word()); }

  // I4: on a protocol violation, who broke it? Every rank's latest count round as this rank sees
  // it (its own is this round); healthy ranks are within one round of each other, so the culprit
  // is the rank that agrees with the fewest others. Ties (e.g. two ranks) go to the rank that is
  // further ahead: a counter only runs ahead by being corrupted. When all counts agree (a bad
  // payload row, say) the caller's own suspect stands.
  EPMOE_HD int violation_culprit(int fallback) const {
    int culprit = fallback, fewest = layout_.world;  // everyone agrees: the counts can't tell
    for (int k = 0; k < layout_.world; ++k) {
      int agree = 0;
      for (int j = 0; j < layout_.world; ++j) {
        const std::uint32_t d = count_round(j) - count_round(k);
        agree += d + 1u <= 2u;  // |d| <= 1, modulo 2^32
      }
      const bool ahead = static_cast<std::int32_t>(count_round(k) - count_round(culprit)) > 0;
      if (agree < fewest || (agree == fewest && fewest < layout_.world && ahead)) {
        fewest = agree;
        culprit = k;
      }
    }
    return culprit;
  }

 private:
  EPMOE_HD std::uint64_t* word(int owner, std::size_t offset) const {
    return reinterpret_cast<std::uint64_t*>(peers_.window(owner) + offset);
  }
  EPMOE_HD const std::uint64_t* abort_word() const { return word(rank_, layout_.abort_word); }
  EPMOE_HD std::uint32_t count_round(int k) const {
    return k == rank_ ? round_ : inbox_round(load_acquire(word(rank_, layout_.count_word(k))));
  }

  const WorkspaceLayout& layout_;
  Peers peers_;
  int rank_;
  std::uint32_t round_;
};

// The collective reset() (docs/design.md §3 I3), bounded like every other wait. Two meetings, each
// an epoch published into reset_inbox[rank] of every rank: after the first nobody is inside a round
// any more, so each rank clears its own inboxes and abort word; after the second every inbox is
// clear and round 1 may start. Epochs only grow (two per reset), so they are never cleared
// themselves. A peer may already be one epoch ahead (it left the meeting first); that counts as
// arrived.
template <class Peers>
class ResetSession {
 public:
  EPMOE_HD ResetSession(const WorkspaceLayout& layout, const Peers& peers, int rank)
      : layout_(layout), peers_(peers), rank_(rank) {}

  // Publishes `epoch` to every rank, then waits until every rank published it (or the next one).
  template <class Platform>
  EPMOE_HD WaitOutcome meet(std::uint32_t epoch, Deadline deadline, Platform& platform) const {
    for (int dest = 0; dest < layout_.world; ++dest)
      store_release(word(dest, layout_.reset_word(rank_)), pack_inbox(epoch, 0));
    for (int src = 0; src < layout_.world; ++src) {
      const std::uint64_t* inbox = word(rank_, layout_.reset_word(src));
      for (std::uint32_t attempt = 0;; ++attempt) {
        const std::uint32_t observed = inbox_round(load_acquire(inbox));
        const std::uint32_t behind = rounds_behind(observed, epoch);
        if (behind == 0 || behind == 0xffffffffu) break;
        if (!deadline.forever() && platform.now_ns() > deadline.at_ns)
          return WaitOutcome{WaitStatus::timeout, src, observed, 0};
        platform.pause(attempt);
      }
    }
    return WaitOutcome{};
  }

  // The newest reset epoch any rank has published here: a restarted rank starts its meetings
  // from it, so it meets the survivors wherever their resets got to.
  EPMOE_HD std::uint32_t latest_epoch() const {
    std::uint32_t latest = 0;
    for (int src = 0; src < layout_.world; ++src) {
      const std::uint32_t e = inbox_round(load_acquire(word(rank_, layout_.reset_word(src))));
      latest = e > latest ? e : latest;
    }
    return latest;
  }

  // Between the meetings: this rank's own round state back to "nothing received".
  EPMOE_HD void clear_own_inboxes() const {
    for (int src = 0; src < layout_.world; ++src) {
      store_relaxed(word(rank_, layout_.count_word(src)), 0);
      store_relaxed(word(rank_, layout_.done_word(src)), 0);
    }
    store_release(word(rank_, layout_.abort_word), 0);
  }

 private:
  EPMOE_HD std::uint64_t* word(int owner, std::size_t offset) const {
    return reinterpret_cast<std::uint64_t*>(peers_.window(owner) + offset);
  }

  const WorkspaceLayout& layout_;
  Peers peers_;
  int rank_;
};

}  // namespace epmoe::protocol

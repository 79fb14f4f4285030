/*
 * round_protocol.pml -- SPIN model of the epmoe round protocol (docs/design.md §3).
 * Checked by tests/model/check.sh; tests/model/CMakeLists.txt lists the checks.
 *
 * N = 3 ranks; each one's host calls `forward` ROUNDS = 3 times. Every shared word
 * starts at 0. Each load or store of a shared inbox word is its own atomic step, so
 * SPIN explores every interleaving of them. Memory is sequentially consistent here;
 * the real code's release stores / acquire loads (system scope) give the same
 * ordering for this message-passing pattern.
 *
 * Shared state, [window owner][writer]:
 *   cnt[dst][src]        count_inbox: 2*round + n, n = 1 iff src sent rows to dst
 *                        (the real word is {round, n}; n is abstracted to one bit)
 *   dn[dst][src]         done_inbox: round
 *   pay[dst][par][src]   receive payload buffer, par = round % 2. The writer stores
 *                        the round number, so a reader can tell a slot not yet
 *                        written (older) from an overwritten one (newer)
 *   res[home][par][src]  staged combine: src's expert results for home's rows
 *   rnd[i]               rank i's round counter; it lives in device memory and only
 *                        the launched kernel advances it
 * `abort` and bounded waits (I3) are left out: a wait here blocks for ever, so a hang
 * is what SPIN calls an invalid end state (a process blocked short of its end).
 *
 * Round r on rank i, and where docs/design.md §3 step k is:
 *   step 1  prepare own output                  local: abstracted away
 *   step 2  rows into pay[j][r%2][i] := r       write_payload
 *   step 3  cnt[j][i] := 2r + n for EVERY j     publish_counts: one store per step,
 *           (itself included), n may be 0       destinations in every order
 *   step 4  wait: every cnt[i][j] shows r       wait_counts: each load asserts I2
 *                                               (the word shows r-1 or r)
 *   step 5  read pay[i][r%2][j] of every j      assert the slot holds exactly r
 *           that sent rows; run the experts;    (older: read before complete;
 *           res[j][r%2][i] := r (staged)        newer: overwritten)
 *   step 6  dn[j][i] := r for EVERY j           publish_dones, like step 3
 *   step 7  wait: every dn[i][j] shows r;       wait_dones, like step 4; then assert
 *           finish y from res[i][r%2][j] of     each of those result slots holds
 *           every j it sent rows to; r := r+1   exactly r
 * Each call a rank is idle (T == 0: no rows for anybody, n = 0 in every count, but
 * every step is still done, invariant I1) or busy (rows for every rank). Per-peer
 * routing would add nothing: a slot has one writer and one reader, and all-or-none
 * already gives every (writer, reader) pair every busy/idle sequence over the rounds.
 * A monitor also checks I2 in every state: no two round counters differ by > 1.
 *
 * Two reductions keep the search exhaustive and small (about 5 million states):
 *  - a reader clears a payload/result slot in the step that reads it (a ghost write
 *    the real code does not do). Slots then hold 0 or an unread round, instead of
 *    remembering which ranks were busy rounds ago; "not written yet" reads 0 and
 *    fails the freshness assertion exactly as a stale round would;
 *  - one rank's payload writes (and result writes, and its reads of its own slots)
 *    are one atomic step: each slot has a single reader and a single writer, so no
 *    reader can observe an interleaving that this hides. The inbox words, which the
 *    waits depend on, are stored and loaded one per step.
 *
 * Compile-time variants (spin -a -DNAME ...):
 *   SKIP_IDLE        FAULT: an idle rank does not launch at all for that call (an
 *                    early return when T == 0). Its round counter does not advance,
 *                    so it runs fewer rounds and its peers wait for ever for its
 *                    count: an invalid end state.
 *   SKIP_ADVANCES    with SKIP_IDLE: the skipped round still counts (as if the round
 *                    counter were kept by the host). The skipping rank's peers then
 *                    see it jump two rounds (I2 fails), and without the I2 checks
 *                    they wait for ever for a count it never sends.
 *   NO_DONE          steps 6 and 7 removed. A rank can then publish count r+1
 *                    before a slower peer has looked at its count r: the count word
 *                    is overrun (the I2 load assertion fails), and a home rank reads
 *                    results its peers have not written yet (result assertion).
 *                    Payloads alone stay safe thanks to the two parities (round
 *                    r+2's rows need the reader's count r+1); with SINGLE_BUFFER
 *                    they are overwritten before they are read.
 *   COUNT_BEFORE_PAYLOAD  steps 2 and 3 swapped: a reader can see the count before
 *                    the rows (payload assertion: read before complete).
 *   SINGLE_BUFFER    one payload/result slot per (dst, src) instead of two parities.
 *                    SAFE with the full protocol: a rank writes round r+1's rows only
 *                    after it saw every done of round r, and a reader publishes done
 *                    r only after it read round r's rows; a result of round r+1 is
 *                    written only after the home rank's count r+1, which the home
 *                    rank publishes after it read round r's results. Each buffer is
 *                    written in one phase and read in the next, and the two
 *                    barriers per round keep successive uses of a slot apart.
 *   EARLY_RELEASE    a rank publishes done r as soon as its counts are in, before it
 *                    reads its rows (results left out: that combine could not use
 *                    the done phase). Where double buffering matters: safe with two
 *                    parities; with SINGLE_BUFFER round r+1's rows overwrite unread
 *                    ones (payload assertion: overwritten).
 *   NO_I2_CHECK, NO_RESULT_CHECK  leave those assertions out, so that a variant
 *                    with several defects can be checked for one of them.
 */

#define N      3
#define ROUNDS 3
#define ALL    7                        /* bitmask of all N ranks */

#ifdef SINGLE_BUFFER
#define PAR(r) 0
#else
#define PAR(r) ((r) % 2)
#endif
#define BOX(dst, src)       ((dst) * N + (src))
#define SLOT(dst, p, src)   (((dst) * 2 + (p)) * N + (src))

#define me _pid                         /* ranks are pids 0 .. N-1 */
#define R  rnd[me]                      /* the round this rank is running */

#ifdef NO_I2_CHECK
#define ASSERT_I2(e) skip
#else
#define ASSERT_I2(e) assert(e)
#endif
#ifdef NO_RESULT_CHECK
#define ASSERT_RESULT(e) skip
#else
#define ASSERT_RESULT(e) assert(e)
#endif

byte cnt[N * N];
byte dn[N * N];
byte pay[N * 2 * N];
byte res[N * 2 * N];
byte rnd[N] = 1;

/* Take one rank out of `mask`, nondeterministically: peers are served in any order. */
inline pick(mask, j) {
  if
  :: mask & 1 -> j = 0
  :: mask & 2 -> j = 1
  :: mask & 4 -> j = 2
  fi;
  mask = mask & ~(1 << j)
}

/* Steps 3 and 6: one atomic store into box[dst][me] per step, for every rank dst,
 * in every order. (A Promela inline cannot take an array: one inline per inbox.) */
inline publish_counts() {
  pend = ALL;
  do
  :: pend == 0 -> break
  :: else -> atomic { pick(pend, j); cnt[BOX(j, me)] = 2 * R + ((send >> j) & 1) }
  od;
  j = 0
}

inline publish_dones() {
  pend = ALL;
  do
  :: pend == 0 -> break
  :: else -> atomic { pick(pend, j); dn[BOX(j, me)] = R }
  od;
  j = 0
}

/* Steps 4 and 7: wait until box[me][src] shows round R for every src. Each look is
 * one load, and every value looked at must be R - 1 or R (I2). Not ready: sleep until
 * the word changes, then look again; a peer that never writes leaves this rank
 * blocked for ever. */
inline wait_counts() {
  j = 0;
  do
  :: j == N -> j = 0; break
  :: else ->
    atomic {
      cseen = cnt[BOX(me, j)] / 2;
      ASSERT_I2(cseen == R || cseen + 1 == R);
      if
      :: cseen == R -> recv = recv | ((cnt[BOX(me, j)] & 1) << j); j++
      :: else -> cnt[BOX(me, j)] / 2 != cseen
      fi;
      cseen = 0
    }
  od
}

inline wait_dones() {
  j = 0;
  do
  :: j == N -> j = 0; break
  :: else ->
    atomic {
      dseen = dn[BOX(me, j)];
      ASSERT_I2(dseen == R || dseen + 1 == R);
      if
      :: dseen == R -> j++
      :: else -> dn[BOX(me, j)] != dseen
      fi;
      dseen = 0
    }
  od
}

/* Step 2: this round's rows into every chosen owner's receive buffer. */
inline write_payload() {
  atomic {
    for (j : 0 .. N - 1) {
      if
      :: (send >> j) & 1 -> pay[SLOT(j, PAR(R), me)] = R
      :: else -> skip
      fi
    }
    j = 0
  }
}

active [N] proctype rank()
{
  byte call = 0;        /* forward calls made by the host */
  byte send = 0;        /* ranks this rank sends rows to in this round */
  byte recv = 0;        /* ranks that sent rows to this rank in this round */
  byte pend = 0;        /* ranks still to be served by publish_* */
  byte j = 0;
  byte cseen = 0;       /* round observed in a count inbox */
  byte dseen = 0;       /* round observed in a done inbox */

  do
  :: call == ROUNDS -> break
  :: else ->
    atomic {
      call++;
      if
      :: send = 0                       /* idle: T == 0 */
      :: send = ALL                     /* busy: rows for every rank */
      fi
    }
#ifdef SKIP_IDLE
    if
#ifdef SKIP_ADVANCES
    :: send == 0 -> R++; goto next_call /* ... and a host-side counter moves on */
#else
    :: send == 0 -> goto next_call      /* FAULT: no launch when T == 0 */
#endif
    :: else -> skip
    fi;
#endif

    /* step 1: prepare own output (local) */
#ifndef COUNT_BEFORE_PAYLOAD
    write_payload();                    /* step 2 */
#endif
    publish_counts();                   /* step 3 */
#ifdef COUNT_BEFORE_PAYLOAD
    write_payload();                    /* FAULT: rows written after the count */
#endif
    wait_counts();                      /* step 4; recv := {j : n_ji = 1} */
#ifdef EARLY_RELEASE
    publish_dones();                    /* VARIANT: done before the rows are read */
#endif

    /* step 5: read the rows that arrived: each slot must hold exactly round r */
    atomic {
      for (j : 0 .. N - 1) {
        if
        :: (recv >> j) & 1 ->
          assert(pay[SLOT(me, PAR(R), j)] == R);
          pay[SLOT(me, PAR(R), j)] = 0  /* ghost: see the header */
        :: else -> skip
        fi
      }
      j = 0
    }
#ifndef EARLY_RELEASE
    /* ... run the experts and send each result row home (staged combine) */
    atomic {
      for (j : 0 .. N - 1) {
        if
        :: (recv >> j) & 1 -> res[SLOT(j, PAR(R), me)] = R
        :: else -> skip
        fi
      }
      j = 0
    }
#endif

#ifndef NO_DONE
#ifndef EARLY_RELEASE
    publish_dones();                    /* step 6 */
#endif
    wait_dones();                       /* step 7 */
#endif

    /* finish y from the results of every rank this rank sent rows to (each slot must
     * hold exactly round r); the kernel advances its own round counter */
    atomic {
#ifndef EARLY_RELEASE
      for (j : 0 .. N - 1) {
        if
        :: (send >> j) & 1 ->
          ASSERT_RESULT(res[SLOT(me, PAR(R), j)] == R);
          res[SLOT(me, PAR(R), j)] = 0  /* ghost */
        :: else -> skip
        fi
      }
      j = 0;
#endif
      R++;
      recv = 0
    }
next_call:
    send = 0
  od
}

/* I2 as a state invariant: no two ranks are ever more than one round apart. */
#define DRIFT_OK (rnd[0] <= rnd[1] + 1 && rnd[1] <= rnd[0] + 1 && \
                  rnd[0] <= rnd[2] + 1 && rnd[2] <= rnd[0] + 1 && \
                  rnd[1] <= rnd[2] + 1 && rnd[2] <= rnd[1] + 1)

active proctype drift_monitor()
{
end:
  !DRIFT_OK -> ASSERT_I2(DRIFT_OK)
}

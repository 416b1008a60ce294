// All-gather into tensor on copy engines only: no SM kernel moves data or signals. Pull (default) or push.
//
// ===================================== The protocol =================================================
// Actors: n ranks of one group, each with a symmetric pool (symmetric_pool.h) mapped into every peer,
// a comm stream and a self stream. `e` is the group's epoch counter (group.h), advanced identically on
// every rank because every rank enqueues the same collectives in the same order (as with NCCL).
// Flags live in the RECEIVER's memory and are only waited on locally; writes to peers are 32- or
// 4-byte cudaMemcpyAsync from a local outbox (cuStreamWriteValue32 to remote memory is unsupported from
// CUDA 13.1 on). Every round's signal carries a signature of (op, variant, sizes, round, offset): the
// waits below compare it, so ranks that disagree on any of them block instead of moving bytes.
//
// Variants (chosen per op from where the tensors lie; `O` is the offset posted in the signal):
//   staged (pull):     the input is outside the pool; it is copied into our staging region in rounds of
//                      R = staging size (ceil(bytes / R) rounds). Peer p's shard: its staging region, O.
//   symmetric (pull):  the input lies in the user region at O (the same on every rank: empty_symmetric
//                      agrees offsets through the store). Peers read it in place. One round.
//   in place (pull):   the output lies in the user region at O and the input IS its shard r. Peer p's
//                      shard is at O + p * bytes in p's pool. One round, no self copy.
//   push:              RuntimeConfig.all_gather_mode=push (set_all_gather_mode) and the output lies in the user
//                      region at O. Every rank WRITES its input into O + r * bytes of every peer's pool.
//                      One round; the input may be anywhere (no staging).
//   Several parts (all_gather_into_tensors) are one op over the concatenation of their shards (S = sum of
//   the parts' bytes): staged, with the staging copies and the pulls split at part boundaries, so each byte
//   goes from its part's input to its part's output without a bucket buffer; or, when the parts' inputs lie
//   back to back in the user region (one symmetric slot, the same offset on every rank), symmetric: peers
//   pull each part's shard in place. Every step below is unchanged; the part sizes are hashed into the
//   signature, so ranks that split S differently never exchange bytes.
//
// PULL, rank r, comm stream:
//   0. wait for the caller's stream (event); the self stream does too and copies the own shard
//      input -> out[r] (skipped when the input already IS out[r]: in-place all-gather).
//   For each round (epoch e, bytes b):
//   1. WAIT done[p] >= e-1 for every peer p            (skipped if already known)
//        Every peer is finished with our pool for the previous round/op (read it, or wrote into it), so
//        (a) the staging region may be overwritten, and (b) no peer is still inside epoch e-1 when we
//        announce e (see 3).
//   2. staged only: copy input chunk -> our staging region (local_copy_async: asks for a copy engine).
//   3. POST ready: stream-write {e, signature, kind|variant|round, b, O} into our outbox (and e into the
//      done outbox), then copy the outbox into ready[r] of every peer.
//        Stream order makes our shard (2, or the caller's writes before 0) complete before any peer can
//        see epoch e.
//   4. For i = 1..n-1, peer p = (r+i) % n (spreads the readers of one source over time):
//        WAIT ready[p].epoch >= e  and  ready[p].sig_{a,b} & (our sig_{a,b} | poison) != 0
//        PULL peer p's bytes of this round from its pool (peer mapping) -> out[p*bytes + round offset]
//          (with a pull split of k > 1: k pieces, piece 0 on the comm stream, piece j on pull stream j-1,
//          forked from the comm stream after the WAIT by an event and joined back into it before the POST)
//        POST done: copy the done outbox (= e) into done[r] of p.
//   After the last round:
//   5. zero-copy (symmetric or in place): WAIT done[p] >= e_last for every peer. Peers read our pool
//      IN PLACE, so the caller may overwrite it only once they are finished; the caller waits on 6.
//   6. comm waits for the self stream; record `end`; the caller's stream waits on `end`.
//
// PUSH, rank r, comm stream (one round, epoch e; our output at pool offset O):
//   0. as in PULL (join the caller; self copy unless in place).
//   1. WAIT done[p] >= e-1 for every peer p (as in PULL: the epoch window, and the previous op's users
//      of our pool are finished).
//   2. POST ready {e, ..., O}: "our output accepts writes for epoch e". Posted after 0, so the caller's
//      earlier work on the output (reads of a previous result) is complete before a peer writes into it.
//   3. For i = 1..n-1, peer p = (r+i) % n:
//        WAIT ready[p] >= e with our signature (p's output accepts writes, at the same offset O)
//        PUSH input -> p's pool at O + r * bytes (cudaMemcpyAsync through the peer mapping)
//        POST done: copy the done outbox (= e) into done[r] of p: "r finished writing into p for e".
//          Both copies are on our comm stream, so p sees done = e only after our bytes landed.
//   4. WAIT done[p] >= e for every peer: every peer's shard has landed in our output.
//   5. as 6 in PULL.
//
// Why it is safe:
//   * Data before flag (pull): a peer sees ready = e only after our shard for e is complete (3 is stream-
//     ordered after 2 and after the caller's writes), and pulls only after seeing it (4).
//     Data before flag (push): we return the output only after done = e from every peer (4), which each
//     peer writes after its push into us completed (stream order on its comm stream).
//   * No overwrite while read (pull): our staging region is rewritten in round e only after every peer has
//     posted done >= e-1 (1), which each posts after its pull of round e-1 completed (4, stream order).
//     A zero-copy input is released to the caller only after done >= e (5).
//     No write while in use (push): a peer writes into our output only after our ready = e (2), which we
//     post after the caller handed the output over (0); the output returns to the caller only after
//     every peer's writes completed (4). Peers write disjoint shards; we never write our own pool there.
//   * A peer is never an epoch ahead of our wait: rank p posts ready = e+1 only after done[r] >= e from
//     us (1), and we post done = e only after our wait for ready = e passed (4 pull, 3 push). So while we
//     wait for epoch e, ready[p] holds at most e, and the signature we compare is epoch e's own. That is
//     what makes a mismatch (different sizes, offsets, variants or ops on two ranks) detectable: the AND-
//     wait never passes, and the watchdog reports both sides' descriptors instead of moving wrong bytes.
//     (The 32-byte signal may land word by word; a stale signature word at worst delays the AND-wait
//     until the new word lands, or lets it pass by coincidence, which only costs the mismatch check:
//     the data ordering rests on the epoch word alone.) The same holds across op kinds and variants
//     (reduce_scatter.cc follows the same rules), since every rank posts done = e to a peer only after
//     its wait for that peer's ready = e.
//   * No deadlock: all of a rank's waits in round e depend only on peers' posts of round e (ready, and
//     push: done) or of earlier rounds (1, pull 5), and every rank posts its round-e ready before its
//     first round-e wait.
//   * The self copy reads the caller's input and writes only out[r]; it touches no flag and no shard a
//     peer reads or writes, so it runs on its own stream beside the pulls / pushes.
//   * A split pull is, to every argument above, one copy on the comm stream: its pieces start only after
//     the fork event, recorded on the comm stream after the ready WAIT for that peer, and the comm stream
//     waits for every piece's join event before it POSTs done to that peer, records `end` or does
//     anything else. So "pull only after ready = e" and "done = e only after the pull completed" hold for
//     every piece; the pieces write disjoint ranges of out[p]. The pull streams wait only on comm-stream
//     events, so poisoning the flags drains them with the comm stream; and every later event on the comm
//     stream (the caching allocator's stream records, release_symmetric, `end`) lies after the joins.
//     The split is local: ranks may use different splits (it is not part of the signature).
//   * Peer lanes (Group::peer_round, the tuning knob peer_lanes): the per-peer steps of 4 (pull) / 3
//     (push) may run on up to n-1 streams, forked from the comm stream after POST ready and joined back into it before
//     anything after the loop. Each peer's WAIT, copy and POST done stay in that order on one stream, so every
//     argument above holds per peer; the done outbox they copy is written only by POST ready, before the fork, and
//     rewritten only after the join. Lanes only reorder the steps of different peers, which no argument relies on.
//     Lanes are local (not in the signature). tests/runtime/protocol_model.py runs random lanes per rank.
//   * Per-round signalling (the knob peer_sync, PeerSync in group.h): every peer's WAIT moves before the first copy
//     (one batch of waits on the comm stream, before the fork) and every POST done after the last (after the join).
//     A copy still follows its peer's WAIT and a POST done still follows that peer's copy, in stream order; the steps
//     are only delayed: a wait for more before a copy, or a later post, never lets a byte move earlier. No deadlock:
//     the waits are for round-e readies, which every rank posts before any of its round-e waits. Local, like lanes;
//     the protocol model runs it at random per rank.
//   * A paced copy (Group::peer_copy with copy_rate_gbps > 0) is, to every argument, one copy: its chunks and the
//     pacer launches between them run in order on the copy's stream, before the POST done that follows it.
//   * POST ready rewrites only the outbox words that changed since the comm stream last wrote them (the
//     host mirrors them; only the comm stream writes the outbox, in order). The outbox then holds exactly
//     the 32-byte signal of 3 when the copies of 3 read it, as if every word had been rewritten.
//   * Zero bytes: nothing is enqueued and no epoch is consumed (consistently on every rank, since the
//     sizes match); mismatched zero/non-zero sizes across ranks then show up as a timeout on the other.
//   * Timeouts: the watchdog (group.cc) names the op, the group, this rank and the peers whose flags
//     never arrived, then writes "far future" epochs and the poison bit into our flags so every wait
//     above passes and the stream drains; the group is then marked failed and refuses further ops.
//     Draining a PUSH means our remaining pushes land in the peers' pools without their consent: after a
//     timeout the peers' symmetric tensors are suspect too (the job must be restarted anyway).
//   tests/runtime/protocol_model.py replays these enqueue sequences under random schedules (CPU test).
// ====================================================================================================
#include "all_gather.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace ce_overlap {

namespace {

std::atomic<int> g_mode{static_cast<int>(AllGatherMode::Pull)};

int parse_mode(const std::string& mode) {
  if (mode == "pull") return static_cast<int>(AllGatherMode::Pull);
  if (mode == "push") return static_cast<int>(AllGatherMode::Push);
  return -1;
}

}  // namespace

AllGatherMode all_gather_mode() { return static_cast<AllGatherMode>(g_mode.load()); }

std::string set_all_gather_mode(const std::string& mode) {
  const int parsed = parse_mode(mode);
  if (parsed < 0) throw std::invalid_argument("all-gather mode must be 'pull' or 'push', got '" + mode + "'");
  const int previous = g_mode.exchange(parsed);
  return previous == static_cast<int>(AllGatherMode::Push) ? "push" : "pull";
}

namespace {

// How one op moves its bytes, decided before any epoch is consumed.
struct Plan {
  Variant variant = Variant::AgStaged;
  bool in_place = false;
  size_t offset = 0;          // posted in the signal: staging / input / output pool offset
  size_t round_capacity = 0;  // bytes per rank per round
  size_t rounds = 0;
  uint64_t extra = 0;         // signature: the part sizes of a multi-part op
};

void enqueue_pull_locked(Group& g, const AllGatherArgs& a, const std::string& where, const Plan& plan);
void enqueue_push_locked(Group& g, const AllGatherArgs& a, const std::string& where, const Plan& plan);

}  // namespace

size_t AllGatherArgs::nbytes() const { return parts_bytes(parts); }

bool parts_inputs_contiguous(const std::vector<AllGatherPart>& parts) {
  for (size_t i = 1; i < parts.size(); ++i) {
    if (static_cast<const char*>(parts[i].input) != static_cast<const char*>(parts[i - 1].input) + parts[i - 1].bytes) {
      return false;
    }
  }
  return !parts.empty();
}

namespace {

const char* op_name(const AllGatherArgs& a) {
  return a.parts.size() == 1 ? "all_gather_into_tensor" : "all_gather_into_tensors";
}

}  // namespace

void enqueue_all_gather(Group& g, const AllGatherArgs& a) {
  const AllGatherMode mode = all_gather_mode();
  const size_t nbytes = a.nbytes();
  auto plan_op = [&] {
    SymmetricPool& pool = g.pool();
    const int n = g.world_size();
    Plan plan;
    plan.extra = parts_hash(a.parts);
    std::optional<size_t> out_offset, in_offset;
    if (a.parts.size() == 1) {  // zero-copy variants: one tensor only
      const char* out = static_cast<const char*>(a.parts[0].output);
      const char* in = static_cast<const char*>(a.parts[0].input);
      out_offset = pool.user_region_offset(out, nbytes * static_cast<size_t>(n));
      in_offset = pool.user_region_offset(in, nbytes);
      plan.in_place = in == out + static_cast<size_t>(g.rank()) * nbytes;
    } else if (parts_inputs_contiguous(a.parts)) {
      // Several parts whose inputs lie back to back in the user region (ce_overlap.fsdp casts every parameter's
      // shard into one symmetric slot): the peers read them in place, one round, no staging copy.
      in_offset = pool.user_region_offset(a.parts[0].input, nbytes);
    }
    if (n > 1 && out_offset && mode == AllGatherMode::Push) {
      plan.variant = Variant::AgPush;
      plan.offset = *out_offset;
      plan.round_capacity = nbytes;
    } else if (out_offset && plan.in_place) {
      plan.variant = Variant::AgInPlace;
      plan.offset = *out_offset;
      plan.round_capacity = nbytes;
    } else if (in_offset) {
      plan.variant = Variant::AgSymmetricInput;
      plan.offset = *in_offset;
      plan.round_capacity = nbytes;
    } else {
      plan.variant = Variant::AgStaged;
      plan.offset = pool.staging_offset();
      plan.round_capacity = pool.staging_bytes();
    }
    // A group of one has no peers: only the self copy remains.
    plan.rounds = n == 1 ? 0 : (nbytes + plan.round_capacity - 1) / plan.round_capacity;
    return plan;
  };
  enqueue_op(g, op_name(a), nbytes == 0, a.caller, plan_op, [&](const std::string& where, const Plan& plan) {
    if (plan.variant == Variant::AgPush) {
      enqueue_push_locked(g, a, where, plan);
    } else {
      enqueue_pull_locked(g, a, where, plan);
    }
  });
}

namespace {

// 0. The op begins: join the caller's stream; the own shard goes on the self stream.
PendingOp begin_and_copy_self(Group& g, const AllGatherArgs& a, const std::string& where, const Plan& plan) {
  PendingOp op = begin_op(g, op_name(a), OpKind::AllGather, plan.variant, a.nbytes());
  join_caller(g, a.caller, op, where);
  if (!plan.in_place) {
    const cudaStream_t self = g.self_stream();
    CE_CUDA_CHECK(cudaStreamWaitEvent(self, g.caller_ready_event(), 0), where);
    for (const AllGatherPart& part : a.parts) {
      if (part.bytes == 0) continue;
      char* out = static_cast<char*>(part.output);
      CE_CUDA_CHECK(local_copy_async(out + static_cast<size_t>(g.rank()) * part.bytes, part.input, part.bytes,
                                     g.device(), self),
                    where + ": copying the own shard");
    }
    CE_CUDA_CHECK(cudaEventRecord(g.self_done_event(), self), where);
  }
  return op;
}

// Last step: join the self copy and hand the result back to the caller's stream.
void finish_op(Group& g, const AllGatherArgs& a, const std::string& where, const Plan& plan, PendingOp op) {
  const cudaStream_t comm = g.comm_stream();
  if (!plan.in_place) CE_CUDA_CHECK(cudaStreamWaitEvent(comm, g.self_done_event(), 0), where);
  hand_back(g, std::move(op), a.caller, a.join, where);
}

void enqueue_pull_locked(Group& g, const AllGatherArgs& a, const std::string& where, const Plan& plan) {
  SymmetricPool& pool = g.pool();
  const cudaStream_t comm = g.comm_stream();
  const size_t nbytes = a.nbytes();
  PendingOp op = begin_and_copy_self(g, a, where, plan);

  for (size_t k = 0; k < plan.rounds; ++k) {
    const size_t chunk_offset = k * plan.round_capacity;
    const size_t chunk = std::min(plan.round_capacity, nbytes - chunk_offset);
    const uint32_t e = g.next_epoch();
    const RoundSignature sig = round_signature(OpKind::AllGather, plan.variant, nbytes, static_cast<uint32_t>(k), chunk,
                                               plan.offset, plan.extra);

    // 1. Peers are done with our previous round (protects the staging region and the epoch window).
    if (k == 0 && !epoch_ge(g.last_done_waited(), e - 1)) op.done_needed_before = e - 1;
    g.wait_peers_done(e - 1);
    // 2. Stage (piece by piece when the op has several parts).
    if (plan.variant == Variant::AgStaged) {
      char* staging = pool.local_base() + plan.offset;
      for_each_piece(a.parts, chunk_offset, chunk, [&](const AllGatherPart& part, size_t from, size_t at, size_t len) {
        CE_CUDA_CHECK(local_copy_async(staging + at, static_cast<const char*>(part.input) + from, len, g.device(), comm),
                      where + ": staging the input into the symmetric pool");
      });
    }
    // 3. Announce.
    g.post_ready(PeerSignal{e, sig.sig_a, sig.sig_b, kind_round_word(OpKind::AllGather, plan.variant, static_cast<uint32_t>(k)),
                            chunk, plan.offset});
    // 4. Pull from every peer, in (rank + i) % n order (on the peer lanes).
    g.peer_round(where, e, sig, [&](int p, cudaStream_t s) {
      // Where peer p's bytes of this round lie in its pool.
      const size_t src = plan.variant == Variant::AgInPlace ? plan.offset + static_cast<size_t>(p) * nbytes
                                                             : plan.offset;
      const std::string what = where + ": pulling the shard of rank " + std::to_string(p);
      for_each_piece(a.parts, chunk_offset, chunk, [&](const AllGatherPart& part, size_t from, size_t at, size_t len) {
        char* out = static_cast<char*>(part.output) + static_cast<size_t>(p) * part.bytes + from;
        g.pull_copy(out, pool.peer_base(p) + src + at, len, what, s);
      });
    });
    op.rounds.push_back(RoundInfo{e, sig, static_cast<uint32_t>(k), chunk, plan.offset});
  }
  // 5. A zero-copy input goes back to the caller only once every peer has read it.
  if (plan.variant != Variant::AgStaged && !op.rounds.empty()) {
    op.done_needed_after = op.rounds.back().epoch;
    g.wait_peers_done(op.done_needed_after);
  }
  finish_op(g, a, where, plan, std::move(op));
}

void enqueue_push_locked(Group& g, const AllGatherArgs& a, const std::string& where, const Plan& plan) {
  SymmetricPool& pool = g.pool();
  const int rank = g.rank();
  // Push needs the output in the pool, so the op has one part (plan_op).
  const AllGatherPart& part = a.parts.at(0);
  PendingOp op = begin_and_copy_self(g, a, where, plan);

  // One round: the output is in the pool, so the bytes go straight to their final place.
  const uint32_t e = g.next_epoch();
  const RoundSignature sig = round_signature(OpKind::AllGather, plan.variant, part.bytes, 0, part.bytes, plan.offset);
  // 1. The epoch window, and every peer is finished with our pool for the previous round.
  if (!epoch_ge(g.last_done_waited(), e - 1)) op.done_needed_before = e - 1;
  g.wait_peers_done(e - 1);
  // 2. Our output accepts writes.
  g.post_ready(PeerSignal{e, sig.sig_a, sig.sig_b, kind_round_word(OpKind::AllGather, plan.variant, 0), part.bytes,
                          plan.offset});
  // 3. Push our shard into every peer's output, in (rank + i) % n order.
  const size_t dst = plan.offset + static_cast<size_t>(rank) * part.bytes;
  g.peer_round(where, e, sig, [&](int p, cudaStream_t s) {
    g.peer_copy(pool.peer_base(p) + dst, static_cast<const char*>(part.input), part.bytes,
                where + ": pushing our shard into rank " + std::to_string(p), s);
  });
  // 4. Every peer's shard has landed in our output.
  g.wait_peers_done(e);
  op.rounds.push_back(RoundInfo{e, sig, 0, part.bytes, plan.offset});
  finish_op(g, a, where, plan, std::move(op));
}

}  // namespace

}  // namespace ce_overlap

// All-to-all (equal splits) and broadcast on copy engines only: no SM kernel moves data or signals.
//
// ===================================== The protocols ================================================
// Same actors, flags, epochs and signalling rules as the all-gather (all_gather.cc, "The protocol"; read it first):
// both are PULL collectives on the comm stream, and every rank, in every round of epoch e, (1) waits for done[p] >=
// e-1 from every peer, (3) posts ready = e to every peer, (4) for every peer p = (r+i) % n waits for ready[p] = e
// with our signature, does its copy (or none) and posts done = e to p. So the all-gather's arguments for the epoch
// window, mismatch detection and deadlock freedom hold unchanged; what differs is which bytes a rank pulls.
//
// ALL-TO-ALL, rank r: input and output hold n chunks of C bytes; out[p] = chunk r of rank p's input.
//   0. wait for the caller's stream; the self stream copies in[r] -> out[r] (input and output never overlap).
//   staged (the input is outside the pool): rounds of R = staging / n bytes per chunk. Round k (epoch e):
//     1. WAIT done[p] >= e-1 (peers finished pulling our staging region of the previous round / op).
//     2. copy in[q][kR, +b) -> staging slot q (bytes [q*R, +b) of the staging region) for every q != r.
//     3. POST ready.  4. peer p: WAIT ready[p] = e, PULL p's staging slot r -> out[p][kR, +b), POST done to p.
//   zero-copy (the input lies in the user region at O, the same offset on every rank): one round, peer p's chunk for
//     us is at O + r*C in p's pool; after the round WAIT done[p] >= e from every peer before the input goes back to
//     the caller (peers read it in place).
//   Then: comm waits for the self copy, records `end`, hands back to the caller.
//   Why it is safe, beyond the all-gather's argument: slot q of our staging region is read only by rank q, after our
//   ready for that round, and rewritten only in a later round, after done >= that epoch from every peer; peers write
//   only their own out[]; a zero-copy input is released only after every peer's done for the op's epoch.
//
// BROADCAST from root t, rank r, tensor T of `bytes`:
//   staged (T is outside the pool): rounds of the staging size. Round k (epoch e):
//     1. WAIT done[p] >= e-1 for every peer.
//     2. root only: copy T[kS, +b) -> its staging region.
//     3. POST ready (the root: "this round's bytes are staged"; the others: "I am in this round").
//     4. for every peer p: WAIT ready[p] = e; a non-root whose p is the root PULLS the root's staging -> T[kS, +b);
//        POST done to p.
//   symmetric (T lies in the user region at O on every rank), 2 ranks: one round, the non-root pulls the root's T in
//     place; the root then WAITs done[p] >= e from every peer before T goes back to its caller.
//   Every rank posts and waits for every peer, not only the root: the epoch window (1) needs a done from every peer.
//   The root is in the signature, so ranks that disagree on it block instead of pulling from a non-root.
//   With 3+ ranks every non-root pulling the whole tensor from the root sends (n-1) x bytes over the root's links, so
//   a staged tensor from a few MiB on (broadcast_segments) runs as a pipelined SCATTER + ALL-GATHER, and a symmetric
//   one as the one-round PUSH broadcast (both below).
//
// BROADCAST, scatter + all-gather (n >= 3, staged; BcScatterStaged): T is cut into K segments of S bytes
//   (segment k = T[kS, +b_k)); non-root r owns piece j(r) = (r - t - 1 + n) % n of every segment: bytes
//   [j P_k, min((j + 1) P_k, b_k)) of it, P_k = ceil(b_k / (n-1)) rounded up to 4 KiB (a piece may be empty).
//   K + 1 rounds; round k (epoch e):
//     1. WAIT done[p] >= e-1 for every peer.
//     2. root, k < K: copy segment k -> its staging bank k % 2 (banks of half the staging region).
//     3. POST ready. The root: "segment k is staged". A non-root: "my piece of segment k-1 lies in my bank (k-1) % 2":
//        its pull of that piece was in round k-1, earlier on the comm stream.
//     4. peer_round (group.h: the waits, the copies on the peer lanes, the done posts); a non-root pulls
//          p = root, k < K:            piece j(r) of segment k from the root's bank k % 2 -> my bank k % 2,
//          p a non-root, k >= 1:       piece j(p) of segment k-1 from p's bank (k-1) % 2 -> T.
//        (The root only waits and posts: it takes part in the epoch window.)
//     5. non-root, k < K: comm records `arrived`; the self stream waits for it, copies my piece of segment k from my
//        bank k % 2 into T and records bank_event(k % 2). Round k+2, which pulls into that bank again, waits for that
//        event on the comm stream before step 4.
//   Then comm joins the self stream and hands back.
//   Why it is safe, beyond the all-gather's argument: a piece is pulled from a non-root only in the round after the
//   one that brought it there (ready = e is posted after those copies, in stream order); a bank is rewritten (root:
//   step 2; non-root: step 4 from the root) only in round k+2, after done >= the epoch of round k+1 from every peer
//   (1), i.e. after every read of it, and (non-root) after its own copy-out of round k (the bank event); T's bytes
//   are each written once, by one copy, after the caller's join. The segment count is in the signature.
//   (Variant 13, the same from and into a symmetric tensor, was retired on 2026-11-27 for the push broadcast.)
//
// BROADCAST, push (n >= 3, T in the user region at O on every rank; BcPushSymmetric): one round (epoch e), T cut into
//   K segments of S bytes (broadcast_push_segments), pieces as in the scatter above.
//     1. WAIT done[p] >= e-1 for every peer.  2. POST ready (the root: "T holds the bytes"; a non-root: "my T accepts
//        the other non-roots' pieces").  3. WAIT ready[p] = e for every peer (one batch, comm stream).
//     4. non-root r: PULL piece j(r) of every segment k from the root's T into our T, and PUSH it from our T into every
//        other non-root's T (the same offsets), each push after that pull:
//          relay (n even, from kRelayMinBytes: broadcast_relays): every copy on the comm stream, in
//            broadcast_relay_order (ce_algorithms.h: one non-root pulls while the others push in pairs);
//          otherwise, for k = 0..K-1: the pull on the comm stream; record `arrived`; on lane 1, which waits for it, the
//            pushes. Lane 1 is joined back into the comm stream after the last push.
//     5. POST done to every peer (the root: "finished reading your T"; a non-root: "my pushes into you landed"), then
//        WAIT done[p] >= e for every peer, and hand T back.
//   Why it is safe: the pulls read the root's T after its ready (3), which it posts after the caller's join, and the
//   root's T goes back only after every non-root's done, posted after its pulls (stream order, 5). A push writes q's T
//   after q's ready (3 precedes it on the comm stream, and the `arrived` record the lane waits for), only piece j(r)'s
//   bytes, which no one else writes (q pulls piece j(q) itself; each other non-root pushes its own piece), and reads
//   our piece after our pull of it landed (stream order, or the `arrived` event); q hands T back after our done, posted
//   after our last push (stream order, or the lane's join) (5). The epoch window is the all-gather's: done to p
//   follows our wait for p's ready. No round barrier inside the op. The segment count is in the signature.
//   tests/runtime/protocol_model.py replays these enqueue sequences under random schedules (CPU test).
// ====================================================================================================
#include "all_to_all.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

namespace ce_overlap {

namespace {

// How an all-to-all or broadcast moves its bytes, decided before any epoch is consumed.
struct Plan {
  Variant variant = Variant::A2aStaged;
  size_t offset = 0;       // the staging region, or the zero-copy tensor's pool offset (the same on every rank)
  size_t round_bytes = 0;  // all-to-all: per chunk; scatter broadcast: the segment
  size_t rounds = 0;
  size_t bank_bytes = 0;   // scatter broadcast, staged: half the staging region
};

constexpr size_t kPieceAlign = 4096;

// Bytes [first, second) of segment bytes `b` that non-root j owns (possibly empty).
std::pair<size_t, size_t> piece_of(size_t b, int j, int n) {
  const size_t per = (b + static_cast<size_t>(n - 2)) / static_cast<size_t>(n - 1);
  const size_t p = (per + kPieceAlign - 1) / kPieceAlign * kPieceAlign;
  const size_t lo = std::min(b, static_cast<size_t>(j) * p);
  return {lo, std::min(b, lo + p)};
}

void enqueue_a2a_locked(Group& g, const AllToAllArgs& a, const std::string& where, const Plan& plan) {
  SymmetricPool& pool = g.pool();
  const int rank = g.rank();
  const int n = g.world_size();
  const cudaStream_t comm = g.comm_stream();
  const cudaStream_t self = g.self_stream();
  const size_t C = a.chunk_bytes;
  const char* in = static_cast<const char*>(a.input);
  char* out = static_cast<char*>(a.output);
  const size_t r = static_cast<size_t>(rank);

  PendingOp op = begin_op(g, "all_to_all_single", OpKind::AllToAll, plan.variant, C);
  join_caller(g, a.caller, op, where);
  CE_CUDA_CHECK(cudaStreamWaitEvent(self, g.caller_ready_event(), 0), where);
  CE_CUDA_CHECK(local_copy_async(out + r * C, in + r * C, C, g.device(), self), where + ": copying the own chunk");
  CE_CUDA_CHECK(cudaEventRecord(g.self_done_event(), self), where);

  for (size_t k = 0; k < plan.rounds; ++k) {
    const size_t o = k * plan.round_bytes;
    const size_t b = std::min(plan.round_bytes, C - o);
    const uint32_t e = g.next_epoch();
    const RoundSignature sig =
        round_signature(OpKind::AllToAll, plan.variant, C, static_cast<uint32_t>(k), b, plan.offset);
    // 1. Peers are done with our previous round (the staging slots and the epoch window).
    if (k == 0 && !epoch_ge(g.last_done_waited(), e - 1)) op.done_needed_before = e - 1;
    g.wait_peers_done(e - 1);
    // 2. Stage every chunk but our own.
    if (plan.variant == Variant::A2aStaged) {
      for (int q = 0; q < n; ++q) {
        if (q == rank) continue;
        CE_CUDA_CHECK(local_copy_async(pool.local_base() + plan.offset + static_cast<size_t>(q) * plan.round_bytes,
                                       in + static_cast<size_t>(q) * C + o, b, g.device(), comm),
                      where + ": staging the chunk for rank " + std::to_string(q));
      }
    }
    // 3. Announce.
    g.post_ready(PeerSignal{e, sig.sig_a, sig.sig_b,
                            kind_round_word(OpKind::AllToAll, plan.variant, static_cast<uint32_t>(k)), b, plan.offset});
    // 4. Pull our chunk from every peer, in (rank + i) % n order.
    g.peer_round(where, e, sig, [&](int p, cudaStream_t s) {
      const size_t src = plan.variant == Variant::A2aStaged ? plan.offset + r * plan.round_bytes : plan.offset + r * C;
      g.pull_copy(out + static_cast<size_t>(p) * C + o, pool.peer_base(p) + src, b,
                  where + ": pulling the chunk of rank " + std::to_string(p), s);
    });
    op.rounds.push_back(RoundInfo{e, sig, static_cast<uint32_t>(k), b, plan.offset});
  }
  // A zero-copy input goes back to the caller only once every peer has read it.
  if (plan.variant == Variant::A2aSymmetricInput && !op.rounds.empty()) {
    op.done_needed_after = op.rounds.back().epoch;
    g.wait_peers_done(op.done_needed_after);
  }
  CE_CUDA_CHECK(cudaStreamWaitEvent(comm, g.self_done_event(), 0), where);
  hand_back(g, std::move(op), a.caller, a.join, where);
}

void enqueue_bcast_locked(Group& g, const BroadcastArgs& a, const std::string& where, const Plan& plan) {
  SymmetricPool& pool = g.pool();
  const int rank = g.rank();
  const bool root = rank == a.root;
  char* t = static_cast<char*>(a.tensor);

  PendingOp op = begin_op(g, "broadcast", OpKind::Broadcast, plan.variant, a.nbytes);
  join_caller(g, a.caller, op, where);
  for (size_t k = 0; k < plan.rounds; ++k) {
    const size_t o = k * plan.round_bytes;
    const size_t b = std::min(plan.round_bytes, a.nbytes - o);
    const uint32_t e = g.next_epoch();
    const RoundSignature sig = round_signature(OpKind::Broadcast, plan.variant, a.nbytes, static_cast<uint32_t>(k), b,
                                               plan.offset, static_cast<uint64_t>(a.root));
    // 1. The epoch window; peers finished pulling our staging region of the previous round / op.
    if (k == 0 && !epoch_ge(g.last_done_waited(), e - 1)) op.done_needed_before = e - 1;
    g.wait_peers_done(e - 1);
    // 2. The root stages this round.
    if (root && plan.variant == Variant::BcStaged) {
      CE_CUDA_CHECK(local_copy_async(pool.local_base() + plan.offset, t + o, b, g.device(), g.comm_stream()),
                    where + ": staging the root's bytes");
    }
    // 3. Announce.
    g.post_ready(PeerSignal{e, sig.sig_a, sig.sig_b,
                            kind_round_word(OpKind::Broadcast, plan.variant, static_cast<uint32_t>(k)), b, plan.offset});
    // 4. Every peer (its ready, our done); only the root's bytes are pulled.
    g.peer_round(where, e, sig, [&](int p, cudaStream_t s) {
      if (p != a.root) return;
      const size_t src = plan.variant == Variant::BcStaged ? plan.offset : plan.offset + o;
      g.pull_copy(t + o, pool.peer_base(p) + src, b, where + ": pulling from the root, rank " + std::to_string(p), s);
    });
    op.rounds.push_back(RoundInfo{e, sig, static_cast<uint32_t>(k), b, plan.offset});
  }
  // The root's symmetric tensor goes back to its caller only once every peer has read it.
  if (root && plan.variant == Variant::BcSymmetric && !op.rounds.empty()) {
    op.done_needed_after = op.rounds.back().epoch;
    g.wait_peers_done(op.done_needed_after);
  }
  hand_back(g, std::move(op), a.caller, nullptr, where);
}

void enqueue_bcast_scatter_locked(Group& g, const BroadcastArgs& a, const std::string& where, const Plan& plan) {
  SymmetricPool& pool = g.pool();
  const int rank = g.rank();
  const int n = g.world_size();
  const bool root = rank == a.root;
  const cudaStream_t comm = g.comm_stream();
  const cudaStream_t self = g.self_stream();
  char* t = static_cast<char*>(a.tensor);
  const size_t S = plan.round_bytes;
  const size_t K = plan.rounds - 1;  // segments
  auto owner = [&](int r) { return (r - a.root - 1 + n) % n; };
  auto segment = [&](size_t k) { return std::min(S, a.nbytes - k * S); };
  // Pool offsets: the root holds segment k, and a non-root its piece of it, at the start of its staging bank k % 2.
  auto bank = [&](size_t k) { return plan.offset + (k % 2) * plan.bank_bytes; };

  PendingOp op = begin_op(g, "broadcast", OpKind::Broadcast, plan.variant, a.nbytes);
  join_caller(g, a.caller, op, where);
  for (size_t k = 0; k <= K; ++k) {
    const size_t b = k < K ? segment(k) : 0;
    const uint32_t e = g.next_epoch();
    const uint64_t root_and_segments = static_cast<uint64_t>(a.root) | static_cast<uint64_t>(K) << 32;
    const RoundSignature sig = round_signature(OpKind::Broadcast, plan.variant, a.nbytes, static_cast<uint32_t>(k), b,
                                               plan.offset, root_and_segments);
    // 1. The epoch window: peers finished reading our bank of round k-1.
    if (k == 0 && !epoch_ge(g.last_done_waited(), e - 1)) op.done_needed_before = e - 1;
    g.wait_peers_done(e - 1);
    // 2. The root stages segment k.
    if (root && k < K) {
      CE_CUDA_CHECK(local_copy_async(pool.local_base() + bank(k), t + k * S, b, g.device(), comm),
                    where + ": staging segment " + std::to_string(k) + " at the root");
    }
    // A non-root pulls into its bank k % 2 again only after its copy-out of round k-2 read it.
    if (!root && k >= 2 && k < K) {
      CE_CUDA_CHECK(cudaStreamWaitEvent(comm, g.bank_event(static_cast<int>(k % 2)), 0), where);
    }
    // 3. Announce.
    const uint32_t kind_round = kind_round_word(OpKind::Broadcast, plan.variant, static_cast<uint32_t>(k));
    g.post_ready(PeerSignal{e, sig.sig_a, sig.sig_b, kind_round, b, plan.offset});
    // 4. The scatter of segment k from the root and the exchange of segment k-1 among the non-roots.
    g.peer_round(where, e, sig, [&](int p, cudaStream_t s) {
      if (!root && p == a.root && k < K) {
        const auto [lo, hi] = piece_of(b, owner(rank), n);
        if (hi > lo) {
          g.pull_copy(pool.local_base() + bank(k), pool.peer_base(p) + bank(k) + lo, hi - lo,
                      where + ": pulling piece " + std::to_string(owner(rank)) + " of segment " + std::to_string(k) +
                          " from the root, rank " + std::to_string(p), s);
        }
      } else if (!root && p != a.root && k >= 1) {
        const auto [lo, hi] = piece_of(segment(k - 1), owner(p), n);
        if (hi > lo) {
          g.pull_copy(t + (k - 1) * S + lo, pool.peer_base(p) + bank(k - 1), hi - lo,
                      where + ": pulling piece " + std::to_string(owner(p)) + " of segment " + std::to_string(k - 1) +
                          " from rank " + std::to_string(p), s);
        }
      }
    });
    // 5. A non-root copies its piece out of its bank into T (beside the next rounds).
    if (!root && k < K) {
      const auto [lo, hi] = piece_of(b, owner(rank), n);
      CE_CUDA_CHECK(cudaEventRecord(g.arrived_event(), comm), where);
      CE_CUDA_CHECK(cudaStreamWaitEvent(self, g.arrived_event(), 0), where);
      if (hi > lo) {
        CE_CUDA_CHECK(
            local_copy_async(t + k * S + lo, pool.local_base() + bank(k), hi - lo, g.device(), self),
            where + ": copying our piece of segment " + std::to_string(k) + " out of the staging bank");
      }
      CE_CUDA_CHECK(cudaEventRecord(g.bank_event(static_cast<int>(k % 2)), self), where);
    }
    op.rounds.push_back(RoundInfo{e, sig, static_cast<uint32_t>(k), b, plan.offset});
  }
  if (!root && K > 0) {  // the last copy-out (the self stream is in order: every one)
    CE_CUDA_CHECK(cudaStreamWaitEvent(comm, g.bank_event(static_cast<int>((K - 1) % 2)), 0), where);
  }
  hand_back(g, std::move(op), a.caller, nullptr, where);
}

void enqueue_bcast_push_locked(Group& g, const BroadcastArgs& a, const std::string& where, const Plan& plan) {
  SymmetricPool& pool = g.pool();
  const int rank = g.rank();
  const int n = g.world_size();
  const bool root = rank == a.root;
  const cudaStream_t comm = g.comm_stream();
  char* t = static_cast<char*>(a.tensor);
  const size_t S = plan.round_bytes;
  const size_t K = (a.nbytes + S - 1) / S;
  const int me = (rank - a.root - 1 + n) % n;  // our piece of every segment (non-roots)

  PendingOp op = begin_op(g, "broadcast", OpKind::Broadcast, plan.variant, a.nbytes);
  join_caller(g, a.caller, op, where);
  const uint32_t e = g.next_epoch();
  const RoundSignature sig = round_signature(OpKind::Broadcast, plan.variant, a.nbytes, 0, S, plan.offset,
                                             static_cast<uint64_t>(a.root) | static_cast<uint64_t>(K) << 32);
  // 1. The epoch window; peers finished with our pool for the previous op.
  if (!epoch_ge(g.last_done_waited(), e - 1)) op.done_needed_before = e - 1;
  g.wait_peers_done(e - 1);
  // 2. Announce: the root's T holds the bytes; a non-root's T accepts the others' pieces.
  g.post_ready(PeerSignal{e, sig.sig_a, sig.sig_b, kind_round_word(OpKind::Broadcast, plan.variant, 0), a.nbytes,
                          plan.offset});
  // 3. Every peer's ready (the root's bytes, the non-roots' T).
  g.wait_ready(g.peers(), e, sig, comm);
  // 4. A non-root's copies. Relay (broadcast_relays: an even world size, a tensor from kRelayMinBytes): every copy on
  //    the comm stream, in broadcast_relay_order.
  //    Otherwise the pull of segment k on the comm stream and its pushes on the push lane, which waits for that pull
  //    (the arrived event, re-recorded per segment: each wait takes the record before it).
  auto piece = [&](size_t k) {
    const size_t b = std::min(S, a.nbytes - k * S);
    const auto [lo, hi] = piece_of(b, me, n);
    return std::pair<size_t, size_t>{k * S + lo, hi > lo ? hi - lo : 0};
  };
  auto pull = [&](size_t k) {  // always on the comm stream
    const auto [at, len] = piece(k);
    if (len == 0) return false;
    g.peer_copy(t + at, pool.peer_base(a.root) + plan.offset + at, len,
                where + ": pulling piece " + std::to_string(me) + " of segment " + std::to_string(k) +
                    " from the root, rank " + std::to_string(a.root),
                comm);
    return true;
  };
  auto push = [&](size_t k, int q, cudaStream_t stream) {
    const auto [at, len] = piece(k);
    if (len == 0) return;
    g.peer_copy(pool.peer_base(q) + plan.offset + at, t + at, len,
                where + ": pushing piece " + std::to_string(me) + " of segment " + std::to_string(k) + " into rank " +
                    std::to_string(q),
                stream);
  };
  if (!root && broadcast_relays(n, a.nbytes)) {
    for (const RelayCopy& c : broadcast_relay_order(n, me, K)) {
      if (c.pull) {
        pull(static_cast<size_t>(c.segment));
      } else {
        push(static_cast<size_t>(c.segment), (a.root + 1 + c.to) % n, comm);
      }
    }
  } else if (!root) {
    const cudaStream_t pushes = g.lane(1);  // n >= 3: lane 1 exists
    for (size_t k = 0; k < K; ++k) {
      if (!pull(k)) continue;
      CE_CUDA_CHECK(cudaEventRecord(g.arrived_event(), comm), where);
      CE_CUDA_CHECK(cudaStreamWaitEvent(pushes, g.arrived_event(), 0), where);
      for (int i = 1; i < n; ++i) {
        const int q = (rank + i) % n;
        if (q != a.root) push(k, q, pushes);
      }
    }
    g.join_lane(1, where);
  }
  // 5. Done to every peer (the root: read; the others: written into), then every peer's done: the root's T was read
  //    by every non-root, a non-root's T holds every piece.
  g.post_done(g.peers(), e, comm);
  op.rounds.push_back(RoundInfo{e, sig, 0, a.nbytes, plan.offset});
  op.done_needed_after = e;
  g.wait_peers_done(e);
  hand_back(g, std::move(op), a.caller, nullptr, where);
}

}  // namespace

void enqueue_all_to_all(Group& g, const AllToAllArgs& a) {
  auto plan_op = [&] {
    SymmetricPool& pool = g.pool();
    const size_t n = static_cast<size_t>(g.world_size());
    Plan plan;
    if (const std::optional<size_t> in_offset = pool.user_region_offset(a.input, a.chunk_bytes * n)) {
      plan.variant = Variant::A2aSymmetricInput;
      plan.offset = *in_offset;
      plan.round_bytes = a.chunk_bytes;
    } else {
      plan.variant = Variant::A2aStaged;
      plan.offset = pool.staging_offset();
      plan.round_bytes = pool.staging_bytes() / n / kPoolAlignment * kPoolAlignment;
      if (plan.round_bytes == 0) {
        throw std::runtime_error("ce_overlap.all_to_all_single: the staging region of group '" + g.name() + "' (" +
                                 std::to_string(pool.staging_bytes()) + " bytes) is too small for " +
                                 std::to_string(n) + " chunk slots; raise RuntimeConfig.staging_mb (CE_OVERLAP_STAGING_MB)");
      }
    }
    plan.rounds = n == 1 ? 0 : (a.chunk_bytes + plan.round_bytes - 1) / plan.round_bytes;
    return plan;
  };
  enqueue_op(g, "all_to_all_single", a.chunk_bytes == 0, a.caller, plan_op,
             [&](const std::string& where, const Plan& plan) { enqueue_a2a_locked(g, a, where, plan); });
}

void enqueue_broadcast(Group& g, const BroadcastArgs& a) {
  if (a.root < 0 || a.root >= g.world_size()) {
    throw std::invalid_argument("ce_overlap.broadcast: root " + std::to_string(a.root) + " is not a rank of group '" +
                                g.name() + "' (" + std::to_string(g.world_size()) + " ranks)");
  }
  auto plan_op = [&] {
    SymmetricPool& pool = g.pool();
    Plan plan;
    const std::optional<size_t> symmetric = pool.user_region_offset(a.tensor, a.nbytes);
    if (symmetric && g.world_size() >= 3) {
      const size_t K = broadcast_push_segments(g.world_size(), a.nbytes, g.bcast_segments());
      plan.variant = Variant::BcPushSymmetric;
      plan.offset = *symmetric;
      plan.round_bytes = ((a.nbytes + K - 1) / K + kPieceAlign - 1) / kPieceAlign * kPieceAlign;  // the segment
      plan.rounds = 1;
      return plan;
    }
    // A staged tensor on 3+ ranks, from a few MiB: the scatter + all-gather through the two staging banks.
    const size_t bank_bytes = pool.staging_bytes() / 2 / kPoolAlignment * kPoolAlignment;
    size_t K = symmetric ? 0 : broadcast_segments(g.world_size(), a.nbytes, g.bcast_segments());
    if (K > 0) K = std::max(K, (a.nbytes + bank_bytes - 1) / std::max<size_t>(bank_bytes, 1));
    if (K > 0 && bank_bytes >= kPieceAlign) {
      plan.variant = Variant::BcScatterStaged;
      plan.offset = pool.staging_offset();
      plan.bank_bytes = bank_bytes;
      plan.round_bytes = ((a.nbytes + K - 1) / K + kPieceAlign - 1) / kPieceAlign * kPieceAlign;
      plan.round_bytes = std::min(plan.round_bytes, bank_bytes / kPieceAlign * kPieceAlign);
      plan.rounds = (a.nbytes + plan.round_bytes - 1) / plan.round_bytes + 1;  // K segments + the last exchange
      return plan;
    }
    if (symmetric) {
      plan.variant = Variant::BcSymmetric;
      plan.offset = *symmetric;
      plan.round_bytes = a.nbytes;
    } else {
      plan.variant = Variant::BcStaged;
      plan.offset = pool.staging_offset();
      plan.round_bytes = pool.staging_bytes();
    }
    plan.rounds = g.world_size() == 1 ? 0 : (a.nbytes + plan.round_bytes - 1) / plan.round_bytes;
    return plan;
  };
  enqueue_op(g, "broadcast", a.nbytes == 0, a.caller, plan_op, [&](const std::string& where, const Plan& plan) {
    if (plan.variant == Variant::BcPushSymmetric) {
      enqueue_bcast_push_locked(g, a, where, plan);
    } else if (plan.variant == Variant::BcScatterStaged) {
      enqueue_bcast_scatter_locked(g, a, where, plan);
    } else {
      enqueue_bcast_locked(g, a, where, plan);
    }
  });
}

}  // namespace ce_overlap

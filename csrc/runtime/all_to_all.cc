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
//   symmetric (T lies in the user region at O on every rank): one round, non-roots pull the root's T in place; the
//     root then WAITs done[p] >= e from every peer before T goes back to its caller.
//   Every rank posts and waits for every peer, not only the root: the epoch window (1) needs a done from every peer.
//   The root is in the signature, so ranks that disagree on it block instead of pulling from a non-root.
//   tests/runtime/protocol_model.py replays both enqueue sequences under random schedules (CPU test).
// ====================================================================================================
#include "all_to_all.h"

#include <algorithm>
#include <optional>

namespace ce_overlap {

namespace {

// How an all-to-all or broadcast moves its bytes, decided before any epoch is consumed.
struct Plan {
  Variant variant = Variant::A2aStaged;
  size_t offset = 0;       // the staging region, or the zero-copy tensor's pool offset (the same on every rank)
  size_t round_bytes = 0;  // all-to-all: per chunk
  size_t rounds = 0;
};

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
    for (int i = 1; i < n; ++i) {
      const int p = (rank + i) % n;
      const size_t src = plan.variant == Variant::A2aStaged ? plan.offset + r * plan.round_bytes : plan.offset + r * C;
      g.wait_peer_ready(p, e, sig);
      g.pull_copy(out + static_cast<size_t>(p) * C + o, pool.peer_base(p) + src, b,
                  where + ": pulling the chunk of rank " + std::to_string(p));
      g.post_done(p);
    }
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
  const int n = g.world_size();
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
    // 4. Every peer; only the root's bytes are pulled.
    for (int i = 1; i < n; ++i) {
      const int p = (rank + i) % n;
      g.wait_peer_ready(p, e, sig);
      if (p == a.root) {
        const size_t src = plan.variant == Variant::BcStaged ? plan.offset : plan.offset + o;
        g.pull_copy(t + o, pool.peer_base(p) + src, b, where + ": pulling from the root, rank " + std::to_string(p));
      }
      g.post_done(p);
    }
    op.rounds.push_back(RoundInfo{e, sig, static_cast<uint32_t>(k), b, plan.offset});
  }
  // The root's symmetric tensor goes back to its caller only once every peer has read it.
  if (root && plan.variant == Variant::BcSymmetric && !op.rounds.empty()) {
    op.done_needed_after = op.rounds.back().epoch;
    g.wait_peers_done(op.done_needed_after);
  }
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
    if (const std::optional<size_t> offset = pool.user_region_offset(a.tensor, a.nbytes)) {
      plan.variant = Variant::BcSymmetric;
      plan.offset = *offset;
      plan.round_bytes = a.nbytes;
    } else {
      plan.variant = Variant::BcStaged;
      plan.offset = pool.staging_offset();
      plan.round_bytes = pool.staging_bytes();
    }
    plan.rounds = g.world_size() == 1 ? 0 : (a.nbytes + plan.round_bytes - 1) / plan.round_bytes;
    return plan;
  };
  enqueue_op(g, "broadcast", a.nbytes == 0, a.caller, plan_op,
             [&](const std::string& where, const Plan& plan) { enqueue_bcast_locked(g, a, where, plan); });
}

}  // namespace ce_overlap

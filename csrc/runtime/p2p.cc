// Point-to-point send / recv on copy engines only: no SM kernel moves data or signals.
//
// ===================================== The protocol =================================================
// Collectives count group-wide epochs because every rank takes part in every one; a send involves two ranks, so
// every ordered pair (sender s, receiver d) is a CHANNEL with its own round counter on each side (Group::
// next_p2p_round), advanced identically because the sends from s to d and the receives at d from s are matched in
// order (as NCCL's), and with its own streams: s runs its sends to d on its send stream for d, d its receives from s
// on its receive stream for s. Flags: p2p_credit[d] in s's pool (written by d), p2p_landed[s] in d's pool (written
// by s); as for collectives every wait is local (cuStreamWaitValue32 on our own flags) and every write to a peer is
// a 32-byte cudaMemcpyAsync from our per-channel outbox. Signal: {round t, signature, kind|variant|round, bytes,
// offset}; the signature covers the variant, the message size, the bank size and (direct) the tensor's offset, and
// is the same for every round of a message.
//
// Each receiver's p2p landing region holds one SLOT per sender, two BANKS of L bytes each
// (L = RuntimeConfig.p2p_mb / (n - 1) / 2). Round t of a channel uses bank t % 2.
//
// STAGED (the tensors are not in the user region): a message of B bytes takes K = ceil(B / L) rounds t0 .. t0+K-1.
//   Receiver d, receive stream for s:
//     0. wait for the caller's stream (event): the output may be written from here on.
//     1. POST credit t0 (and t0+1 when K > 1) to s: "bank t % 2 of your slot accepts round t".
//     For k = 0 .. K-1 (t = t0 + k):
//     2. WAIT landed[s] >= t with the message's signature.
//     3. copy bank t % 2 -> out[k*L, +b) (a local copy: local_copy_async asks for a copy engine).
//     4. k + 2 < K: POST credit t+2 (the bank just copied out is free again).
//     5. record `end`; hand back to the caller.
//   Sender s, send stream for d:
//     0. wait for the caller's stream (event): the input is complete.
//     For k = 0 .. K-1: WAIT credit[d] >= t with the signature; PUSH in[k*L, +b) -> d's bank t % 2 of our slot;
//     POST landed t to d.  Then record `end`.
// DIRECT (both tensors in the user region at the same offset O, e.g. one empty_symmetric buffer used on both sides):
//   one round t: d POSTs credit t after joining its caller (its tensor may be written), then WAITs landed >= t;
//   s WAITs credit >= t, PUSHes in -> d's pool at O, POSTs landed t.
//
// Why it is safe:
//   * Data before flag: d reads bank t % 2 (staged) or returns its tensor (direct) only after landed >= t, which s
//     posts after its push of round t completed (stream order on s's send stream).
//   * No overwrite while in use: s pushes round t only after credit >= t. d posts credit t after joining its caller
//     (direct: the tensor is free; staged rounds 0 and 1: every earlier use of the slot's banks, the local copies of
//     earlier messages, precedes it on the same receive stream), and credit t+2 only after its copy of round t,
//     the bank's previous use. A bank is never written while d copies from it, nor copied before it is complete.
//   * A signal never runs a message ahead of its waiter: d posts the credits of a message only after it finished the
//     previous message (after waiting for that message's last landed signal, which s posts after its wait for the
//     last credit), and s posts landed t only after credit t. So while one side waits for round t of message m, the
//     other side's flag holds a round of message m or an earlier one: the signature it carries is m's (or a smaller
//     round that fails the GEQ), and a mismatch (sizes, variants, offsets, sends and receives matched differently)
//     blocks the waits; the watchdog then names the peer and both sides' signals (Group::diagnose_p2p).
//   * No deadlock: a channel depends only on its own two streams and their callers: s's round t waits for d's credit
//     t, which d posts at the start of the message or after round t-2, which waits for s's landed t-2, posted by s
//     before it waits for credit t. Channels never wait for each other, so any set of sends and receives whose ops
//     all joined their callers is deadlock-free. A caller that makes its stream wait for a send before it enqueues
//     the receive that this send's peer needs first is not: that is what batching (one caller join for every op of
//     the batch, one wait for all of them after) and async ops are for, as with NCCL.
//   * Zero bytes: nothing is enqueued and no round is consumed (consistently on both sides, since sizes match).
//   * A paced push (Group::peer_copy with copy_rate_gbps > 0, each send channel its own pacer) is, to every argument
//     above, one push: its chunks and the pacer launches between them run in order on the send stream, before the
//     POST landed that follows them.
//   * Timeouts: every op is timed by the watchdog from the moment its stream reached it; poisoning writes "far
//     future" rounds and the poison bits into p2p_credit / p2p_landed too, so the channel streams drain.
//   tests/runtime/protocol_model.py replays these enqueue sequences under random schedules (CPU test).
// ====================================================================================================
#include "p2p.h"

#include <algorithm>
#include <optional>
#include <stdexcept>

namespace ce_overlap {

namespace {

struct Landing {
  size_t slot_bytes = 0;  // per sender
  size_t bank_bytes = 0;  // L: half a slot
};

Landing landing_of(Group& g) {
  const size_t n = static_cast<size_t>(g.world_size());
  Landing l;
  l.slot_bytes = n > 1 ? g.pool().p2p_bytes() / (n - 1) / kPoolAlignment * kPoolAlignment : 0;
  l.bank_bytes = l.slot_bytes / 2 / kPoolAlignment * kPoolAlignment;
  if (n > 1 && l.bank_bytes == 0) {
    throw std::runtime_error("ce_overlap.batch_isend_irecv: the p2p landing region of group '" + g.name() + "' (" +
                             std::to_string(g.pool().p2p_bytes()) + " bytes) is too small for 2 banks per sender; "
                             "raise RuntimeConfig.p2p_mb (CE_OVERLAP_P2P_MB)");
  }
  return l;
}

int slot_of(int sender, int receiver) { return sender < receiver ? sender : sender - 1; }

// Pool offset of bank `bank` of `sender`'s slot in `receiver`'s landing region.
size_t bank_offset(const SymmetricPool& pool, const Landing& l, int sender, int receiver, uint32_t bank) {
  return pool.p2p_offset() + static_cast<size_t>(slot_of(sender, receiver)) * l.slot_bytes +
         static_cast<size_t>(bank) * l.bank_bytes;
}

struct OpPlan {
  Variant variant = Variant::P2pStaged;
  size_t offset = 0;  // direct: the tensor's pool offset (the same on both sides)
  size_t round_bytes = 0;
  size_t rounds = 0;
  RoundSignature sig{};
};

struct BatchPlan {
  Landing landing;
  std::vector<OpPlan> ops;
};

void enqueue_send(Group& g, const P2pOp& o, const OpPlan& plan, const Landing& l, cudaStream_t stream, PendingOp& op,
                  const std::string& what) {
  SymmetricPool& pool = g.pool();
  const char* in = static_cast<const char*>(o.tensor);
  for (size_t k = 0; k < plan.rounds; ++k) {
    const uint32_t t = g.next_p2p_round(o.peer, /*send=*/true);
    const size_t off = k * plan.round_bytes;
    const size_t b = std::min(plan.round_bytes, o.nbytes - off);
    const size_t dst = plan.variant == Variant::P2pDirect ? plan.offset : bank_offset(pool, l, g.rank(), o.peer, t % 2);
    g.wait_p2p(o.peer, /*credit=*/true, t, plan.sig, stream);
    g.peer_copy(pool.peer_base(o.peer) + dst, in + off, b, what + ": pushing round " + std::to_string(k), stream);
    g.post_p2p(o.peer, /*credit=*/false,
               PeerSignal{t, plan.sig.sig_a, plan.sig.sig_b,
                          kind_round_word(OpKind::Send, plan.variant, static_cast<uint32_t>(k)), b, dst},
               stream);
    op.rounds.push_back(RoundInfo{t, plan.sig, static_cast<uint32_t>(k), b, dst});
  }
}

void enqueue_recv(Group& g, const P2pOp& o, const OpPlan& plan, const Landing& l, cudaStream_t stream, PendingOp& op,
                  const std::string& what) {
  SymmetricPool& pool = g.pool();
  char* out = static_cast<char*>(o.tensor);
  std::vector<uint32_t> rounds(plan.rounds);
  for (uint32_t& t : rounds) t = g.next_p2p_round(o.peer, /*send=*/false);
  auto bytes_of = [&](size_t k) { return std::min(plan.round_bytes, o.nbytes - k * plan.round_bytes); };
  auto where_of = [&](size_t k) {
    return plan.variant == Variant::P2pDirect ? plan.offset : bank_offset(pool, l, o.peer, g.rank(), rounds[k] % 2);
  };
  auto credit = [&](size_t k) {
    g.post_p2p(o.peer, /*credit=*/true,
               PeerSignal{rounds[k], plan.sig.sig_a, plan.sig.sig_b,
                          kind_round_word(OpKind::Recv, plan.variant, static_cast<uint32_t>(k)), bytes_of(k), where_of(k)},
               stream);
  };
  // 1. Both banks accept the first two rounds.
  for (size_t k = 0; k < std::min<size_t>(2, plan.rounds); ++k) credit(k);
  for (size_t k = 0; k < plan.rounds; ++k) {
    const size_t b = bytes_of(k);
    // 2. Round k has landed.
    g.wait_p2p(o.peer, /*credit=*/false, rounds[k], plan.sig, stream);
    // 3. Copy it out of its bank (direct: it landed in place).
    if (plan.variant == Variant::P2pStaged) {
      CE_CUDA_CHECK(local_copy_async(out + k * plan.round_bytes, pool.local_base() + where_of(k), b, g.device(), stream),
                    what + ": copying round " + std::to_string(k) + " out of its landing bank");
    }
    // 4. Its bank takes round k + 2.
    if (k + 2 < plan.rounds) credit(k + 2);
    op.rounds.push_back(RoundInfo{rounds[k], plan.sig, static_cast<uint32_t>(k), b, where_of(k)});
  }
}

}  // namespace

size_t p2p_round_bytes(Group& g) { return landing_of(g).bank_bytes; }

void enqueue_p2p_batch(Group& g, const P2pBatchArgs& a) {
  if (!a.joins.empty() && a.joins.size() != a.ops.size()) {
    throw std::invalid_argument("ce_overlap.batch_isend_irecv: " + std::to_string(a.joins.size()) + " join events for " +
                                std::to_string(a.ops.size()) + " ops");
  }
  bool empty = true;
  for (const P2pOp& o : a.ops) {
    if (o.peer < 0 || o.peer >= g.world_size() || o.peer == g.rank()) {
      throw std::invalid_argument("ce_overlap.batch_isend_irecv: " + std::string(o.send ? "send to" : "recv from") +
                                  " rank " + std::to_string(o.peer) + " on group '" + g.name() + "' (rank " +
                                  std::to_string(g.rank()) + " of " + std::to_string(g.world_size()) +
                                  "): the peer must be another rank of the group");
    }
    empty = empty && o.nbytes == 0;
  }
  auto plan_batch = [&] {
    BatchPlan plan;
    plan.landing = landing_of(g);
    for (const P2pOp& o : a.ops) {
      OpPlan p;
      if (const std::optional<size_t> offset = g.pool().user_region_offset(o.tensor, o.nbytes)) {
        p.variant = Variant::P2pDirect;
        p.offset = *offset;
        p.round_bytes = std::max<size_t>(o.nbytes, 1);
      } else {
        p.variant = Variant::P2pStaged;
        p.round_bytes = plan.landing.bank_bytes;
      }
      p.rounds = o.nbytes == 0 ? 0 : (o.nbytes + p.round_bytes - 1) / p.round_bytes;
      // One signature for every round of the message, computed alike on both sides (kind Send for both).
      p.sig = round_signature(OpKind::Send, p.variant, o.nbytes, 0, p.round_bytes, p.offset);
      plan.ops.push_back(p);
    }
    return plan;
  };
  enqueue_op(g, "batch_isend_irecv", empty, a.caller, plan_batch, [&](const std::string& where, const BatchPlan& plan) {
    CE_CUDA_CHECK(cudaEventRecord(g.caller_ready_event(), a.caller), where);
    for (size_t i = 0; i < a.ops.size(); ++i) {
      const P2pOp& o = a.ops[i];
      const OpPlan& p = plan.ops[i];
      const cudaEvent_t join = a.joins.empty() ? nullptr : a.joins[i];
      const std::string what = where + ": " + (o.send ? "send to rank " : "recv from rank ") + std::to_string(o.peer);
      const cudaStream_t stream = g.p2p_stream(o.peer, o.send);
      if (p.rounds == 0) {  // an empty op in a non-empty batch: nothing to move, but an async caller joins it
        if (join != nullptr) CE_CUDA_CHECK(cudaEventRecord(join, a.caller), what);
        continue;
      }
      PendingOp op = begin_op(g, o.send ? "send" : "recv", o.send ? OpKind::Send : OpKind::Recv, p.variant, o.nbytes);
      op.peer = o.peer;
      start_on(g, stream, op, what);
      if (o.send) {
        enqueue_send(g, o, p, plan.landing, stream, op, what);
      } else {
        enqueue_recv(g, o, p, plan.landing, stream, op, what);
      }
      hand_back_from(g, stream, std::move(op), a.caller, join, what);
    }
  });
}

}  // namespace ce_overlap

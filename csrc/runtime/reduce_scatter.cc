// Reduce-scatter: copy engines move the chunks (push), one reduction kernel with a bounded CTA count sums them.
//
// ===================================== The protocol =================================================
// Same actors, flags and signalling rules as the all-gather (all_gather.cc, "The protocol"; read it first).
// Rank r's input holds n chunks of C bytes; chunk p belongs to rank p. Every rank's STAGING region is split
// into 2 BANKS, each holding n-1 SLOTS of S bytes; in a receiver p, the slot of sender q is
// slot(q, p) = q < p ? q : q - 1 (no slot for p itself). A round moves up to R = min(S,
// RuntimeConfig.rs_round_mb) bytes of every chunk, so an op takes ceil(C / R) rounds; round k uses bank k % 2,
// so the reduction of round k (on the group's reduce stream) overlaps the copies of round k+1.
//
// Rank r, comm stream, for the op (epoch e per round, bytes b, chunk offset o = k * R):
//   0. wait for the caller's stream (event).
//   For each round k:
//   1. WAIT done[p] >= e-1 for every peer p (skipped if already known): the epoch window, and every peer
//      is finished with our pool for the previous round/op (a pull all-gather reading our staging region).
//   2. k >= 2: WAIT (event) until the reduction of round k-2 finished reading bank k % 2.
//   3. POST ready {e, signature, kind|variant|round, b, bank offset}: "bank k % 2 accepts your chunks".
//   4. For i = 1..n-1, peer p = (r+i) % n:
//        WAIT ready[p] >= e with our signature (which covers sizes, round, dtype and reduce op)
//        PUSH input[p*C + o, +b) -> p's pool: staging + bank * bank_bytes + slot(r, p) * S
//        POST done: copy the done outbox (= e) into done[r] of p ("r's chunk for e landed in p").
//   5. WAIT done[p] >= e for every peer: all n-1 chunks of round k landed in our bank.
//   6. record `arrived` on comm; the reduce stream waits for it and runs the reduction kernel:
//        out[o, +b) = sum over q in rank order of (q == r ? input[r*C + o, +b) : bank slot(q, r)),
//        fp32 accumulation, avg divides by n; then records bank_event(k % 2).
//   After the last round: comm waits for the last reduction (the reduce stream is in order, so for all of
//   them), records `end`; the caller's stream waits on `end`.
//   Several parts (reduce_scatter_tensors) are one op over the concatenation of their chunks (C = sum of the parts'
//   chunk bytes): the pushes of 4 and the reduction of 6 are split at part boundaries (one copy / one launch per
//   piece), reading each part's own chunks where they lie. The part sizes are hashed into the signature.
//   A group of one: the reduce stream waits for the caller and runs the kernel over the chunk (sum or
//   avg of one input), no epoch.
//   Unreduced (reduce_scatter_tensors_unreduced, variant RsUnreduced): the same rounds, but step 6 copies each of
//   the n-1 slots of the round into row slot(q, r) of the output ([n-1, C], peers in rank order) with the copy
//   engines instead of reducing; the caller adds its own chunk (a compiled graph fuses the sum into the kernel
//   that consumes the result, with every SM, instead of a bounded kernel beside the backward's GEMMs). The
//   variant is in the signature, so a rank running the reducing form never pairs with one running this one.
//   A group of one moves nothing (the output has no rows).
//   The reduction kernels are loaded when the group is created (group.cc): a first launch under lazy
//   loading may wait for the device to go idle, which, inside this enqueue with the comm stream waiting
//   for a peer's ready, could wait forever (the lock the watchdog needs is held here).
//   Round size R (RuntimeConfig.rs_round_mb, or tune()) must match on every rank: b is in the signature.
//
// Why it is safe (in addition to the all-gather's argument for the epoch window and deadlock freedom,
// which holds unchanged: every round-e done is posted after the wait for that peer's round-e ready, and
// every rank posts its round-e ready before its first round-e wait):
//   * Data before reduction: the reduction of round k runs after our wait for done = e from every peer
//     (5, then `arrived`), and each peer posts done = e after its push into us completed (stream order).
//   * No overwrite while reduced: a peer writes into our bank k % 2 only after our ready for round k (3),
//     which we post after the reduction of round k-2, the bank's previous user in this op, finished (2).
//     Reductions of earlier ops finished before their op's `end` (comm waited for them), so the first two
//     rounds of an op find both banks free; so does any later op that reuses the staging region (a pull
//     all-gather stages into it only after waiting for done >= e-1, i.e. after every peer's last push).
//   * The caller's buffers: the comm stream joins the caller before any read of the input (0); the
//     reduce stream reads the own chunk and writes the output only after `arrived`, recorded after that
//     join; the caller waits for `end`, after the last reduction. Pushes read only chunks p != r, the
//     reduction writes only the output, so an output that IS the own chunk (in place) is safe.
//   * Mismatches (sizes, dtype, reduce op, round size) change the signature: the ready waits never pass
//     and the watchdog reports both sides; a sender never writes into a peer that is not in the same op.
//     A round never exceeds a slot (S is the same on every rank: the staging size is checked at
//     rendezvous), so even a signature collision cannot write outside the peer's bank.
//   * Timeouts: as for the all-gather. Draining (poisoned flags) lets our remaining pushes land in the
//     peers' staging regions; the job must be restarted anyway.
//   tests/runtime/protocol_model.py replays these enqueue sequences under random schedules (CPU test).
// ====================================================================================================
#include "reduce_scatter.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace ce_overlap {

namespace {

struct Layout {
  size_t bank_bytes = 0;   // staging / 2
  size_t slot_bytes = 0;   // bank / (n - 1)
  size_t round_bytes = 0;  // min(slot, RuntimeConfig.rs_round_mb)
};

Layout layout_of(Group& g) {
  const size_t n = static_cast<size_t>(g.world_size());
  Layout l;
  l.bank_bytes = g.pool().staging_bytes() / 2 / kPoolAlignment * kPoolAlignment;
  l.slot_bytes = n > 1 ? l.bank_bytes / (n - 1) / kPoolAlignment * kPoolAlignment : l.bank_bytes;
  l.round_bytes = std::min(l.slot_bytes, g.rs_round_bytes());
  if (l.round_bytes == 0) {
    throw std::runtime_error("ce_overlap.reduce_scatter_tensor: the staging region of group '" + g.name() + "' (" +
                             std::to_string(g.pool().staging_bytes()) + " bytes) is too small for 2 banks of " +
                             std::to_string(n - 1) + " slots; raise RuntimeConfig.staging_mb (CE_OVERLAP_STAGING_MB)");
  }
  return l;
}

int slot_of(int sender, int receiver) { return sender < receiver ? sender : sender - 1; }

const char* op_name(const ReduceScatterArgs& a) {
  if (a.unreduced) return "reduce_scatter_tensors_unreduced";
  return a.parts.size() == 1 ? "reduce_scatter_tensor" : "reduce_scatter_tensors";
}

void enqueue_locked(Group& g, const ReduceScatterArgs& a, const std::string& where, const Layout& l, size_t rounds);

}  // namespace

size_t reduce_scatter_round_bytes(Group& g) { return layout_of(g).round_bytes; }

void enqueue_reduce_scatter(Group& g, const ReduceScatterArgs& a) {
  auto plan_op = [&] { return layout_of(g); };  // may throw (staging too small): nothing consumed yet
  const size_t C = a.chunk_bytes();
  enqueue_op(g, op_name(a), C == 0 || (a.unreduced && g.world_size() == 1), a.caller, plan_op,
             [&](const std::string& where, const Layout& l) {
               const size_t rounds = g.world_size() == 1 ? 0 : (C + l.round_bytes - 1) / l.round_bytes;
               enqueue_locked(g, a, where, l, rounds);
             });
}

namespace {

void enqueue_locked(Group& g, const ReduceScatterArgs& a, const std::string& where, const Layout& l, size_t rounds) {
  SymmetricPool& pool = g.pool();
  const int rank = g.rank();
  const int n = g.world_size();
  const cudaStream_t comm = g.comm_stream();
  const cudaStream_t red = g.reduce_stream();
  char* out = static_cast<char*>(a.output);
  const size_t C = a.chunk_bytes();
  const Variant variant = a.unreduced ? Variant::RsUnreduced : Variant::RsPush;
  const size_t elem = a.unreduced ? 1 : reduce_elem_size(a.dtype);
  const ReduceDType out_dtype = a.out_dtype.value_or(a.dtype);
  const size_t out_elem = a.unreduced ? 1 : reduce_elem_size(out_dtype);
  // The output dtype is part of what must match (a widening rank never pairs with a plain one).
  const uint64_t extra = (a.unreduced ? 0
                                      : static_cast<uint64_t>(out_dtype) << 16 | static_cast<uint64_t>(a.dtype) << 8 |
                                            static_cast<uint64_t>(a.op)) ^
                         parts_hash(a.parts);
  // The reduction of the bytes [o, o + b) of our chunk; `slots` holds the peers' bytes of that range (nullptr: n = 1).
  // Input byte x of the chunk is output element x / elem (output byte x / elem * out_elem when widening).
  auto reduce = [&](size_t o, size_t b, const char* slots, size_t slot_stride) {
    for_each_piece(a.parts, o, b, [&](const ReduceScatterPart& part, size_t from, size_t at, size_t len) {
      const char* own = static_cast<const char*>(part.input) + static_cast<size_t>(rank) * part.bytes + from;
      ReduceParams p{out + (o + at) / elem * out_elem, own, slots ? slots + at : nullptr, slot_stride, len / elem, n,
                     rank, a.op};
      CE_CUDA_CHECK(launch_reduce(a.dtype, out_dtype, p, g.reduce_ctas(), red), where + ": launching the reduction");
    });
  };
  // Unreduced: the bytes [o, o + b) of every peer's slot into its output row (row j = slot j: peers in rank order).
  auto copy_out = [&](size_t o, size_t b, const char* slots, size_t slot_stride) {
    for (int j = 0; j + 1 < n; ++j) {
      CE_CUDA_CHECK(local_copy_async(out + static_cast<size_t>(j) * C + o, slots + static_cast<size_t>(j) * slot_stride,
                                     b, g.device(), red),
                    where + ": copying out the chunk of rank " + std::to_string(j < rank ? j : j + 1));
    }
  };

  // 0. Join the caller's stream.
  PendingOp op = begin_op(g, op_name(a), OpKind::ReduceScatter, variant, C);
  join_caller(g, a.caller, op, where);

  if (n == 1) {
    CE_CUDA_CHECK(cudaStreamWaitEvent(red, g.caller_ready_event(), 0), where);
    reduce(0, C, nullptr, 0);
    CE_CUDA_CHECK(cudaEventRecord(g.bank_event(0), red), where);
    CE_CUDA_CHECK(cudaStreamWaitEvent(comm, g.bank_event(0), 0), where);
  }

  for (size_t k = 0; k < rounds; ++k) {
    const size_t o = k * l.round_bytes;
    const size_t b = std::min(l.round_bytes, C - o);
    const int bank = static_cast<int>(k % 2);
    const size_t recv = pool.staging_offset() + static_cast<size_t>(bank) * l.bank_bytes;
    const uint32_t e = g.next_epoch();
    const RoundSignature sig = round_signature(OpKind::ReduceScatter, variant, C, static_cast<uint32_t>(k), b, recv, extra);
    // 1. The epoch window; peers are finished with our pool for the previous round / op.
    if (k == 0 && !epoch_ge(g.last_done_waited(), e - 1)) op.done_needed_before = e - 1;
    g.wait_peers_done(e - 1);
    // 2. The bank's previous reduction in this op is finished.
    if (k >= 2) CE_CUDA_CHECK(cudaStreamWaitEvent(comm, g.bank_event(bank), 0), where);
    // 3. Our bank accepts chunks.
    g.post_ready(PeerSignal{e, sig.sig_a, sig.sig_b,
                            kind_round_word(OpKind::ReduceScatter, variant, static_cast<uint32_t>(k)), b, recv});
    // 4. Push chunk p of this round into peer p's slot for us (piece by piece when the op has several parts), on the
    //    peer lanes.
    g.peer_round(where, e, sig, [&](int p, cudaStream_t s) {
      char* dst = pool.peer_base(p) + recv + static_cast<size_t>(slot_of(rank, p)) * l.slot_bytes;
      for_each_piece(a.parts, o, b, [&](const ReduceScatterPart& part, size_t from, size_t at, size_t len) {
        const char* src = static_cast<const char*>(part.input) + static_cast<size_t>(p) * part.bytes + from;
        const std::string what = where + ": pushing chunk " + std::to_string(p) + " to rank " + std::to_string(p);
        g.peer_copy(dst + at, src, len, what, s);
      });
    });
    // 5. Every peer's chunk of this round is in our bank.
    g.wait_peers_done(e);
    // 6. Reduce it (or copy it out, unreduced) on the reduce stream.
    CE_CUDA_CHECK(cudaEventRecord(g.arrived_event(), comm), where);
    CE_CUDA_CHECK(cudaStreamWaitEvent(red, g.arrived_event(), 0), where);
    if (a.unreduced) {
      copy_out(o, b, pool.local_base() + recv, l.slot_bytes);
    } else {
      reduce(o, b, pool.local_base() + recv, l.slot_bytes);
    }
    CE_CUDA_CHECK(cudaEventRecord(g.bank_event(bank), red), where);
    op.rounds.push_back(RoundInfo{e, sig, static_cast<uint32_t>(k), b, recv});
  }
  // The last reduction (and so every earlier one: the reduce stream is in order) is finished.
  if (rounds > 0) CE_CUDA_CHECK(cudaStreamWaitEvent(comm, g.bank_event(static_cast<int>((rounds - 1) % 2)), 0), where);
  hand_back(g, std::move(op), a.caller, a.join, where);
}

}  // namespace

}  // namespace ce_overlap

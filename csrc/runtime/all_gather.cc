// All-gather into tensor, pull-based, on copy engines only: no SM kernel moves data or signals.
//
// ===================================== The protocol =================================================
// Actors: n ranks of one group, each with a symmetric pool (symmetric_pool.h) mapped into every peer,
// a comm stream and a self stream. `e` is the group's epoch counter (group.h), advanced identically on
// every rank because every rank enqueues the same collectives in the same order (as with NCCL).
// Flags live in the RECEIVER's memory and are only waited on locally; writes to peers are 32- or
// 4-byte cudaMemcpyAsync from a local outbox (cuStreamWriteValue32 to remote memory is unsupported from
// CUDA 13.1 on).
//
// One op = one or more ROUNDS; each round consumes one epoch e and moves up to R bytes per rank:
//   zero-copy: the input already lies in the user region of our pool, at offset O. Peers read it in
//              place. One round. (O is the same on every rank because empty_symmetric is SPMD.)
//   staged:    the input is elsewhere; it is copied into the staging region, R = staging size, and
//              the op takes ceil(bytes / R) rounds.
//
// Rank r, comm stream, for the op:
//   0. wait for the caller's stream (event); the self stream does too and copies the own shard
//      input -> out[r] (skipped when the input already IS out[r]: in-place all-gather).
//   For each round (epoch e, bytes b, source offset O):
//   1. WAIT done[p] >= e-1 for every peer p            (skipped if already known)
//        Every peer finished reading our pool for the previous round/op, so (a) the staging region may
//        be overwritten, and (b) no peer is still inside epoch e-1 when we announce e (see 3).
//   2. staged only: copy input chunk -> our staging region (local_copy_async: asks for a copy engine).
//   3. POST ready: stream-write {e, signature, kind, round, b, O} into our outbox (and e into the done
//      outbox), then copy the outbox into ready[r] of every peer.
//        Stream order makes our shard (2, or the caller's writes before 0) complete before any peer can
//        see epoch e.
//   4. For i = 1..n-1, peer p = (r+i) % n (spreads the readers of one source over time):
//        WAIT ready[p].epoch >= e  and  ready[p].sig_{a,b} & (our sig_{a,b} | poison) != 0
//        PULL peer p's bytes [O, O+b) from its pool (peer mapping) -> out[p*bytes + round offset]
//        POST done: copy the done outbox (= e) into done[r] of p.
//   After the last round:
//   5. zero-copy only: WAIT done[p] >= e_last for every peer. Peers read our input IN PLACE, so the
//      caller may overwrite it only once they are finished; the caller's stream waits on 6.
//   6. comm waits for the self stream; record `end`; the caller's stream waits on `end`.
//
// Why it is safe:
//   * Data before flag: a peer sees ready = e only after our shard for e is complete (3 is stream-
//     ordered after 2 and after the caller's writes), and pulls only after seeing it (4).
//   * No overwrite while read: our staging region is rewritten in round e only after every peer has
//     posted done >= e-1 (1), which each posts after its pull of round e-1 completed (4, stream order).
//     A zero-copy input is released to the caller only after done >= e (5).
//   * A peer is never an epoch ahead of our wait: rank p posts ready = e+1 only after done[r] >= e from
//     us (1), and we post done = e only after our wait for ready = e passed (4). So while we wait for
//     epoch e, ready[p] holds at most e, and the signature we compare is epoch e's own. That is what
//     makes a mismatch (different sizes, offsets or op on two ranks) detectable: the AND-wait never
//     passes, and the watchdog reports both sides' descriptors instead of returning wrong bytes.
//     (The 32-byte signal may land word by word; a stale signature word at worst delays the AND-wait
//     until the new word lands, or lets it pass by coincidence, which only costs the mismatch check:
//     the data ordering rests on the epoch word alone.)
//   * No deadlock: all of a rank's waits in round e depend only on peers' posts of round e (3, 4) or
//     of earlier rounds (1, 5), and every rank posts its round-e ready before its first round-e wait.
//   * The self copy reads the caller's input and writes only out[r]; it touches no flag and no pool
//     memory, so it runs on its own stream beside the pulls.
//   * Zero bytes: nothing is enqueued and no epoch is consumed (consistently on every rank, since the
//     sizes match); mismatched zero/non-zero sizes across ranks then show up as a timeout on the other.
//   * Timeouts: the watchdog (group.cc) names the op, the group, this rank and the peers whose flags
//     never arrived, then writes "far future" epochs and the poison bit into our flags so every wait
//     above passes and the stream drains; the group is then marked failed and refuses further ops.
// ====================================================================================================
#include "all_gather.h"

#include <sstream>

namespace ce_overlap {

namespace {

void enqueue_locked(Group& g, const AllGatherArgs& a, const std::string& where, bool in_place,
                    std::optional<size_t> zero_copy_offset, size_t round_capacity, size_t rounds);

}  // namespace

void enqueue_all_gather(Group& g, const AllGatherArgs& a) {
  static const char* kOp = "all_gather_into_tensor";
  std::lock_guard<std::mutex> lk(g.mutex());
  g.throw_if_unusable_locked(kOp);
  if (a.nbytes == 0) return;

  const std::string where = "all_gather_into_tensor on group '" + g.name() + "' (rank " + std::to_string(g.rank()) + ")";
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CE_CUDA_CHECK(cudaStreamIsCapturing(a.caller, &capture), where);
  if (capture != cudaStreamCaptureStatusNone) {
    // Epochs are host-side state baked into the enqueued values: a replayed graph would repeat them.
    throw std::runtime_error("ce_overlap." + std::string(kOp) + " on group '" + g.name() +
                             "' cannot be captured into a CUDA graph in this version of the runtime");
  }

  SymmetricPool& pool = g.pool();
  const char* out = static_cast<const char*>(a.output);
  const char* in = static_cast<const char*>(a.input);
  const bool in_place = in == out + static_cast<size_t>(g.rank()) * a.nbytes;
  const std::optional<size_t> zero_copy_offset = pool.user_region_offset(in, a.nbytes);
  const size_t round_capacity = zero_copy_offset ? a.nbytes : pool.staging_bytes();
  // A group of one has no peers: only the self copy remains.
  const size_t rounds = g.world_size() == 1 ? 0 : (a.nbytes + round_capacity - 1) / round_capacity;

  DeviceScope scope(g.device());
  // From here on epochs are consumed: an error half-way leaves this rank out of step with its peers,
  // so the group is marked failed (later ops raise this message instead of hanging).
  try {
    enqueue_locked(g, a, where, in_place, zero_copy_offset, round_capacity, rounds);
  } catch (const std::exception& e) {
    g.mark_failed_locked(std::string(e.what()) + " (group '" + g.name() + "' is now unusable: this rank's epochs are out of step with its peers)");
    throw;
  }
}

namespace {

void enqueue_locked(Group& g, const AllGatherArgs& a, const std::string& where, bool in_place,
                    std::optional<size_t> zero_copy_offset, size_t round_capacity, size_t rounds) {
  static const char* kOp = "all_gather_into_tensor";
  SymmetricPool& pool = g.pool();
  const int rank = g.rank();
  const int n = g.world_size();
  const cudaStream_t comm = g.comm_stream();
  const cudaStream_t self = g.self_stream();
  char* out = static_cast<char*>(a.output);
  const char* in = static_cast<const char*>(a.input);
  PendingOp op;
  op.name = kOp;
  op.seq = g.next_op_seq();
  op.kind = OpKind::AllGather;
  op.nbytes_per_rank = a.nbytes;
  op.zero_copy = zero_copy_offset.has_value();
  op.enqueued = Clock::now();
  op.start = g.take_event();
  op.end = g.take_event();

  // 0. Join the caller's stream; the own shard goes on the self stream.
  CE_CUDA_CHECK(cudaEventRecord(g.caller_ready_event(), a.caller), where);
  CE_CUDA_CHECK(cudaStreamWaitEvent(comm, g.caller_ready_event(), 0), where);
  if (!in_place) {
    CE_CUDA_CHECK(cudaStreamWaitEvent(self, g.caller_ready_event(), 0), where);
    CE_CUDA_CHECK(local_copy_async(out + static_cast<size_t>(rank) * a.nbytes, in, a.nbytes, self),
                  where + ": copying the own shard");
    CE_CUDA_CHECK(cudaEventRecord(g.self_done_event(), self), where);
  }
  CE_CUDA_CHECK(cudaEventRecord(op.start, comm), where);

  for (size_t k = 0; k < rounds; ++k) {
    const size_t chunk_offset = k * round_capacity;
    const size_t chunk = std::min(round_capacity, a.nbytes - chunk_offset);
    const size_t src_offset = zero_copy_offset ? *zero_copy_offset : pool.staging_offset();
    const uint32_t e = g.next_epoch();
    const RoundSignature sig = round_signature(OpKind::AllGather, a.nbytes, static_cast<uint32_t>(k), chunk, src_offset);

    // 1. Peers are done with our previous round (protects the staging region and the epoch window).
    if (k == 0 && !epoch_ge(g.last_done_waited(), e - 1)) op.done_needed_before = e - 1;
    g.wait_peers_done(e - 1);
    // 2. Stage.
    if (!zero_copy_offset) {
      CE_CUDA_CHECK(local_copy_async(pool.local_base() + src_offset, in + chunk_offset, chunk, comm),
                    where + ": staging the input into the symmetric pool");
    }
    // 3. Announce.
    g.post_ready(PeerSignal{e, sig.sig_a, sig.sig_b, static_cast<uint32_t>(OpKind::AllGather) << 24 | static_cast<uint32_t>(k),
                            chunk, src_offset});
    // 4. Pull from every peer, in (rank + i) % n order.
    for (int i = 1; i < n; ++i) {
      const int p = (rank + i) % n;
      g.wait_peer_ready(p, e, sig);
      CE_CUDA_CHECK(cudaMemcpyAsync(out + static_cast<size_t>(p) * a.nbytes + chunk_offset, pool.peer_base(p) + src_offset,
                                    chunk, cudaMemcpyDeviceToDevice, comm),
                    where + ": pulling the shard of rank " + std::to_string(p));
      g.post_done(p);
    }
    op.rounds.push_back(RoundInfo{e, sig, static_cast<uint32_t>(k), chunk, src_offset});
  }
  // 5. A zero-copy input goes back to the caller only once every peer has read it.
  if (zero_copy_offset) {
    op.done_needed_after = op.rounds.back().epoch;
    g.wait_peers_done(op.done_needed_after);
  }
  // 6. Join the self copy and hand the result back to the caller's stream.
  if (!in_place) CE_CUDA_CHECK(cudaStreamWaitEvent(comm, g.self_done_event(), 0), where);
  CE_CUDA_CHECK(cudaEventRecord(op.end, comm), where);
  CE_CUDA_CHECK(cudaStreamWaitEvent(a.caller, op.end, 0), where);
  g.track(std::move(op));
}

}  // namespace

}  // namespace ce_overlap

// One process group's CE runtime state (pool, streams, epochs, in-flight ops), the signalling
// primitives every collective is built from, and the process-wide registry with its watchdog thread.
// No torch here.
//
// Signalling rules (all_gather.cc explains why they make the protocol safe):
//   * Every wait is LOCAL: cuStreamWaitValue32 on our own FlagsRegion, executed by the GPU front end.
//   * Every write to a PEER is a small cudaMemcpyAsync (copy engine) from our outbox, because CUDA 13.1+
//     refuses cuStreamWriteValue32 on remote addresses. Outboxes are filled by local stream writes.
//   * Epochs are per group, 32-bit, start at 1 and are compared cyclically ((int32_t)(a - b) >= 0,
//     which is what CU_STREAM_WAIT_VALUE_GEQ does), so wrap-around is harmless.
#pragma once

#include "cost_model/ce_algorithms.h"
#include "cuda_util.h"
#include "symmetric_pool.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace ce_overlap {

using Clock = std::chrono::steady_clock;

enum class OpKind : uint32_t { AllGather = 1, ReduceScatter = 2, AllToAll = 3, Broadcast = 4, Send = 5, Recv = 6 };
const char* op_kind_name(uint32_t kind);
// How an op moves its bytes (part of every round's signature, so ranks that disagree are caught, and
// shown in the timeout diagnosis). Values fit in 4 bits.
enum class Variant : uint32_t {
  AgStaged = 0,         // all-gather: input staged into the staging region, peers pull it
  AgSymmetricInput = 1, // all-gather: input in the user region (same offset everywhere), peers pull it in place
  AgInPlace = 2,        // all-gather: output in the user region and input = its own shard, peers pull shard p
  AgPush = 3,           // all-gather: output in the user region, every rank writes its shard into every peer's
  RsPush = 4,           // reduce-scatter: chunks pushed into the receivers' staging slots, then reduced
  A2aStaged = 5,        // all-to-all: the input's chunks staged (in rounds), every receiver pulls its chunk
  A2aSymmetricInput = 6,// all-to-all: input in the user region (same offset everywhere), receivers pull in place
  BcStaged = 7,         // broadcast: the root's tensor staged (in rounds), every other rank pulls it
  BcSymmetric = 8,      // broadcast: the tensor in the user region (same offset everywhere), pulled from the root
  P2pStaged = 9,        // send/recv: sender pushes into the receiver's landing banks, receiver copies them out
  P2pDirect = 10,       // send/recv: both tensors in the user region at one offset, sender pushes in place
  RsUnreduced = 11,     // reduce-scatter: chunks pushed into the receivers' staging slots, copied out unreduced
  BcScatterStaged = 12, // broadcast, n >= 3: root staged; each non-root pulls its piece, then the non-roots exchange
  // 13: retired (the scatter + all-gather of a symmetric tensor, replaced by BcPushSymmetric).
  BcPushSymmetric = 14, // broadcast, n >= 3, symmetric tensor, one round: each non-root pulls its piece of every
                        // segment from the root and pushes it into the other non-roots' tensors
};
const char* variant_name(uint32_t variant);
// PeerSignal::kind_round: kind (8 bits) | variant (4 bits) | round (20 bits, diagnostics only).
uint32_t kind_round_word(OpKind kind, Variant variant, uint32_t round);

constexpr uint32_t kPoisonBit = 1u << 31;

inline bool epoch_ge(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) >= 0; }

// A copy within this GPU (self shard, staging). Plain cudaMemcpyAsync device-to-device copies inside
// one GPU may be run by the driver on SMs; with local_copy "ce" (default, set_local_copy_hint) they go through
// cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute, the hint that asks for a copy
// engine, falling back to cudaMemcpyAsync when the batch API refuses (the first refusal is printed and
// local_copy_mode() reports it). The batch API refuses the legacy NULL stream: `stream` must be one of
// the group's (non-blocking) streams, and a NULL / legacy stream always takes the plain call.
// local_copy "memcpy" forces the plain call.
cudaError_t local_copy_async(void* dst, const void* src, size_t bytes, int device, cudaStream_t stream);
// "ce-hint" (the batch API with the hint has been accepted) or "memcpy" (or "memcpy (batch API refused:
// <error>)"), for describe() and benchmark headers.
std::string local_copy_mode();
// One explicit way of copying within a GPU, for the probe op _local_copy (no fallback, errors returned):
// "memcpy" (cudaMemcpyAsync), "batch_hint" (cudaMemcpyBatchAsync + PreferOverlapWithCompute),
// "batch" (cudaMemcpyBatchAsync, no flag), "peer" (cudaMemcpyPeerAsync from and to this device).
// The batch modes return cudaErrorInvalidValue on the legacy NULL stream (the API's rule).
// Throws std::invalid_argument for an unknown mode.
cudaError_t local_copy_with(const std::string& mode, void* dst, const void* src, size_t bytes, int device,
                            cudaStream_t stream);
// `count` copies in one cudaMemcpyBatchAsync on `stream` (sources read in stream order; `hint`: ask for a copy
// engine). cudaErrorInvalidValue on the legacy NULL stream or for no copies, cudaErrorNotSupported where the CUDA
// runtime has no batch API (before 12.8); nothing is enqueued then.
cudaError_t batch_copies(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count, int device,
                         bool hint, cudaStream_t stream);
// Whether `stream` is the legacy NULL stream (which cudaMemcpyBatchAsync refuses).
bool is_legacy_stream(cudaStream_t stream);

// What one round of a collective must match across ranks; its signature goes into PeerSignal.
struct RoundSignature {
  uint32_t sig_a;
  uint32_t sig_b;
};
// `extra`: anything else that must match (reduce-scatter: dtype and reduce op).
RoundSignature round_signature(OpKind kind, Variant variant, uint64_t total_bytes, uint32_t round,
                               uint64_t round_bytes, uint64_t offset, uint64_t extra = 0);

// One round of a collective as this rank posted it (for the timeout diagnosis).
struct RoundInfo {
  uint32_t epoch;
  RoundSignature sig;
  uint32_t round;
  uint64_t nbytes;
  uint64_t offset;
};

// An enqueued op the watchdog tracks until its `end` event completes. Collectives run on the comm stream, in
// order; point-to-point ops on their channel's stream (p2p.cc), so ops may complete out of order.
struct PendingOp {
  std::string name;
  int peer = -1;  // send / recv: the other rank (rounds[].epoch are then the channel's round numbers)
  uint64_t seq = 0;  // 1-based op number on this group
  OpKind kind = OpKind::AllGather;
  Variant variant = Variant::AgStaged;
  uint64_t nbytes_per_rank = 0;
  // Push-style ops (AgPush, RsPush): done[p] means "p finished WRITING into this rank's pool" and every
  // round waits for it; pull-style: "p finished READING this rank's pool".
  bool push_style = false;
  uint32_t done_needed_before = 0;  // the first round waited for done[p] >= this (0: no wait)
  uint32_t done_needed_after = 0;   // zero-copy: the op ends waiting for done[p] >= this (0: no wait)
  std::vector<RoundInfo> rounds;
  cudaEvent_t start = nullptr;  // recorded on the comm stream once the caller's stream reached the op
  cudaEvent_t end = nullptr;    // recorded on the comm stream after the op; the caller waits on it
  Clock::time_point enqueued;
  std::optional<Clock::time_point> started;
};

// Most pieces a pull is split into (RuntimeConfig.pull_split); every piece beyond the first runs on its own stream.
constexpr int kMaxPullSplit = 4;
// peer_round's lanes unless tuned (Group::set_peer_lanes): 1 = every peer on the comm stream, 0 = one lane per peer.
// With per-round signalling (kDefaultPeerSync) every peer at once is as fast or faster on 4x H200 for every collective
// (bench/results/collectives-2026-11-27-b); with per-peer signalling it was 30-40% slower, hence 1 before.
constexpr int kDefaultPeerLanes = 0;
// How peer_round signals (Group::set_peer_sync; local, ranks may differ):
//   Each: per peer, in turn on its lane: WAIT its ready, the copies, POST done to it.
//   Round: WAIT every peer's ready (one batch of stream waits on the comm stream), then every peer's copies (on the
//     lanes), then POST done to every peer (comm stream, after the lanes joined): fewer switches between the stream's
//     front-end waits and its copy-engine work, at the price of the first copy waiting for the last peer's ready.
//   RoundBatched: Round, with each POST's small peer copies (ready to every peer, done to every peer) issued as one
//     cudaMemcpyBatchAsync (plain copies when the batch API refuses, said once).
enum class PeerSync : int { Each = 0, Round = 1, RoundBatched = 2 };
constexpr int kDefaultPeerSync = 2;  // RoundBatched: measured fastest at 4 ranks (bench/results/collectives-2026-11-27-b)
// A piece of a split pull is never smaller than this (smaller copies gain nothing from a second engine).
constexpr size_t kMinPullPiece = 1 << 20;

// A group's settings, given at rendezvous. Their defaults and environment overrides live in Python
// (ce_overlap/runtime/config.py: RuntimeConfig, the table in docs/runtime.md); here they are validated.
struct GroupConfig {
  size_t user_bytes;
  size_t staging_bytes;
  size_t p2p_bytes;        // the send/recv landing region
  double timeout_s;
  int reduce_ctas;         // CTAs of the reduce-scatter reduction kernel
  size_t rs_round_bytes;   // reduce-scatter bytes per rank per round
  int pull_split;          // streams one pulled peer copy is split over (1..kMaxPullSplit)
  double copy_rate_gbps = 0;  // each peer copy held to this rate, 0 = unlimited (Group::copy_rate_gbps)
  bool refuse_p2p = false; // fault injection (tests): every pair of ranks looks like GPUs without peer access
  // RuntimeConfig's fields, validated and converted; throws std::invalid_argument naming the field.
  // fault_inject: "" or "p2p_refused".
  static GroupConfig make(double pool_mb, double staging_mb, double p2p_mb, double timeout_s, double reduce_sms,
                          double rs_round_mb, double pull_split, double copy_rate_gbps,
                          const std::string& fault_inject);
};

// Process-wide settings (RuntimeConfig's all_gather_mode, local_copy, keep_alive), set by Python when it loads
// the library and at every rendezvous; each op reads them when it is enqueued.
void set_local_copy_hint(bool hint);  // local_copy="ce" (true, default) or "memcpy"

class Group {
 public:
  Group(std::string name, int rank, int world_size, int device, const GroupConfig& config);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }
  double timeout_s() const { return timeout_s_; }
  // Tuning knobs, settable between ops (_tune op; the probe sweeps them). reduce_ctas and pull_split are
  // local (ranks may differ); rs_round_bytes must match on every rank for each op (it is part of every
  // reduce-scatter round's signature, so a mismatch is reported as a "different collective" timeout).
  int reduce_ctas() const { return reduce_ctas_.load(); }
  size_t rs_round_bytes() const { return rs_round_bytes_.load(); }
  int pull_split() const { return pull_split_.load(); }
  void set_reduce_ctas(int ctas);              // 1..1024; throws std::invalid_argument otherwise
  void set_rs_round_bytes(size_t bytes);       // rounded down to kPoolAlignment, at least one unit
  void set_pull_split(int pieces);             // 1..kMaxPullSplit; throws std::invalid_argument otherwise
  // Lanes (streams) a round's peer loop is spread over: 0 = one per peer (every peer at once), 1 = one after another
  // on the comm stream, k = k lanes. Local (ranks may differ): a lane runs the copies (with PeerSync::Each also the
  // waits and posts) the comm stream would, forked from it after the round's waits and joined back before its next
  // step (peer_round).
  int peer_lanes() const { return peer_lanes_.load(); }
  void set_peer_lanes(int lanes);              // >= 0; throws std::invalid_argument otherwise
  // How a round's peer waits and done posts are grouped (PeerSync; local).
  int peer_sync() const { return peer_sync_.load(); }
  void set_peer_sync(int mode);                // 0..2; throws std::invalid_argument otherwise
  // The rate (GB/s) each of this rank's peer copies is held to, 0 = unlimited (local): a collective's per stream, a send
  // channel's per channel. Paced copies go in chunks, each started no earlier than the previous one's start plus
  // chunk / rate (launch_pace: one GPU thread that only waits), so the copy engines run below their full rate, and so
  // does the board's power (the knob of issue 30: copy rate against the slowdown of the compute beside it).
  double copy_rate_gbps() const { return copy_rate_gbps_.load(); }
  void set_copy_rate_gbps(double gbps);        // >= 0 and finite; throws std::invalid_argument otherwise
  // The rate this thread's copies are paced at now: an OpCopyRate's while one lives, else copy_rate_gbps().
  double effective_copy_rate_gbps() const;
  // One op's own rate (the pass's per-bucket copy_rate_gbps, the ops' `copy_rate_gbps` argument): the copies this
  // thread enqueues while it lives are paced at `gbps` instead of the group's rate; 0 keeps the group's. Ops enqueue
  // on the calling thread, so the scope covers exactly the op. Throws std::invalid_argument unless finite and >= 0.
  class OpCopyRate {
   public:
    explicit OpCopyRate(double gbps);
    ~OpCopyRate();
    OpCopyRate(const OpCopyRate&) = delete;
    OpCopyRate& operator=(const OpCopyRate&) = delete;

   private:
    double saved_;
  };
  // Segments of a scatter + all-gather broadcast (all_to_all.cc): 0 = chosen from the size. Must match on every rank
  // (it is in the rounds' signature, like rs_round_bytes).
  int bcast_segments() const { return bcast_segments_.load(); }
  void set_bcast_segments(int segments);       // 0..kMaxBcastSegments; throws std::invalid_argument otherwise

  // Rendezvous, step 1 (pool allocated in the constructor) and step 2.
  PoolHandleBlob export_blob(const std::string& node = "") { return pool_->export_blob(node); }
  void open(const std::vector<PoolHandleBlob>& blobs);

  // Everything below that touches streams, epochs or the pending list requires mutex() held.
  std::mutex& mutex() { return mu_; }
  void throw_if_unusable_locked(const char* op) const;
  // For an op that failed half-way through enqueueing: this rank's epochs no longer match its peers'.
  void mark_failed_locked(const std::string& message) { fail_locked(message); }
  SymmetricPool& pool() { return *pool_; }
  cudaStream_t comm_stream() const { return comm_; }
  cudaStream_t self_stream() const { return self_; }
  // Extra streams of a split pull: piece j >= 1 of a peer copy runs on pull_stream(j - 1), forked from
  // and joined back into the comm stream (fork_event / join_event) around the copy.
  cudaStream_t pull_stream(int i) const { return pull_[i]; }
  cudaEvent_t fork_event() const { return ev_fork_; }
  cudaEvent_t join_event(int i) const { return ev_join_[i]; }
  // Runs the reduce-scatter reduction kernels, so round k's reduction overlaps round k+1's copies.
  cudaStream_t reduce_stream() const { return reduce_; }
  cudaEvent_t caller_ready_event() const { return ev_caller_; }
  cudaEvent_t self_done_event() const { return ev_self_; }
  // Reduce-scatter: comm -> reduce ("round k's chunks arrived") and reduce -> comm ("bank b reduced").
  cudaEvent_t arrived_event() const { return ev_arrived_; }
  cudaEvent_t bank_event(int bank) const { return ev_bank_[bank & 1]; }
  uint64_t next_op_seq() { return ++op_seq_; }
  uint32_t next_epoch() {
    const uint32_t e = epoch_next_++;
    epoch_hint_.store(epoch_next_);
    return e;
  }
  uint32_t last_done_waited() const { return done_waited_; }

  // comm stream: wait until every peer's done flag is >= epoch (skipped when already waited for).
  void wait_peers_done(uint32_t epoch);
  // comm stream: fill the outbox with `signal` (and the done outbox with signal.epoch), then copy the
  // outbox into ready[rank] of every peer.
  void post_ready(const PeerSignal& signal);
  // `stream` (comm or a lane): one peer copy of a pull. On the comm stream, unpaced, it is split into pull_split()
  // pieces (one per stream) when large enough; to the protocol it is one copy on the comm stream (forked after, joined
  // before the next step). On a lane (the lanes already keep several copy engines busy) or with a copy rate it is
  // peer_copy.
  void pull_copy(char* dst, const char* src, size_t bytes, const std::string& what, cudaStream_t stream = nullptr);
  // `stream` (comm, a lane or a send channel's): one peer copy (a pull or a push), paced when copy_rate_gbps() > 0
  // (in chunks, a pacer launch before each); otherwise one cudaMemcpyAsync.
  void peer_copy(char* dst, const char* src, size_t bytes, const std::string& what, cudaStream_t stream = nullptr);
  // The peer step of a round (after POST ready): for every peer p, WAIT ready[p] >= epoch with signature `sig`, then
  // copies(p, stream) (the round's copies from or to p, enqueued on `stream`), then POST done to p (copy the done
  // outbox, this round's epoch, into done[rank] of p). Peers go in (rank + i) % n order, i = 1..n-1, within a lane.
  // With one lane every step is on the comm stream. With L > 1 lanes, peer i goes to lane (i - 1) % L (lane 0 = the
  // comm stream): lanes 1..L-1 wait for an event recorded on the comm stream, and the comm stream waits for every
  // lane after the copies. peer_sync() groups the steps (PeerSync): Each keeps every peer's WAIT, copies and POST in
  // that order on its lane; Round / RoundBatched put every WAIT on the comm stream before the fork and every POST
  // after the join. Either way each POST done to p follows p's copies and each copy follows p's WAIT, in stream
  // order: to the protocol the steps are the comm stream's, reordered only across peers, or delayed.
  void peer_round(const std::string& where, uint32_t epoch, RoundSignature sig,
                  const std::function<void(int peer, cudaStream_t stream)>& copies);
  // This rank's peers in signalling order: (rank + i) % n, i = 1..n-1.
  std::vector<int> peers() const;
  // The two halves of a peer step, for peer_round and for ops whose copies do not fit its per-peer shape: on `stream`,
  // WAIT the ready >= epoch with signature `sig` of every rank in `from` (one batch of stream waits); POST done (this
  // round's epoch, in the done outbox since POST ready) to every rank in `to` (signal_copies).
  void wait_ready(const std::vector<int>& from, uint32_t epoch, RoundSignature sig, cudaStream_t stream);
  void post_done(const std::vector<int>& to, uint32_t epoch, cudaStream_t stream);
  // Lane i (1..n-2) of peer_round, for ops that run a second stream of copies beside the comm stream; join_lane makes
  // the comm stream wait for everything enqueued on it so far.
  cudaStream_t lane(int i) const { return lanes_.at(static_cast<size_t>(i - 1)); }
  void join_lane(int i, const std::string& where);

  // The small signal copies of one POST: `src` (an outbox, `bytes`) into every address of `dsts` (peers' flags), on
  // `stream`; one cudaMemcpyBatchAsync with PeerSync::RoundBatched, else one cudaMemcpyAsync each.
  void signal_copies(const std::vector<void*>& dsts, const void* src, size_t bytes, cudaStream_t stream,
                     const std::string& what);

  // Point-to-point channels (p2p.cc). Channel (sender s -> receiver d) has a round counter on each side,
  // advanced identically because sends and receives of one pair are matched in order, and its own streams:
  // sends to d run on p2p_stream(d, true), receives from s on p2p_stream(s, false), created on first use.
  // A p2p op waits only for its peer's signals on its own stream, so no channel blocks another.
  cudaStream_t p2p_stream(int peer, bool send);
  // The next round number of the channel to (send) or from (recv) `peer`: 1, 2, ...
  uint32_t next_p2p_round(int peer, bool send);
  // On `stream`: write `s` into this rank's outbox for `peer` (credit: we are its receiver; landed: we are its
  // sender) and copy it into the peer's p2p_credit[rank] / p2p_landed[rank].
  void post_p2p(int peer, bool credit, const PeerSignal& s, cudaStream_t stream);
  // On `stream`: wait until our p2p_credit[peer] (credit) / p2p_landed[peer] reaches `round` with our signature.
  void wait_p2p(int peer, bool credit, uint32_t round, RoundSignature sig, cudaStream_t stream);

  cudaEvent_t take_event();
  void track(PendingOp op);

  // RAII marker around an enqueue (held with mutex()): the watchdog cannot take the group lock while an
  // enqueue holds it, so it watches this instead. An enqueue stuck in a CUDA call for longer than the
  // timeout (e.g. a call that waits for the device to go idle while the comm stream waits for a peer
  // that never posts) fails the group and releases the streams without the lock.
  class EnqueueScope {
   public:
    explicit EnqueueScope(Group& g) : g_(g) {
      g_.enqueue_since_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count());
    }
    ~EnqueueScope() { g_.enqueue_since_ns_.store(0); }
    EnqueueScope(const EnqueueScope&) = delete;
    EnqueueScope& operator=(const EnqueueScope&) = delete;

   private:
    Group& g_;
  };

  // Defers the reuse of an empty_symmetric range until `caller` and the comm stream are past it.
  void release_symmetric(size_t offset, size_t bytes, cudaStream_t caller);

  // Blocks (polling, never in a CUDA call that could hang) until every tracked op completed; throws the
  // group's error if it failed or `timeout_s` passed.
  void synchronize(double timeout_s);
  // Called by the watchdog thread every few milliseconds. Never blocks on the group lock (try_lock), so
  // one group whose lock is held cannot stall the watchdog of the others.
  void watchdog_tick(Clock::time_point now);

  bool failed() const { return failed_.load(); }
  std::string error() const;
  std::string describe();

 private:
  std::string diagnose_timeout_locked(const PendingOp& op, Clock::time_point now);
  // The peer part of a send / recv timeout, from the flags read back into host_flags_.
  std::string diagnose_p2p(const PendingOp& op) const;
  // Marks the group failed with `message` (the first message wins). Takes only err_mu_, never mu_.
  void fail_locked(const std::string& message);
  void append_error(const std::string& text);
  // Writes "far future" values into every flag our comm stream may be waiting on, so it drains. Watchdog
  // thread only (it owns watchdog_stream_ and host_poison_); needs no group lock.
  bool poison();
  // The watchdog's path when the group lock is held by an enqueue (see EnqueueScope).
  void check_stuck_enqueue(Clock::time_point now);
  // Frees the events of completed ops: every one, or with `oldest_only` those before the first still running.
  void retire_completed_locked(bool oldest_only = false);

  std::string name_;
  int rank_;
  int world_size_;
  int device_;
  double timeout_s_;
  std::atomic<int> reduce_ctas_;
  std::atomic<size_t> rs_round_bytes_;
  std::atomic<int> pull_split_;
  std::atomic<int> peer_lanes_;
  std::atomic<int> peer_sync_{kDefaultPeerSync};
  std::atomic<int> bcast_segments_{0};
  std::atomic<double> copy_rate_gbps_{0.0};
  unsigned long long* pace_last_ = nullptr;  // device: the pacer's last chunk start, per lane (0 = comm), per send peer
  bool refuse_p2p_ = false;  // GroupConfig::refuse_p2p (fault injection)
  std::unique_ptr<SymmetricPool> pool_;
  cudaStream_t comm_ = nullptr;
  cudaStream_t self_ = nullptr;
  cudaStream_t reduce_ = nullptr;
  cudaStream_t watchdog_stream_ = nullptr;
  cudaEvent_t ev_caller_ = nullptr;
  cudaEvent_t ev_self_ = nullptr;
  cudaEvent_t ev_arrived_ = nullptr;
  cudaEvent_t ev_bank_[2] = {nullptr, nullptr};
  cudaStream_t pull_[kMaxPullSplit - 1] = {};
  std::vector<cudaStream_t> p2p_send_;   // per peer, created on first use (nullptr until then)
  std::vector<cudaStream_t> p2p_recv_;
  std::vector<uint32_t> p2p_send_round_;  // last round number used per peer and direction
  std::vector<uint32_t> p2p_recv_round_;
  std::vector<std::array<uint32_t, 8>> p2p_credit_mirror_;  // what the streams last wrote into each outbox
  std::vector<std::array<uint32_t, 8>> p2p_landed_mirror_;
  int stream_priority_ = 0;
  cudaEvent_t ev_fork_ = nullptr;
  cudaEvent_t ev_join_[kMaxPullSplit - 1] = {};
  std::vector<cudaStream_t> lanes_;      // for_each_peer's lanes 1..n-2 (lane 0 is the comm stream)
  std::vector<cudaEvent_t> lane_join_;   // one per lane
  cudaEvent_t ev_lane_fork_ = nullptr;
  FlagsRegion* host_flags_ = nullptr;   // pinned: readback of our flags for the diagnosis
  FlagsRegion* host_poison_ = nullptr;  // pinned: source of the unblocking write

  mutable std::mutex mu_;
  bool open_ = false;
  uint64_t op_seq_ = 0;
  uint32_t epoch_next_ = 1;
  uint32_t done_waited_ = 0;  // every peer's done flag is known (stream-ordered) to be >= this
  uint32_t outbox_words_[9] = {};  // what the comm stream last wrote into ready_outbox (8 words) and done_outbox
  std::deque<PendingOp> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::atomic<bool> failed_{false};
  mutable std::mutex err_mu_;  // guards error_ (a leaf lock: never held across a CUDA call or with mu_ wanted)
  std::string error_;
  std::atomic<uint32_t> epoch_hint_{1};       // epoch_next_, readable without mu_ (poison)
  std::atomic<uint32_t> p2p_hint_{1};         // above every p2p round number used so far (poison)
  std::atomic<int64_t> enqueue_since_ns_{0};  // steady_clock ns when the running enqueue began; 0: none
  Clock::time_point last_poison_{};           // watchdog thread only
};

// Every op's first step (under the group lock): a PendingOp numbered on this group, with its start and end events.
// Push-style variants (AgPush, RsPush, P2p*: a peer's done / landed flag means "finished writing into us") are
// marked so from the variant.
PendingOp begin_op(Group& g, const char* name, OpKind kind, Variant variant, size_t nbytes_per_rank);
// `stream` waits for the caller's work so far (g.caller_ready_event(), recorded on the caller's stream) and the op's
// start is recorded there: the watchdog times the op from that point.
void start_on(Group& g, cudaStream_t stream, PendingOp& op, const std::string& where);
// Step 0 of every collective: records the caller's point into g.caller_ready_event() and starts `op` on the comm
// stream after it (other streams of the op may wait for the same event).
void join_caller(Group& g, cudaStream_t caller, PendingOp& op, const std::string& where);

// Every op's last step: record the op's end on the comm stream, hand the result to the caller (its stream waits on
// the end now, or, with a deferred-join event, in ce_overlap::wait_tensor), and let the watchdog track the op.
void hand_back(Group& g, PendingOp op, cudaStream_t caller, cudaEvent_t join, const std::string& where);
// The same for an op that ran on `stream` (a point-to-point channel's) instead of the comm stream.
void hand_back_from(Group& g, cudaStream_t stream, PendingOp op, cudaStream_t caller, cudaEvent_t join,
                    const std::string& where);

// Ops refuse CUDA graph capture: epochs are host-side state baked into the enqueued values, and a replayed graph
// would repeat them.
void refuse_graph_capture(const Group& g, cudaStream_t caller, const char* op, const std::string& where);

// The frame of every op's enqueue. Under the group lock: refuses an unusable group; does nothing for an empty op
// (every rank skips it alike: the sizes match, and no epoch or round is consumed); refuses CUDA graph capture; runs
// `plan()` (it may throw: nothing is consumed yet), then `enqueue(where, plan_result)` on the group's device. A throw
// from `enqueue` may have consumed epochs or channel rounds, leaving this rank out of step with its peers, so the
// group is marked failed and every later op raises that message instead of hanging.
template <typename PlanFn, typename EnqueueFn>
void enqueue_op(Group& g, const char* op, bool empty, cudaStream_t caller, PlanFn&& plan, EnqueueFn&& enqueue) {
  std::lock_guard<std::mutex> lk(g.mutex());
  g.throw_if_unusable_locked(op);
  if (empty) return;
  Group::EnqueueScope enqueueing(g);  // the watchdog's view of an enqueue stuck in a CUDA call
  const std::string where = std::string(op) + " on group '" + g.name() + "' (rank " + std::to_string(g.rank()) + ")";
  refuse_graph_capture(g, caller, op, where);
  auto planned = plan();
  DeviceScope scope(g.device());
  try {
    enqueue(where, planned);
  } catch (const std::exception& e) {
    g.mark_failed_locked(std::string(e.what()) + " (group '" + g.name() +
                         "' is now unusable: this rank's epochs are out of step with its peers)");
    throw;
  }
}

// Multi-part ops (several tensors moved as one collective, as a bucket is): a part type with a `bytes` field (its
// bytes per rank). The op moves the concatenation of the parts' per-rank bytes; these two helpers map it back.
//
// Calls f(part, offset in the part's per-rank bytes, offset in [lo, lo + len), length) for each piece of the
// range [lo, lo + len) of the concatenation, in order.
template <typename Part, typename F>
void for_each_piece(const std::vector<Part>& parts, size_t lo, size_t len, F&& f) {
  const size_t hi = lo + len;
  size_t start = 0;
  for (const Part& part : parts) {
    const size_t end = start + part.bytes;
    const size_t b = std::max(lo, start);
    const size_t e = std::min(hi, end);
    if (b < e) f(part, b - start, b - lo, e - b);
    if (end >= hi) break;
    start = end;
  }
}

// The part sizes, hashed (FNV-1a) for a round signature's `extra`, so ranks that split the same byte count into
// different parts never exchange bytes; 0 for a single part (a one-tensor op's signature does not change).
template <typename Part>
uint64_t parts_hash(const std::vector<Part>& parts) {
  if (parts.size() <= 1) return 0;
  uint64_t h = 1469598103934665603ull;
  for (const Part& part : parts) h = (h ^ static_cast<uint64_t>(part.bytes)) * 1099511628211ull;
  return h == 0 ? 1 : h;
}

template <typename Part>
size_t parts_bytes(const std::vector<Part>& parts) {
  size_t total = 0;
  for (const Part& part : parts) total += part.bytes;
  return total;
}

// Process-wide registry of groups, keyed by c10d group name. Never destroyed (a leaked singleton):
// tearing down CUDA objects during static destruction races the CUDA runtime's own teardown.
class Runtime {
 public:
  static Runtime& get();

  std::shared_ptr<Group> create_group(const std::string& name, int rank, int world_size, int device,
                                      const GroupConfig& config);
  std::shared_ptr<Group> find(const std::string& name);
  // Throws "group 'X' has no ce_overlap symmetric pool: call ce_overlap.runtime.rendezvous(group)".
  std::shared_ptr<Group> require(const std::string& name, const char* op);
  void remove(const std::string& name);
  // The error of the first failed group, if any (wait_tensor raises it).
  std::optional<std::string> first_failure();
  bool shutting_down() const { return stop_.load(); }

 private:
  Runtime() = default;
  void start_watchdog_locked();
  void watchdog_main();
  void stop_watchdog();

  std::mutex mu_;
  std::map<std::string, std::shared_ptr<Group>> groups_;
  std::set<std::string> creating_;  // names whose Group is being constructed (outside mu_)
  std::thread watchdog_;
  std::condition_variable cv_;
  std::atomic<bool> stop_{false};
};

}  // namespace ce_overlap

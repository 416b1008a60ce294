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

#include "cuda_util.h"
#include "symmetric_pool.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ce_overlap {

using Clock = std::chrono::steady_clock;

enum class OpKind : uint32_t { AllGather = 1 };
const char* op_kind_name(uint32_t kind);

constexpr uint32_t kPoisonBit = 1u << 31;

inline bool epoch_ge(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) >= 0; }

// A copy within this GPU (self shard, staging). Plain cudaMemcpyAsync device-to-device copies inside
// one GPU may be run by the driver on SMs; with CE_OVERLAP_LOCAL_COPY=ce (default) they go through
// cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute, the hint that asks for a copy
// engine (honoured by CUDA 13.1+ drivers, ignored before), falling back to cudaMemcpyAsync when the
// batch API refuses. CE_OVERLAP_LOCAL_COPY=memcpy forces the plain call.
cudaError_t local_copy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream);
// "ce-hint" or "memcpy" (or "memcpy (batch API refused: ...)"), for benchmark headers.
std::string local_copy_mode();

// What one round of a collective must match across ranks; its signature goes into PeerSignal.
struct RoundSignature {
  uint32_t sig_a;
  uint32_t sig_b;
};
RoundSignature round_signature(OpKind kind, uint64_t total_bytes, uint32_t round, uint64_t round_bytes,
                               uint64_t offset);

// One round of a collective as this rank posted it (for the timeout diagnosis).
struct RoundInfo {
  uint32_t epoch;
  RoundSignature sig;
  uint32_t round;
  uint64_t nbytes;
  uint64_t offset;
};

// An enqueued op the watchdog tracks until its `end` event completes.
struct PendingOp {
  std::string name;
  uint64_t seq = 0;  // 1-based op number on this group
  OpKind kind = OpKind::AllGather;
  uint64_t nbytes_per_rank = 0;
  bool zero_copy = false;
  uint32_t done_needed_before = 0;  // the first round waited for done[p] >= this (0: no wait)
  uint32_t done_needed_after = 0;   // zero-copy: the op ends waiting for done[p] >= this (0: no wait)
  std::vector<RoundInfo> rounds;
  cudaEvent_t start = nullptr;  // recorded on the comm stream once the caller's stream reached the op
  cudaEvent_t end = nullptr;    // recorded on the comm stream after the op; the caller waits on it
  Clock::time_point enqueued;
  std::optional<Clock::time_point> started;
};

struct GroupConfig {
  size_t user_bytes;
  size_t staging_bytes;
  double timeout_s;
  // From CE_OVERLAP_POOL_MB (default 1024, the whole region), CE_OVERLAP_STAGING_MB (default
  // min(256, pool/4)) and CE_OVERLAP_TIMEOUT_S (default 60). Throws naming the variable when invalid.
  static GroupConfig from_env();
};

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

  // Rendezvous, step 1 (pool allocated in the constructor) and step 2.
  PoolHandleBlob export_blob() { return pool_->export_blob(); }
  void open(const std::vector<PoolHandleBlob>& blobs);

  // Everything below that touches streams, epochs or the pending list requires mutex() held.
  std::mutex& mutex() { return mu_; }
  void throw_if_unusable_locked(const char* op) const;
  // For an op that failed half-way through enqueueing: this rank's epochs no longer match its peers'.
  void mark_failed_locked(const std::string& message) { fail_locked(message); }
  SymmetricPool& pool() { return *pool_; }
  cudaStream_t comm_stream() const { return comm_; }
  cudaStream_t self_stream() const { return self_; }
  cudaEvent_t caller_ready_event() const { return ev_caller_; }
  cudaEvent_t self_done_event() const { return ev_self_; }
  uint64_t next_op_seq() { return ++op_seq_; }
  uint32_t next_epoch() { return epoch_next_++; }
  uint32_t last_done_waited() const { return done_waited_; }

  // comm stream: wait until every peer's done flag is >= epoch (skipped when already waited for).
  void wait_peers_done(uint32_t epoch);
  // comm stream: fill the outbox with `signal` (and the done outbox with signal.epoch), then copy the
  // outbox into ready[rank] of every peer.
  void post_ready(const PeerSignal& signal);
  // comm stream: wait until peer's ready epoch >= epoch and its signature bits match ours.
  void wait_peer_ready(int peer, uint32_t epoch, RoundSignature sig);
  // comm stream: copy the done outbox (the current round's epoch) into done[rank] of `peer`.
  void post_done(int peer);

  cudaEvent_t take_event();
  void track(PendingOp op);

  // Defers the reuse of an empty_symmetric range until `caller` and the comm stream are past it.
  void release_symmetric(size_t offset, size_t bytes, cudaStream_t caller);

  // Blocks (polling, never in a CUDA call that could hang) until every tracked op completed; throws the
  // group's error if it failed or `timeout_s` passed.
  void synchronize(double timeout_s);
  // Called by the watchdog thread every few milliseconds.
  void watchdog_tick(Clock::time_point now);

  bool failed() const { return failed_.load(); }
  std::string error() const;
  std::string describe();

 private:
  std::string diagnose_timeout_locked(const PendingOp& op, Clock::time_point now);
  void fail_locked(const std::string& message);
  // Writes "far future" values into every flag our comm stream may be waiting on, so it drains.
  bool poison_locked();
  void retire_completed_locked();

  std::string name_;
  int rank_;
  int world_size_;
  int device_;
  double timeout_s_;
  std::unique_ptr<SymmetricPool> pool_;
  cudaStream_t comm_ = nullptr;
  cudaStream_t self_ = nullptr;
  cudaStream_t watchdog_stream_ = nullptr;
  cudaEvent_t ev_caller_ = nullptr;
  cudaEvent_t ev_self_ = nullptr;
  FlagsRegion* host_flags_ = nullptr;   // pinned: readback of our flags for the diagnosis
  FlagsRegion* host_poison_ = nullptr;  // pinned: source of the unblocking write

  mutable std::mutex mu_;
  bool open_ = false;
  uint64_t op_seq_ = 0;
  uint32_t epoch_next_ = 1;
  uint32_t done_waited_ = 0;  // every peer's done flag is known (stream-ordered) to be >= this
  std::deque<PendingOp> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::atomic<bool> failed_{false};
  std::string error_;
  Clock::time_point last_poison_{};
};

// Process-wide registry of groups, keyed by c10d group name. Never destroyed (a leaked singleton):
// tearing down CUDA objects during static destruction races the CUDA runtime's own teardown.
class Runtime {
 public:
  static Runtime& get();

  std::shared_ptr<Group> create_group(const std::string& name, int rank, int world_size, int device);
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
  std::thread watchdog_;
  std::condition_variable cv_;
  std::atomic<bool> stop_{false};
};

}  // namespace ce_overlap

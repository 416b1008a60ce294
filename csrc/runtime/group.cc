// Group state, signalling primitives, timeout diagnosis and the watchdog thread (see group.h).
#include "group.h"

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace ce_overlap {

const char* op_kind_name(uint32_t kind) {
  switch (kind) {
    case static_cast<uint32_t>(OpKind::AllGather):
      return "all_gather_into_tensor";
    default:
      return "unknown op";
  }
}

RoundSignature round_signature(OpKind kind, uint64_t total_bytes, uint32_t round, uint64_t round_bytes,
                               uint64_t offset) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(kind));
  mix(total_bytes);
  mix(round);
  mix(round_bytes);
  mix(offset);
  // Bit 31 of each word is reserved for the poison bit.
  return RoundSignature{1u << (h % 31), 1u << ((h >> 32) % 31)};
}

namespace {

std::mutex g_local_copy_mu;
std::string g_local_copy_fallback;  // why the batch API was given up, empty while it works

bool local_copy_wants_hint() {
  static const bool wants = [] {
    const char* v = std::getenv("CE_OVERLAP_LOCAL_COPY");
    return v == nullptr || std::string(v) != "memcpy";
  }();
  return wants;
}

}  // namespace

cudaError_t local_copy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  bool use_batch = local_copy_wants_hint();
  if (use_batch) {
    std::lock_guard<std::mutex> lk(g_local_copy_mu);
    use_batch = g_local_copy_fallback.empty();
  }
  if (use_batch) {
    cudaMemcpyAttributes attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    void* dsts[1] = {dst};
    const void* srcs[1] = {src};
    size_t sizes[1] = {bytes};
    size_t attr_idx[1] = {0};
    cudaError_t err = cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, attr_idx, 1, stream);
    if (err == cudaSuccess) return err;
    (void)cudaGetLastError();
    std::lock_guard<std::mutex> lk(g_local_copy_mu);
    if (g_local_copy_fallback.empty()) {
      g_local_copy_fallback = std::string("batch API refused: ") + cudaGetErrorName(err);
      std::fprintf(stderr, "ce_overlap: cudaMemcpyBatchAsync failed (%s); local copies fall back to cudaMemcpyAsync\n",
                   cudaGetErrorName(err));
    }
  }
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}

std::string local_copy_mode() {
  if (!local_copy_wants_hint()) return "memcpy";
  std::lock_guard<std::mutex> lk(g_local_copy_mu);
  return g_local_copy_fallback.empty() ? "ce-hint" : "memcpy (" + g_local_copy_fallback + ")";
}

namespace {

double env_double(const char* name, double fallback) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') return fallback;
  char* end = nullptr;
  const double v = std::strtod(raw, &end);
  if (end == raw || *end != '\0' || !std::isfinite(v) || v <= 0) {
    throw std::runtime_error(std::string("ce_overlap: environment variable ") + name + "='" + raw +
                             "' is not a positive number");
  }
  return v;
}

void batch_mem_ops(cudaStream_t stream, std::vector<CUstreamBatchMemOpParams>& ops, const std::string& what) {
  if (ops.empty()) return;
  CE_CU_CHECK(driver_api().stream_batch_mem_op(reinterpret_cast<CUstream>(stream),
                                               static_cast<unsigned int>(ops.size()), ops.data(), 0),
              what);
}

CUstreamBatchMemOpParams wait_op(const void* addr, uint32_t value, unsigned int flags) {
  CUstreamBatchMemOpParams op;
  std::memset(&op, 0, sizeof(op));
  op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
  op.waitValue.address = as_cu_ptr(addr);
  op.waitValue.value = value;
  op.waitValue.flags = flags;
  return op;
}

CUstreamBatchMemOpParams write_op(const void* addr, uint32_t value) {
  CUstreamBatchMemOpParams op;
  std::memset(&op, 0, sizeof(op));
  op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
  op.writeValue.address = as_cu_ptr(addr);
  op.writeValue.value = value;
  // The default flags put a memory barrier before the write: the outbox is written after all earlier
  // work of the stream.
  op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return op;
}

// Polls a stream without blocking in the driver: a hung stream must not hang the watchdog.
bool wait_stream_bounded(cudaStream_t stream, double seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (true) {
    cudaError_t st = cudaStreamQuery(stream);
    if (st == cudaSuccess) return true;
    if (st != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

std::string signal_text(const PeerSignal& s) {
  std::ostringstream o;
  o << op_kind_name(s.kind_round >> 24) << " round " << (s.kind_round & 0xffffff) << ", " << s.nbytes
    << " bytes at pool offset " << s.offset << " (signature 0x" << std::hex << s.sig_a << "/0x" << s.sig_b << std::dec
    << ")";
  return o.str();
}

}  // namespace

GroupConfig GroupConfig::from_env() {
  const double pool_mb = env_double("CE_OVERLAP_POOL_MB", 1024);
  const double staging_mb = env_double("CE_OVERLAP_STAGING_MB", std::min(256.0, pool_mb / 4));
  if (staging_mb < 1 || staging_mb > pool_mb) {
    throw std::runtime_error("ce_overlap: CE_OVERLAP_STAGING_MB=" + std::to_string(staging_mb) +
                             " must be at least 1 and at most CE_OVERLAP_POOL_MB=" + std::to_string(pool_mb));
  }
  GroupConfig c;
  c.staging_bytes = static_cast<size_t>(staging_mb * 1024 * 1024);
  c.user_bytes = static_cast<size_t>(pool_mb * 1024 * 1024) - c.staging_bytes;
  c.timeout_s = env_double("CE_OVERLAP_TIMEOUT_S", 60);
  return c;
}

// ---------------------------------------------------------------------------------------------------
// Group

Group::Group(std::string name, int rank, int world_size, int device, const GroupConfig& config)
    : name_(std::move(name)), rank_(rank), world_size_(world_size), device_(device), timeout_s_(config.timeout_s) {
  pool_ = std::make_unique<SymmetricPool>(name_, rank, world_size, device, config.user_bytes, config.staging_bytes);
  const std::string ctx = "creating the streams of group '" + name_ + "'";
  DeviceScope scope(device);
  int least = 0, greatest = 0;
  CE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest), ctx);
  // Non-blocking: the legacy default stream must not serialize with our streams. Highest priority so
  // the flag waits/writes are not queued behind compute work when hardware queues are shared.
  CE_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_, cudaStreamNonBlocking, greatest), ctx);
  CE_CUDA_CHECK(cudaStreamCreateWithPriority(&self_, cudaStreamNonBlocking, greatest), ctx);
  CE_CUDA_CHECK(cudaStreamCreateWithPriority(&watchdog_stream_, cudaStreamNonBlocking, greatest), ctx);
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_caller_, cudaEventDisableTiming), ctx);
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_self_, cudaEventDisableTiming), ctx);
  void* host = nullptr;
  CE_CUDA_CHECK(cudaMallocHost(&host, sizeof(FlagsRegion)), ctx);
  host_flags_ = static_cast<FlagsRegion*>(host);
  CE_CUDA_CHECK(cudaMallocHost(&host, sizeof(FlagsRegion)), ctx);
  host_poison_ = static_cast<FlagsRegion*>(host);
  std::memset(host_flags_, 0, sizeof(FlagsRegion));
  std::memset(host_poison_, 0, sizeof(FlagsRegion));
}

Group::~Group() {
  int saved = 0;
  if (cudaGetDevice(&saved) != cudaSuccess) return;
  cudaSetDevice(device_);
  for (auto& op : pending_) {
    cudaEventDestroy(op.start);
    cudaEventDestroy(op.end);
  }
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  if (ev_caller_) cudaEventDestroy(ev_caller_);
  if (ev_self_) cudaEventDestroy(ev_self_);
  if (comm_) cudaStreamDestroy(comm_);
  if (self_) cudaStreamDestroy(self_);
  if (watchdog_stream_) cudaStreamDestroy(watchdog_stream_);
  if (host_flags_) cudaFreeHost(host_flags_);
  if (host_poison_) cudaFreeHost(host_poison_);
  pool_.reset();
  (void)cudaGetLastError();
  cudaSetDevice(saved);
}

void Group::open(const std::vector<PoolHandleBlob>& blobs) {
  std::lock_guard<std::mutex> lk(mu_);
  driver_api();  // refuse at rendezvous, not at the first op, when stream memory ops are missing
  pool_->open_peers(blobs);
  open_ = true;
}

void Group::throw_if_unusable_locked(const char* op) const {
  if (!open_) {
    throw std::runtime_error(std::string("ce_overlap.") + op + ": the rendezvous of group '" + name_ +
                             "' did not complete on rank " + std::to_string(rank_));
  }
  if (failed_.load()) {
    throw std::runtime_error(std::string("ce_overlap.") + op + " refused: group '" + name_ +
                             "' failed earlier and cannot be used again. First error: " + error_);
  }
}

void Group::wait_peers_done(uint32_t epoch) {
  if (epoch_ge(done_waited_, epoch)) return;
  std::vector<CUstreamBatchMemOpParams> ops;
  FlagsRegion* flags = pool_->local_flags();
  for (int i = 1; i < world_size_; ++i) {
    const int p = (rank_ + i) % world_size_;
    ops.push_back(wait_op(&flags->done[p], epoch, CU_STREAM_WAIT_VALUE_GEQ));
  }
  batch_mem_ops(comm_, ops, "group '" + name_ + "': waiting for the peers' done flags of epoch " + std::to_string(epoch));
  done_waited_ = epoch;
}

void Group::post_ready(const PeerSignal& s) {
  FlagsRegion* flags = pool_->local_flags();
  PeerSignal* box = &flags->ready_outbox;
  auto* words = reinterpret_cast<uint32_t*>(box);
  const uint32_t values[8] = {s.epoch,
                              s.sig_a,
                              s.sig_b,
                              s.kind_round,
                              static_cast<uint32_t>(s.nbytes),
                              static_cast<uint32_t>(s.nbytes >> 32),
                              static_cast<uint32_t>(s.offset),
                              static_cast<uint32_t>(s.offset >> 32)};
  static_assert(offsetof(PeerSignal, nbytes) == 16 && offsetof(PeerSignal, offset) == 24, "PeerSignal layout");
  std::vector<CUstreamBatchMemOpParams> ops;
  for (int w = 0; w < 8; ++w) ops.push_back(write_op(&words[w], values[w]));
  ops.push_back(write_op(&flags->done_outbox, s.epoch));
  batch_mem_ops(comm_, ops, "group '" + name_ + "': writing the signal outbox of epoch " + std::to_string(s.epoch));
  for (int i = 1; i < world_size_; ++i) {
    const int p = (rank_ + i) % world_size_;
    CE_CUDA_CHECK(cudaMemcpyAsync(&pool_->peer_flags(p)->ready[rank_], box, sizeof(PeerSignal),
                                  cudaMemcpyDeviceToDevice, comm_),
                  "group '" + name_ + "': signalling rank " + std::to_string(p));
  }
}

void Group::wait_peer_ready(int peer, uint32_t epoch, RoundSignature sig) {
  FlagsRegion* flags = pool_->local_flags();
  std::vector<CUstreamBatchMemOpParams> ops;
  ops.push_back(wait_op(&flags->ready[peer].epoch, epoch, CU_STREAM_WAIT_VALUE_GEQ));
  // AND: passes when the peer's signature bit equals ours, or when the watchdog set the poison bit.
  ops.push_back(wait_op(&flags->ready[peer].sig_a, sig.sig_a | kPoisonBit, CU_STREAM_WAIT_VALUE_AND));
  ops.push_back(wait_op(&flags->ready[peer].sig_b, sig.sig_b | kPoisonBit, CU_STREAM_WAIT_VALUE_AND));
  batch_mem_ops(comm_, ops, "group '" + name_ + "': waiting for rank " + std::to_string(peer) + " (epoch " +
                                std::to_string(epoch) + ")");
}

void Group::post_done(int peer) {
  FlagsRegion* flags = pool_->local_flags();
  CE_CUDA_CHECK(cudaMemcpyAsync(&pool_->peer_flags(peer)->done[rank_], &flags->done_outbox, sizeof(uint32_t),
                                cudaMemcpyDeviceToDevice, comm_),
                "group '" + name_ + "': signalling done to rank " + std::to_string(peer));
}

cudaEvent_t Group::take_event() {
  if (!free_events_.empty()) {
    cudaEvent_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "group '" + name_ + "': creating an event");
  return e;
}

void Group::track(PendingOp op) {
  retire_completed_locked();
  pending_.push_back(std::move(op));
}

void Group::retire_completed_locked() {
  while (!pending_.empty()) {
    PendingOp& op = pending_.front();
    cudaError_t st = cudaEventQuery(op.end);
    if (st == cudaErrorNotReady) return;
    if (st != cudaSuccess) {
      (void)cudaGetLastError();
      fail_locked("ce_overlap: " + op.name + " #" + std::to_string(op.seq) + " on group '" + name_ + "' (rank " +
                  std::to_string(rank_) + ") failed with a CUDA error: " + cudaGetErrorName(st) + " (" +
                  cudaGetErrorString(st) + ")");
      return;
    }
    free_events_.push_back(op.start);
    free_events_.push_back(op.end);
    pending_.pop_front();
  }
}

void Group::release_symmetric(size_t offset, size_t bytes, cudaStream_t caller) {
  std::lock_guard<std::mutex> lk(mu_);
  DeviceScope scope(device_);
  const std::string ctx = "group '" + name_ + "': releasing a symmetric tensor";
  cudaEvent_t on_caller = nullptr, on_comm = nullptr;
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&on_caller, cudaEventDisableTiming), ctx);
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&on_comm, cudaEventDisableTiming), ctx);
  CE_CUDA_CHECK(cudaEventRecord(on_caller, caller), ctx);
  CE_CUDA_CHECK(cudaEventRecord(on_comm, comm_), ctx);
  pool_->free_user(offset, bytes, {on_caller, on_comm});
}

void Group::synchronize(double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (true) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (failed_.load()) throw std::runtime_error(error_);
      if (pending_.empty()) return;
      cudaError_t st = cudaEventQuery(pending_.back().end);
      if (st == cudaSuccess) return;
      if (st != cudaErrorNotReady) {
        (void)cudaGetLastError();
        fail_locked("ce_overlap: group '" + name_ + "' (rank " + std::to_string(rank_) +
                    "): CUDA error while waiting for its ops: " + cudaGetErrorName(st) + " (" +
                    cudaGetErrorString(st) + ")");
        throw std::runtime_error(error_);
      }
      if (Clock::now() > deadline) {
        throw std::runtime_error("ce_overlap.synchronize: group '" + name_ + "' (rank " + std::to_string(rank_) +
                                 ") still has " + std::to_string(pending_.size()) + " ops in flight after " +
                                 std::to_string(timeout_s) + " s, and the watchdog (CE_OVERLAP_TIMEOUT_S=" +
                                 std::to_string(timeout_s_) + ") has not reported a stuck op");
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void Group::watchdog_tick(Clock::time_point now) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!open_ || pending_.empty()) return;
  if (cudaSetDevice(device_) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  retire_completed_locked();
  if (pending_.empty()) return;
  PendingOp& op = pending_.front();
  if (!op.started) {
    cudaError_t st = cudaEventQuery(op.start);
    if (st == cudaSuccess) {
      op.started = now;
    } else if (st != cudaErrorNotReady) {
      (void)cudaGetLastError();
    }
  }
  if (failed_.load()) {
    // Keep the comm stream draining: a late peer write can overwrite the poison with a smaller epoch.
    if (now - last_poison_ > std::chrono::seconds(1)) {
      poison_locked();
      last_poison_ = now;
    }
    return;
  }
  if (op.started && now - *op.started > std::chrono::duration<double>(timeout_s_)) {
    std::string message = diagnose_timeout_locked(op, now);
    fail_locked(message);
    if (!poison_locked()) {
      error_ += " Releasing the stuck GPU stream failed too (the unblocking write did not complete in 2 s).";
    }
    last_poison_ = now;
  }
}

std::string Group::diagnose_timeout_locked(const PendingOp& op, Clock::time_point now) {
  std::ostringstream m;
  if (op.rounds.empty()) {
    return "ce_overlap: timeout: " + op.name + " #" + std::to_string(op.seq) + " on group '" + name_ + "' (rank " +
           std::to_string(rank_) + ", no peers) did not complete within " + std::to_string(timeout_s_) +
           " s: the local copy is stuck.";
  }
  const double waited = std::chrono::duration<double>(now - *op.started).count();
  m << "ce_overlap: timeout: " << op.name << " #" << op.seq << " (" << op.nbytes_per_rank << " bytes per rank, "
    << (op.zero_copy ? "zero-copy from the symmetric pool" : "staged") << ", " << op.rounds.size() << " round(s), epochs "
    << op.rounds.front().epoch << ".." << op.rounds.back().epoch << ") on group '" << name_ << "' did not complete within "
    << timeout_s_ << " s (waited " << waited << " s) on rank " << rank_ << " (GPU " << device_ << ").";

  bool readable = cudaMemcpyAsync(host_flags_, pool_->local_flags(), sizeof(FlagsRegion), cudaMemcpyDeviceToHost,
                                  watchdog_stream_) == cudaSuccess &&
                  wait_stream_bounded(watchdog_stream_, 2.0);
  if (!readable) {
    (void)cudaGetLastError();
    m << " The flags could not be read back (the GPU does not respond), so the peers cannot be named.";
  } else {
    std::vector<int> missing;
    std::ostringstream details;
    for (int i = 1; i < world_size_; ++i) {
      const int p = (rank_ + i) % world_size_;
      const PeerSignal& got = host_flags_->ready[p];
      const uint32_t done = host_flags_->done[p];
      std::string why;
      if (op.done_needed_before != 0 && !epoch_ge(done, op.done_needed_before)) {
        why = "it has not finished reading this rank's data of epoch " + std::to_string(op.done_needed_before) +
              " (its done flag is at epoch " + std::to_string(done) + ")";
      } else if (!epoch_ge(got.epoch, op.rounds.front().epoch)) {
        why = "it never signalled this op: its last ready signal is epoch " + std::to_string(got.epoch) +
              (got.epoch == 0 ? " (none)" : " (" + signal_text(got) + ")") + ", this op needs epoch " +
              std::to_string(op.rounds.front().epoch) + " -- it has not called the collective, or called fewer ops";
      } else {
        for (const RoundInfo& r : op.rounds) {
          if (got.epoch == r.epoch && ((got.sig_a & r.sig.sig_a) == 0 || (got.sig_b & r.sig.sig_b) == 0)) {
            PeerSignal ours{r.epoch, r.sig.sig_a, r.sig.sig_b, static_cast<uint32_t>(op.kind) << 24 | r.round, r.nbytes,
                            r.offset};
            why = "it posted a different collective for epoch " + std::to_string(r.epoch) + ": " + signal_text(got) +
                  ", while this rank posted " + signal_text(ours) +
                  " -- mismatched sizes, a symmetric input on one rank only, or ops called in a different order";
            break;
          }
          if (!epoch_ge(got.epoch, r.epoch)) {
            why = "it stopped after epoch " + std::to_string(got.epoch) + " and never signalled round " +
                  std::to_string(r.round) + " (epoch " + std::to_string(r.epoch) + ")";
            break;
          }
        }
        if (why.empty() && op.done_needed_after != 0 && !epoch_ge(done, op.done_needed_after)) {
          why = "it has not finished reading this rank's shard (done flag at epoch " + std::to_string(done) +
                ", needed " + std::to_string(op.done_needed_after) + ")";
        }
      }
      if (!why.empty()) {
        missing.push_back(p);
        details << " Rank " << p << ": " << why << ".";
      }
    }
    if (missing.empty()) {
      m << " Every peer's flags have arrived; the comm stream is stuck elsewhere (local copy or copy engine).";
    } else {
      m << " Peer ranks whose flags never arrived: [";
      for (size_t i = 0; i < missing.size(); ++i) m << (i ? ", " : "") << missing[i];
      m << "]." << details.str();
    }
  }
  m << " The GPU stream was released; the outputs of this op and of every later op on this group are invalid,"
    << " and the group refuses further ops (restart the job). Set CE_OVERLAP_TIMEOUT_S to change the limit.";
  return m.str();
}

void Group::fail_locked(const std::string& message) {
  if (failed_.exchange(true)) return;
  error_ = message;
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
}

bool Group::poison_locked() {
  // Epoch values "far in the future" (cyclically) satisfy every GEQ wait of every enqueued op; the
  // all-ones signature satisfies every AND wait. Only the peer-written arrays are overwritten.
  const uint32_t poison_epoch = epoch_next_ + (1u << 29);
  for (int p = 0; p < world_size_; ++p) {
    host_poison_->ready[p] = PeerSignal{poison_epoch, 0xffffffffu, 0xffffffffu, 0, 0, 0};
    host_poison_->done[p] = poison_epoch;
  }
  const size_t bytes = offsetof(FlagsRegion, ready_outbox);
  if (cudaMemcpyAsync(pool_->local_flags(), host_poison_, bytes, cudaMemcpyHostToDevice, watchdog_stream_) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return wait_stream_bounded(watchdog_stream_, 2.0);
}

std::string Group::error() const {
  std::lock_guard<std::mutex> lk(mu_);
  return error_;
}

std::string Group::describe() {
  std::lock_guard<std::mutex> lk(mu_);
  std::ostringstream s;
  s << pool_->describe() << "; open=" << open_ << " ops=" << op_seq_ << " next_epoch=" << epoch_next_
    << " in_flight=" << pending_.size() << " timeout_s=" << timeout_s_ << " local_copy=" << local_copy_mode()
    << " failed=" << failed_.load();
  return s.str();
}

// ---------------------------------------------------------------------------------------------------
// Runtime

Runtime& Runtime::get() {
  static Runtime* runtime = new Runtime();
  return *runtime;
}

std::shared_ptr<Group> Runtime::create_group(const std::string& name, int rank, int world_size, int device) {
  std::lock_guard<std::mutex> lk(mu_);
  if (groups_.count(name)) {
    throw std::runtime_error("ce_overlap: group '" + name + "' already has a symmetric pool on this process");
  }
  const GroupConfig config = GroupConfig::from_env();
  auto group = std::make_shared<Group>(name, rank, world_size, device, config);
  groups_[name] = group;
  start_watchdog_locked();
  return group;
}

std::shared_ptr<Group> Runtime::find(const std::string& name) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = groups_.find(name);
  return it == groups_.end() ? nullptr : it->second;
}

std::shared_ptr<Group> Runtime::require(const std::string& name, const char* op) {
  std::shared_ptr<Group> g = find(name);
  if (!g) {
    throw std::runtime_error(std::string("ce_overlap.") + op + ": group '" + name +
                             "' has no ce_overlap symmetric pool in this process; call "
                             "ce_overlap.runtime.rendezvous(group) on every rank first (outside CUDA graph capture)");
  }
  return g;
}

void Runtime::remove(const std::string& name) {
  std::shared_ptr<Group> doomed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = groups_.find(name);
    if (it == groups_.end()) return;
    doomed = it->second;
    groups_.erase(it);
  }
  // Destroyed here (outside mu_) unless the watchdog still holds it; then it dies after its tick.
}

std::optional<std::string> Runtime::first_failure() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& [name, g] : groups_) {
    if (g->failed()) return g->error();
  }
  return std::nullopt;
}

void Runtime::start_watchdog_locked() {
  if (watchdog_.joinable()) return;
  watchdog_ = std::thread([this] { watchdog_main(); });
  // Stop before the CUDA runtime's own atexit teardown (atexit handlers run in reverse order of
  // registration, and the CUDA runtime registered its handler when it initialized, before us).
  std::atexit([] { Runtime::get().stop_watchdog(); });
}

void Runtime::watchdog_main() {
  while (true) {
    std::vector<std::shared_ptr<Group>> groups;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait_for(lk, std::chrono::milliseconds(20), [this] { return stop_.load(); });
      if (stop_.load()) return;
      for (auto& [name, g] : groups_) groups.push_back(g);
    }
    const auto now = Clock::now();
    for (auto& g : groups) {
      try {
        g->watchdog_tick(now);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ce_overlap: watchdog error on group '%s': %s\n", g->name().c_str(), e.what());
      }
    }
  }
}

void Runtime::stop_watchdog() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

}  // namespace ce_overlap

// Group state and the signalling primitives every op is built from (see group.h); the watchdog, the timeout
// diagnosis and the group registry are in watchdog.cc, same-GPU copies in local_copy.cc.
#include "group.h"

#include "reduce_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <sstream>

namespace ce_overlap {

const char* op_kind_name(uint32_t kind) {
  switch (kind) {
    case static_cast<uint32_t>(OpKind::AllGather):
      return "all_gather_into_tensor";
    case static_cast<uint32_t>(OpKind::ReduceScatter):
      return "reduce_scatter_tensor";
    case static_cast<uint32_t>(OpKind::AllToAll):
      return "all_to_all_single";
    case static_cast<uint32_t>(OpKind::Broadcast):
      return "broadcast";
    case static_cast<uint32_t>(OpKind::Send):
      return "send";
    case static_cast<uint32_t>(OpKind::Recv):
      return "recv";
    default:
      return "unknown op";
  }
}

const char* variant_name(uint32_t variant) {
  switch (variant) {
    case static_cast<uint32_t>(Variant::AgStaged):
      return "staged, pull";
    case static_cast<uint32_t>(Variant::AgSymmetricInput):
      return "zero-copy symmetric input, pull";
    case static_cast<uint32_t>(Variant::AgInPlace):
      return "in place in a symmetric output, pull";
    case static_cast<uint32_t>(Variant::AgPush):
      return "push into symmetric outputs";
    case static_cast<uint32_t>(Variant::RsPush):
      return "push into staging slots + reduction";
    case static_cast<uint32_t>(Variant::RsUnreduced):
      return "push into staging slots, copied out unreduced";
    case static_cast<uint32_t>(Variant::A2aStaged):
      return "staged, pull";
    case static_cast<uint32_t>(Variant::A2aSymmetricInput):
      return "zero-copy symmetric input, pull";
    case static_cast<uint32_t>(Variant::BcStaged):
      return "staged at the root, pull";
    case static_cast<uint32_t>(Variant::BcSymmetric):
      return "zero-copy symmetric tensor, pull";
    case static_cast<uint32_t>(Variant::BcScatterStaged):
      return "scatter + all-gather, staged";
    case static_cast<uint32_t>(Variant::BcPushSymmetric):
      return "pieces pulled from the root and pushed on, symmetric tensor";
    case static_cast<uint32_t>(Variant::P2pStaged):
      return "push into landing banks";
    case static_cast<uint32_t>(Variant::P2pDirect):
      return "push into the symmetric tensor";
    default:
      return "unknown variant";
  }
}

uint32_t kind_round_word(OpKind kind, Variant variant, uint32_t round) {
  return static_cast<uint32_t>(kind) << 24 | (static_cast<uint32_t>(variant) & 0xfu) << 20 | (round & 0xfffffu);
}

RoundSignature round_signature(OpKind kind, Variant variant, uint64_t total_bytes, uint32_t round,
                               uint64_t round_bytes, uint64_t offset, uint64_t extra) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(kind));
  mix(static_cast<uint64_t>(variant));
  mix(extra);
  mix(total_bytes);
  mix(round);
  mix(round_bytes);
  mix(offset);
  // Bit 31 of each word is reserved for the poison bit.
  return RoundSignature{1u << (h % 31), 1u << ((h >> 32) % 31)};
}

namespace {

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
  // work of the stream. (CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER would save the fence on all but the
  // first word, but the _v2 stream-memop API resolved in cuda_util.h does not support that flag.)
  op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return op;
}

// Appends to `ops` the stream writes that turn the 32-byte outbox `box` into signal `s`: only the words that
// differ from `mirror`, what the one stream that writes this outbox last wrote there (its writes are enqueued in
// order, under the group lock, and the pool starts zeroed), then updates the mirror. Back-to-back rounds of one
// shape share signature, sizes and offset, so a round usually writes 1-2 words instead of 8, each a fenced
// stream write less in the front end.
void outbox_writes(PeerSignal* box, uint32_t* mirror, const PeerSignal& s, std::vector<CUstreamBatchMemOpParams>& ops) {
  static_assert(offsetof(PeerSignal, nbytes) == 16 && offsetof(PeerSignal, offset) == 24, "PeerSignal layout");
  auto* words = reinterpret_cast<uint32_t*>(box);
  const uint32_t values[8] = {s.epoch,
                              s.sig_a,
                              s.sig_b,
                              s.kind_round,
                              static_cast<uint32_t>(s.nbytes),
                              static_cast<uint32_t>(s.nbytes >> 32),
                              static_cast<uint32_t>(s.offset),
                              static_cast<uint32_t>(s.offset >> 32)};
  for (int w = 0; w < 8; ++w) {
    if (values[w] == mirror[w]) continue;
    ops.push_back(write_op(&words[w], values[w]));
    mirror[w] = values[w];
  }
}

// Appends to `ops` the waits for `signal` (a flag in our own pool, written by a peer) to reach `epoch` (cyclic GEQ)
// with our signature: the AND waits pass when the peer's signature bit equals ours, or when the watchdog set the
// poison bit.
void signal_waits(const PeerSignal* signal, uint32_t epoch, RoundSignature sig, std::vector<CUstreamBatchMemOpParams>& ops) {
  ops.push_back(wait_op(&signal->epoch, epoch, CU_STREAM_WAIT_VALUE_GEQ));
  ops.push_back(wait_op(&signal->sig_a, sig.sig_a | kPoisonBit, CU_STREAM_WAIT_VALUE_AND));
  ops.push_back(wait_op(&signal->sig_b, sig.sig_b | kPoisonBit, CU_STREAM_WAIT_VALUE_AND));
}

}  // namespace

GroupConfig GroupConfig::make(double pool_mb, double staging_mb, double p2p_mb, double timeout_s, double reduce_sms,
                              double rs_round_mb, double pull_split, double copy_rate_gbps,
                              const std::string& fault_inject) {
  auto bad = [](const std::string& field, double value, const std::string& want) {
    throw std::invalid_argument("ce_overlap: RuntimeConfig." + field + "=" + std::to_string(value) + " " + want);
  };
  auto positive = [&](const char* field, double v) {
    if (!std::isfinite(v) || v <= 0) bad(field, v, "must be a positive number");
  };
  positive("pool_mb", pool_mb);
  positive("timeout_s", timeout_s);
  positive("rs_round_mb", rs_round_mb);
  if (!std::isfinite(staging_mb) || staging_mb < 1 || staging_mb > pool_mb) {
    bad("staging_mb", staging_mb, "must be at least 1 and at most pool_mb=" + std::to_string(pool_mb));
  }
  if (!std::isfinite(p2p_mb) || p2p_mb < 1 || staging_mb + p2p_mb > pool_mb) {
    bad("p2p_mb", p2p_mb, "must be at least 1, and staging_mb + p2p_mb at most pool_mb=" + std::to_string(pool_mb));
  }
  if (reduce_sms != std::floor(reduce_sms) || reduce_sms < 1 || reduce_sms > 1024) {
    bad("reduce_sms", reduce_sms, "must be a whole number of CTAs in 1..1024");
  }
  if (pull_split != std::floor(pull_split) || pull_split < 1 || pull_split > kMaxPullSplit) {
    bad("pull_split", pull_split, "must be a whole number in 1.." + std::to_string(kMaxPullSplit));
  }
  if (!std::isfinite(copy_rate_gbps) || copy_rate_gbps < 0) {
    bad("copy_rate_gbps", copy_rate_gbps, "must be a finite number >= 0 (GB/s; 0: unlimited)");
  }
  if (!fault_inject.empty() && fault_inject != "p2p_refused") {
    throw std::invalid_argument("ce_overlap: RuntimeConfig.fault_inject='" + fault_inject +
                                "' is not a fault this runtime injects (known: p2p_refused)");
  }
  GroupConfig c;
  c.staging_bytes = static_cast<size_t>(staging_mb * 1024 * 1024);
  c.p2p_bytes = static_cast<size_t>(p2p_mb * 1024 * 1024);
  c.user_bytes = static_cast<size_t>(pool_mb * 1024 * 1024) - c.staging_bytes - c.p2p_bytes;
  c.timeout_s = timeout_s;
  c.reduce_ctas = static_cast<int>(reduce_sms);
  const double round_mb = std::min(rs_round_mb, 1048576.0);
  c.rs_round_bytes = std::max<size_t>(kPoolAlignment, static_cast<size_t>(round_mb * 1024 * 1024) / kPoolAlignment * kPoolAlignment);
  c.pull_split = static_cast<int>(pull_split);
  c.copy_rate_gbps = copy_rate_gbps;
  c.refuse_p2p = fault_inject == "p2p_refused";
  return c;
}

// ---------------------------------------------------------------------------------------------------
// Group

Group::Group(std::string name, int rank, int world_size, int device, const GroupConfig& config)
    : name_(std::move(name)),
      rank_(rank),
      world_size_(world_size),
      device_(device),
      timeout_s_(config.timeout_s),
      reduce_ctas_(config.reduce_ctas),
      rs_round_bytes_(config.rs_round_bytes),
      pull_split_(config.pull_split),
      peer_lanes_(kDefaultPeerLanes),
      copy_rate_gbps_(config.copy_rate_gbps),
      refuse_p2p_(config.refuse_p2p),
      p2p_send_(static_cast<size_t>(world_size), nullptr),
      p2p_recv_(static_cast<size_t>(world_size), nullptr),
      p2p_send_round_(static_cast<size_t>(world_size), 0),
      p2p_recv_round_(static_cast<size_t>(world_size), 0),
      p2p_credit_mirror_(static_cast<size_t>(world_size), std::array<uint32_t, 8>{}),
      p2p_landed_mirror_(static_cast<size_t>(world_size), std::array<uint32_t, 8>{}) {
  pool_ = std::make_unique<SymmetricPool>(name_, rank, world_size, device, config.user_bytes, config.staging_bytes,
                                          config.p2p_bytes);
  const std::string ctx = "creating the streams of group '" + name_ + "'";
  DeviceScope scope(device);
  int least = 0, greatest = 0;
  CE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest), ctx);
  stream_priority_ = greatest;
  // Non-blocking: the legacy default stream must not serialize with our streams. Highest priority so
  // the flag waits/writes are not queued behind compute work when hardware queues are shared.
  CE_CUDA_CHECK(cudaStreamCreateWithPriority(&comm_, cudaStreamNonBlocking, greatest), ctx);
  CE_CUDA_CHECK(cudaStreamCreateWithPriority(&self_, cudaStreamNonBlocking, greatest), ctx);
  CE_CUDA_CHECK(cudaStreamCreateWithPriority(&reduce_, cudaStreamNonBlocking, greatest), ctx);
  CE_CUDA_CHECK(cudaStreamCreateWithPriority(&watchdog_stream_, cudaStreamNonBlocking, greatest), ctx);
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_caller_, cudaEventDisableTiming), ctx);
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_self_, cudaEventDisableTiming), ctx);
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_arrived_, cudaEventDisableTiming), ctx);
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_bank_[0], cudaEventDisableTiming), ctx);
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_bank_[1], cudaEventDisableTiming), ctx);
  for (int i = 0; i < kMaxPullSplit - 1; ++i) {
    CE_CUDA_CHECK(cudaStreamCreateWithPriority(&pull_[i], cudaStreamNonBlocking, greatest), ctx);
    CE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_join_[i], cudaEventDisableTiming), ctx);
  }
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_fork_, cudaEventDisableTiming), ctx);
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&ev_lane_fork_, cudaEventDisableTiming), ctx);
  // Pacer slots: one per peer lane (0 = the comm stream), then one per send channel (peer).
  const size_t pacers = static_cast<size_t>(std::max(1, world_size - 1) + world_size);
  CE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&pace_last_), pacers * sizeof(unsigned long long)), ctx);
  CE_CUDA_CHECK(cudaMemset(pace_last_, 0, pacers * sizeof(unsigned long long)), ctx);
  for (int i = 0; i + 2 < world_size; ++i) {
    lanes_.push_back(nullptr);
    lane_join_.push_back(nullptr);
    CE_CUDA_CHECK(cudaStreamCreateWithPriority(&lanes_.back(), cudaStreamNonBlocking, greatest), ctx);
    CE_CUDA_CHECK(cudaEventCreateWithFlags(&lane_join_.back(), cudaEventDisableTiming), ctx);
  }
  // Load the reduction kernels now, while nothing of this group waits on a peer. With lazy loading
  // (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2) the first launch of a kernel loads it, and
  // loading may wait for the whole device to go idle: inside an enqueue (group lock held) whose comm
  // stream waits for a peer that posted a different collective, that wait never ends, and the watchdog,
  // which needs the lock to release the stream, could not act (the hang of the mismatch test).
  {
    static std::mutex preload_mu;
    static std::set<int> preloaded;  // devices whose context has the kernels loaded
    std::lock_guard<std::mutex> lk(preload_mu);
    if (!preloaded.count(device)) {
      CE_CUDA_CHECK(preload_reduce_kernels(reduce_), ctx + ": loading the reduction kernels");
      CE_CUDA_CHECK(cudaStreamSynchronize(reduce_), ctx + ": loading the reduction kernels");
      preloaded.insert(device);
    }
  }
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
  if (ev_arrived_) cudaEventDestroy(ev_arrived_);
  for (cudaEvent_t e : ev_bank_) {
    if (e) cudaEventDestroy(e);
  }
  for (int i = 0; i < kMaxPullSplit - 1; ++i) {
    if (ev_join_[i]) cudaEventDestroy(ev_join_[i]);
    if (pull_[i]) cudaStreamDestroy(pull_[i]);
  }
  if (ev_fork_) cudaEventDestroy(ev_fork_);
  if (ev_lane_fork_) cudaEventDestroy(ev_lane_fork_);
  if (pace_last_) cudaFree(pace_last_);
  for (cudaEvent_t e : lane_join_) {
    if (e) cudaEventDestroy(e);
  }
  for (cudaStream_t s : lanes_) {
    if (s) cudaStreamDestroy(s);
  }
  for (cudaStream_t s : p2p_send_) {
    if (s) cudaStreamDestroy(s);
  }
  for (cudaStream_t s : p2p_recv_) {
    if (s) cudaStreamDestroy(s);
  }
  if (comm_) cudaStreamDestroy(comm_);
  if (self_) cudaStreamDestroy(self_);
  if (reduce_) cudaStreamDestroy(reduce_);
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
  pool_->open_peers(blobs, refuse_p2p_);
  open_ = true;
}

void Group::throw_if_unusable_locked(const char* op) const {
  if (!open_) {
    throw std::runtime_error(std::string("ce_overlap.") + op + ": the rendezvous of group '" + name_ +
                             "' did not complete on rank " + std::to_string(rank_));
  }
  if (failed_.load()) {
    throw std::runtime_error(std::string("ce_overlap.") + op + " refused: group '" + name_ +
                             "' failed earlier and cannot be used again. First error: " + error());
  }
}

void Group::set_reduce_ctas(int ctas) {
  if (ctas < 1 || ctas > 1024) {
    throw std::invalid_argument("reduce CTAs must be in 1..1024, got " + std::to_string(ctas));
  }
  reduce_ctas_.store(ctas);
}

void Group::set_rs_round_bytes(size_t bytes) {
  rs_round_bytes_.store(std::max<size_t>(kPoolAlignment, bytes / kPoolAlignment * kPoolAlignment));
}

void Group::set_peer_lanes(int lanes) {
  if (lanes < 0) {
    throw std::invalid_argument("peer_lanes must be >= 0 (0: one lane per peer), got " + std::to_string(lanes));
  }
  peer_lanes_.store(lanes);
}

void Group::set_peer_sync(int mode) {
  if (mode < static_cast<int>(PeerSync::Each) || mode > static_cast<int>(PeerSync::RoundBatched)) {
    throw std::invalid_argument("peer_sync must be 0 (each peer in turn), 1 (per round) or 2 (per round, batched "
                                "signal copies), got " + std::to_string(mode));
  }
  peer_sync_.store(mode);
}

void Group::set_copy_rate_gbps(double gbps) {
  if (!(gbps >= 0) || !std::isfinite(gbps)) {
    throw std::invalid_argument("copy_rate_gbps must be a finite number >= 0 (0: unlimited), got " +
                                std::to_string(gbps));
  }
  copy_rate_gbps_.store(gbps);
}

void Group::set_bcast_segments(int segments) {
  if (segments < 0 || segments > kMaxBcastSegments) {
    throw std::invalid_argument("bcast_segments must be in 0.." + std::to_string(kMaxBcastSegments) +
                                " (0: chosen from the size), got " + std::to_string(segments));
  }
  bcast_segments_.store(segments);
}

void Group::set_pull_split(int pieces) {
  if (pieces < 1 || pieces > kMaxPullSplit) {
    throw std::invalid_argument("pull split must be in 1.." + std::to_string(kMaxPullSplit) + ", got " +
                                std::to_string(pieces));
  }
  pull_split_.store(pieces);
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
  // The ready outbox and the done outbox (this round's epoch) are written only here, on the comm stream;
  // outbox_words_ mirrors both. The copies below read the outbox after all of the writes.
  std::vector<CUstreamBatchMemOpParams> ops;
  outbox_writes(box, outbox_words_, s, ops);
  if (outbox_words_[8] != s.epoch) {
    ops.push_back(write_op(&flags->done_outbox, s.epoch));
    outbox_words_[8] = s.epoch;
  }
  batch_mem_ops(comm_, ops, "group '" + name_ + "': writing the signal outbox of epoch " + std::to_string(s.epoch));
  std::vector<void*> dsts;
  for (int p : peers()) dsts.push_back(&pool_->peer_flags(p)->ready[rank_]);
  signal_copies(dsts, box, sizeof(PeerSignal), comm_,
                "group '" + name_ + "': signalling ready (epoch " + std::to_string(s.epoch) + ")");
}

void Group::signal_copies(const std::vector<void*>& dsts, const void* src, size_t bytes, cudaStream_t stream,
                          const std::string& what) {
  if (dsts.empty()) return;
  if (peer_sync_.load() == static_cast<int>(PeerSync::RoundBatched) && dsts.size() > 1) {
    static std::atomic<bool> refused{false};  // the batch API refused once: plain copies from then on (said once)
    if (!refused.load()) {
      const std::vector<const void*> srcs(dsts.size(), src);
      const std::vector<size_t> sizes(dsts.size(), bytes);
      const cudaError_t err = batch_copies(dsts.data(), srcs.data(), sizes.data(), dsts.size(), device_,
                                           /*hint=*/false, stream);
      if (err == cudaSuccess) return;
      (void)cudaGetLastError();
      if (!refused.exchange(true)) {
        std::fprintf(stderr, "ce_overlap: cudaMemcpyBatchAsync refused the signal copies (%s: %s); peer_sync=2 "
                     "signals with one cudaMemcpyAsync per peer instead\n", cudaGetErrorName(err),
                     cudaGetErrorString(err));
      }
    }
  }
  for (void* dst : dsts) {
    CE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), what);
  }
}

namespace {
thread_local double t_op_copy_rate_gbps = 0;  // Group::OpCopyRate's rate on this thread; 0: none
}  // namespace

Group::OpCopyRate::OpCopyRate(double gbps) : saved_(t_op_copy_rate_gbps) {
  if (!std::isfinite(gbps) || gbps < 0) {
    throw std::invalid_argument("copy_rate_gbps must be a finite number >= 0 (0: the group's rate), got " +
                                std::to_string(gbps));
  }
  if (gbps > 0) t_op_copy_rate_gbps = gbps;
}

Group::OpCopyRate::~OpCopyRate() { t_op_copy_rate_gbps = saved_; }

double Group::effective_copy_rate_gbps() const {
  return t_op_copy_rate_gbps > 0 ? t_op_copy_rate_gbps : copy_rate_gbps_.load();
}

void Group::peer_copy(char* dst, const char* src, size_t bytes, const std::string& what, cudaStream_t stream) {
  if (!stream) stream = comm_;
  const double rate = effective_copy_rate_gbps();
  if (rate <= 0) {
    CE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), what);
    return;
  }
  // The stream's pacer slot (copies of one stream are paced against each other): a peer lane's, or a send channel's.
  size_t lane = 0;
  for (size_t i = 0; i < lanes_.size(); ++i) {
    if (lanes_[i] == stream) lane = i + 1;
  }
  for (size_t p = 0; p < p2p_send_.size(); ++p) {
    if (p2p_send_[p] == stream) lane = static_cast<size_t>(std::max(1, world_size_ - 1)) + p;
  }
  // Chunks of ~25 us at the rate (at least 1 MiB, 64 KiB multiples): a pacer launch costs a few us of stream time.
  constexpr size_t kAlign = 64 * 1024;
  const size_t chunk = std::max<size_t>(1 << 20, static_cast<size_t>(rate * 25e3) / kAlign * kAlign);
  for (size_t off = 0; off < bytes; off += chunk) {
    const size_t len = std::min(chunk, bytes - off);
    const auto interval_ns = static_cast<unsigned long long>(static_cast<double>(len) / rate);  // bytes / (GB/s) = ns
    CE_CUDA_CHECK(launch_pace(pace_last_ + lane, interval_ns, stream), what + ": pacing the copy");
    CE_CUDA_CHECK(cudaMemcpyAsync(dst + off, src + off, len, cudaMemcpyDeviceToDevice, stream), what);
  }
}

void Group::pull_copy(char* dst, const char* src, size_t bytes, const std::string& what, cudaStream_t stream) {
  if ((stream && stream != comm_) || effective_copy_rate_gbps() > 0) {
    peer_copy(dst, src, bytes, what, stream);
    return;
  }
  const size_t most = std::max<size_t>(1, bytes / kMinPullPiece);
  const int k = static_cast<int>(std::min<size_t>(static_cast<size_t>(pull_split()), most));
  if (k <= 1) {
    CE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, comm_), what);
    return;
  }
  // Pieces of ceil(bytes / k) rounded up to 64 KiB (so k pieces always cover `bytes`); the last takes the rest.
  constexpr size_t kPieceAlign = 64 * 1024;
  const size_t per = (bytes + static_cast<size_t>(k) - 1) / static_cast<size_t>(k);
  const size_t piece = (per + kPieceAlign - 1) / kPieceAlign * kPieceAlign;
  CE_CUDA_CHECK(cudaEventRecord(ev_fork_, comm_), what);
  int forked = 0;
  for (int j = 1; j < k; ++j) {
    const size_t off = static_cast<size_t>(j) * piece;
    if (off >= bytes) break;
    const size_t len = j == k - 1 ? bytes - off : std::min(piece, bytes - off);
    CE_CUDA_CHECK(cudaStreamWaitEvent(pull_[j - 1], ev_fork_, 0), what);
    CE_CUDA_CHECK(cudaMemcpyAsync(dst + off, src + off, len, cudaMemcpyDeviceToDevice, pull_[j - 1]), what);
    CE_CUDA_CHECK(cudaEventRecord(ev_join_[j - 1], pull_[j - 1]), what);
    ++forked;
  }
  CE_CUDA_CHECK(cudaMemcpyAsync(dst, src, std::min(piece, bytes), cudaMemcpyDeviceToDevice, comm_), what);
  for (int j = 0; j < forked; ++j) CE_CUDA_CHECK(cudaStreamWaitEvent(comm_, ev_join_[j], 0), what);
}

std::vector<int> Group::peers() const {
  std::vector<int> out;
  for (int i = 1; i < world_size_; ++i) out.push_back((rank_ + i) % world_size_);
  return out;
}

void Group::wait_ready(const std::vector<int>& from, uint32_t epoch, RoundSignature sig, cudaStream_t stream) {
  FlagsRegion* flags = pool_->local_flags();
  std::vector<CUstreamBatchMemOpParams> ops;
  for (int p : from) signal_waits(&flags->ready[p], epoch, sig, ops);
  batch_mem_ops(stream, ops, "group '" + name_ + "': waiting for the ready of " +
                                 (from.size() == 1 ? "rank " + std::to_string(from[0]) : std::string("every peer")) +
                                 " (epoch " + std::to_string(epoch) + ")");
}

void Group::post_done(const std::vector<int>& to, uint32_t epoch, cudaStream_t stream) {
  std::vector<void*> dsts;
  for (int p : to) dsts.push_back(&pool_->peer_flags(p)->done[rank_]);
  signal_copies(dsts, &pool_->local_flags()->done_outbox, sizeof(uint32_t), stream,
                "group '" + name_ + "': signalling done (epoch " + std::to_string(epoch) + ")");
}

void Group::join_lane(int i, const std::string& where) {
  CE_CUDA_CHECK(cudaEventRecord(lane_join_.at(static_cast<size_t>(i - 1)), lanes_.at(static_cast<size_t>(i - 1))),
                where + ": joining lane " + std::to_string(i));
  CE_CUDA_CHECK(cudaStreamWaitEvent(comm_, lane_join_[static_cast<size_t>(i - 1)], 0),
                where + ": joining lane " + std::to_string(i));
}

void Group::peer_round(const std::string& where, uint32_t epoch, RoundSignature sig,
                       const std::function<void(int, cudaStream_t)>& copies) {
  const std::vector<int> order = peers();
  const int tuned = peer_lanes_.load();
  const int lanes = tuned <= 0 ? static_cast<int>(order.size()) : std::min(tuned, static_cast<int>(order.size()));
  const bool each = peer_sync_.load() == static_cast<int>(PeerSync::Each);
  if (!each) wait_ready(order, epoch, sig, comm_);  // every peer's ready, in one batch of waits on the comm stream
  if (lanes > 1) {
    CE_CUDA_CHECK(cudaEventRecord(ev_lane_fork_, comm_), where + ": forking the peer lanes");
    for (int j = 1; j < lanes; ++j) {
      CE_CUDA_CHECK(cudaStreamWaitEvent(lanes_[j - 1], ev_lane_fork_, 0), where + ": forking the peer lanes");
    }
  }
  for (size_t i = 0; i < order.size(); ++i) {
    const int lane = static_cast<int>(i) % lanes;  // lanes >= 1 whenever there is a peer
    const cudaStream_t stream = lane == 0 ? comm_ : lanes_[lane - 1];
    if (each) wait_ready({order[i]}, epoch, sig, stream);
    copies(order[i], stream);
    if (each) post_done({order[i]}, epoch, stream);
  }
  for (int j = 1; j < lanes; ++j) join_lane(j, where);
  if (!each) post_done(order, epoch, comm_);
}

cudaStream_t Group::p2p_stream(int peer, bool send) {
  cudaStream_t& s = (send ? p2p_send_ : p2p_recv_).at(static_cast<size_t>(peer));
  if (s == nullptr) {
    CE_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, stream_priority_),
                  "group '" + name_ + "': creating the " + (send ? "send" : "receive") + " stream for rank " +
                      std::to_string(peer));
  }
  return s;
}

uint32_t Group::next_p2p_round(int peer, bool send) {
  uint32_t& last = (send ? p2p_send_round_ : p2p_recv_round_).at(static_cast<size_t>(peer));
  ++last;
  uint32_t hint = p2p_hint_.load();
  while (epoch_ge(last, hint) && !p2p_hint_.compare_exchange_weak(hint, last + 1)) {
  }
  return last;
}

void Group::post_p2p(int peer, bool credit, const PeerSignal& s, cudaStream_t stream) {
  FlagsRegion* flags = pool_->local_flags();
  const size_t p = static_cast<size_t>(peer);
  PeerSignal* box = credit ? &flags->p2p_credit_outbox[p] : &flags->p2p_landed_outbox[p];
  uint32_t* mirror = credit ? p2p_credit_mirror_[p].data() : p2p_landed_mirror_[p].data();
  const std::string what = "group '" + name_ + "': signalling " + (credit ? "a receive credit" : "landed bytes") +
                           " of round " + std::to_string(s.epoch) + " to rank " + std::to_string(peer);
  std::vector<CUstreamBatchMemOpParams> ops;
  outbox_writes(box, mirror, s, ops);
  batch_mem_ops(stream, ops, what);
  PeerSignal* dst = credit ? &pool_->peer_flags(peer)->p2p_credit[rank_] : &pool_->peer_flags(peer)->p2p_landed[rank_];
  CE_CUDA_CHECK(cudaMemcpyAsync(dst, box, sizeof(PeerSignal), cudaMemcpyDeviceToDevice, stream), what);
}

void Group::wait_p2p(int peer, bool credit, uint32_t round, RoundSignature sig, cudaStream_t stream) {
  FlagsRegion* flags = pool_->local_flags();
  PeerSignal* f = credit ? &flags->p2p_credit[peer] : &flags->p2p_landed[peer];
  std::vector<CUstreamBatchMemOpParams> ops;
  signal_waits(f, round, sig, ops);
  batch_mem_ops(stream, ops, "group '" + name_ + "': waiting for rank " + std::to_string(peer) + "'s " +
                                 (credit ? "receive credit" : "bytes") + " of round " + std::to_string(round));
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
  // The oldest ops only, up to the first still running: an enqueue usually runs while the device is behind, when
  // every op in flight is still running, and a query of each of them per enqueue grows with the ops in flight
  // (GPT-2 width 1536 at 2 ranks: 413 event queries per step, 131 this way; bench/results/host-time-2026-12-02, j).
  // Ops that completed out of order behind a running one go at the watchdog's next full pass (every 20 ms).
  retire_completed_locked(/*oldest_only=*/true);
  pending_.push_back(std::move(op));
}

void Group::retire_completed_locked(bool oldest_only) {
  // Every op, not only the oldest: point-to-point ops run on their channels' streams and complete out of order.
  for (auto it = pending_.begin(); it != pending_.end();) {
    cudaError_t st = cudaEventQuery(it->end);
    if (st == cudaErrorNotReady) {
      if (oldest_only) return;
      ++it;
      continue;
    }
    if (st != cudaSuccess) {
      (void)cudaGetLastError();
      fail_locked("ce_overlap: " + it->name + " #" + std::to_string(it->seq) + " on group '" + name_ + "' (rank " +
                  std::to_string(rank_) + ") failed with a CUDA error: " + cudaGetErrorName(st) + " (" +
                  cudaGetErrorString(st) + ")");
      return;
    }
    free_events_.push_back(it->start);
    free_events_.push_back(it->end);
    it = pending_.erase(it);
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

PendingOp begin_op(Group& g, const char* name, OpKind kind, Variant variant, size_t nbytes_per_rank) {
  PendingOp op;
  op.name = name;
  op.seq = g.next_op_seq();
  op.kind = kind;
  op.variant = variant;
  op.push_style = variant == Variant::AgPush || variant == Variant::RsPush || variant == Variant::RsUnreduced ||
                  variant == Variant::P2pStaged || variant == Variant::P2pDirect;
  op.nbytes_per_rank = nbytes_per_rank;
  op.enqueued = Clock::now();
  op.start = g.take_event();
  op.end = g.take_event();
  return op;
}

void start_on(Group& g, cudaStream_t stream, PendingOp& op, const std::string& where) {
  CE_CUDA_CHECK(cudaStreamWaitEvent(stream, g.caller_ready_event(), 0), where);
  CE_CUDA_CHECK(cudaEventRecord(op.start, stream), where);
}

void join_caller(Group& g, cudaStream_t caller, PendingOp& op, const std::string& where) {
  CE_CUDA_CHECK(cudaEventRecord(g.caller_ready_event(), caller), where);
  start_on(g, g.comm_stream(), op, where);
}

void hand_back(Group& g, PendingOp op, cudaStream_t caller, cudaEvent_t join, const std::string& where) {
  hand_back_from(g, g.comm_stream(), std::move(op), caller, join, where);
}

void hand_back_from(Group& g, cudaStream_t stream, PendingOp op, cudaStream_t caller, cudaEvent_t join,
                    const std::string& where) {
  CE_CUDA_CHECK(cudaEventRecord(op.end, stream), where);
  if (join != nullptr) {
    CE_CUDA_CHECK(cudaEventRecord(join, stream), where);  // the caller joins later (wait_tensor, a p2p work)
  } else {
    CE_CUDA_CHECK(cudaStreamWaitEvent(caller, op.end, 0), where);
  }
  g.track(std::move(op));
}

void refuse_graph_capture(const Group& g, cudaStream_t caller, const char* op, const std::string& where) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CE_CUDA_CHECK(cudaStreamIsCapturing(caller, &capture), where);
  if (capture != cudaStreamCaptureStatusNone) {
    throw std::runtime_error("ce_overlap." + std::string(op) + " on group '" + g.name() +
                             "' cannot be captured into a CUDA graph in this version of the runtime");
  }
}

}  // namespace ce_overlap

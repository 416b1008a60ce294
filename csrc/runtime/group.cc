// Group state, signalling primitives, timeout diagnosis and the watchdog thread (see group.h).
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

std::mutex g_local_copy_mu;
std::string g_local_copy_fallback;  // why the batch API was given up, empty while it works
bool g_local_copy_batch_used = false;

bool local_copy_wants_hint() {
  static const bool wants = [] {
    const char* v = std::getenv("CE_OVERLAP_LOCAL_COPY");
    return v == nullptr || std::string(v) != "memcpy";
  }();
  return wants;
}

#if CUDART_VERSION >= 12080
// One same-GPU copy through cudaMemcpyBatchAsync (a batch of one). Valid arguments, per the CUDA 12.8 / 13.0
// headers: srcAccessOrder Stream (the source is read in stream order, after the work before it), location
// hints naming this device (they only matter for managed / pageable memory, ignored otherwise), attrsIdxs
// = {0}, numAttrs = 1 <= count, and a stream that is not the legacy NULL stream. CUDA 12.x takes a
// failIdx out-parameter (removed in 13.0).
cudaError_t batch_copy(void* dst, const void* src, size_t bytes, int device, bool hint, cudaStream_t stream) {
  if (is_legacy_stream(stream)) return cudaErrorInvalidValue;
  cudaMemcpyAttributes attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.srcLocHint.type = cudaMemLocationTypeDevice;
  attr.srcLocHint.id = device;
  attr.dstLocHint.type = cudaMemLocationTypeDevice;
  attr.dstLocHint.id = device;
  attr.flags = hint ? cudaMemcpyFlagPreferOverlapWithCompute : cudaMemcpyFlagDefault;
  void* dsts[1] = {dst};
  const void* srcs[1] = {src};
  size_t sizes[1] = {bytes};
  size_t attr_idx[1] = {0};
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, attr_idx, 1, stream);
#else
  size_t fail_idx = 0;
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, attr_idx, 1, &fail_idx, stream);
#endif
}
#else
cudaError_t batch_copy(void*, const void*, size_t, int, bool, cudaStream_t) { return cudaErrorNotSupported; }
#endif

}  // namespace

bool is_legacy_stream(cudaStream_t stream) { return stream == nullptr || stream == cudaStreamLegacy; }

cudaError_t local_copy_async(void* dst, const void* src, size_t bytes, int device, cudaStream_t stream) {
  bool use_batch = local_copy_wants_hint() && !is_legacy_stream(stream);
  if (use_batch) {
    std::lock_guard<std::mutex> lk(g_local_copy_mu);
    use_batch = g_local_copy_fallback.empty();
  }
  if (use_batch) {
    const cudaError_t err = batch_copy(dst, src, bytes, device, /*hint=*/true, stream);
    if (err == cudaSuccess) {
      std::lock_guard<std::mutex> lk(g_local_copy_mu);
      g_local_copy_batch_used = true;
      return err;
    }
    (void)cudaGetLastError();
    std::lock_guard<std::mutex> lk(g_local_copy_mu);
    if (g_local_copy_fallback.empty()) {
      g_local_copy_fallback = std::string("batch API refused: ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
      std::fprintf(stderr, "ce_overlap: cudaMemcpyBatchAsync failed (%s: %s); local copies fall back to cudaMemcpyAsync\n",
                   cudaGetErrorName(err), cudaGetErrorString(err));
    }
  }
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}

cudaError_t local_copy_with(const std::string& mode, void* dst, const void* src, size_t bytes, int device,
                            cudaStream_t stream) {
  if (mode == "memcpy") return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
  if (mode == "peer") return cudaMemcpyPeerAsync(dst, device, src, device, bytes, stream);
  if (mode == "batch_hint" || mode == "batch") return batch_copy(dst, src, bytes, device, mode == "batch_hint", stream);
  throw std::invalid_argument("unknown local copy mode '" + mode + "' (expected memcpy, batch_hint, batch or peer)");
}

std::string local_copy_mode() {
  if (!local_copy_wants_hint()) return "memcpy";
  std::lock_guard<std::mutex> lk(g_local_copy_mu);
  if (!g_local_copy_fallback.empty()) return "memcpy (" + g_local_copy_fallback + ")";
  // Until the first local copy ran, the hint is only intended; afterwards cudaMemcpyBatchAsync accepted it.
  return g_local_copy_batch_used ? "ce-hint" : "ce-hint (no local copy yet)";
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
  o << op_kind_name(s.kind_round >> 24) << " (" << variant_name((s.kind_round >> 20) & 0xfu) << ") round "
    << (s.kind_round & 0xfffff) << ", " << s.nbytes << " bytes at pool offset " << s.offset << " (signature 0x"
    << std::hex << s.sig_a << "/0x" << s.sig_b << std::dec << ")";
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
  const double p2p_mb = env_double("CE_OVERLAP_P2P_MB", std::min(64.0, pool_mb / 8));
  if (p2p_mb < 1 || staging_mb + p2p_mb > pool_mb) {
    throw std::runtime_error("ce_overlap: CE_OVERLAP_P2P_MB=" + std::to_string(p2p_mb) +
                             " must be at least 1, and CE_OVERLAP_STAGING_MB + CE_OVERLAP_P2P_MB at most "
                             "CE_OVERLAP_POOL_MB=" + std::to_string(pool_mb));
  }
  GroupConfig c;
  c.staging_bytes = static_cast<size_t>(staging_mb * 1024 * 1024);
  c.p2p_bytes = static_cast<size_t>(p2p_mb * 1024 * 1024);
  c.user_bytes = static_cast<size_t>(pool_mb * 1024 * 1024) - c.staging_bytes - c.p2p_bytes;
  c.timeout_s = env_double("CE_OVERLAP_TIMEOUT_S", 60);
  const double ctas = env_double("CE_OVERLAP_REDUCE_SMS", 32);
  if (ctas != std::floor(ctas) || ctas > 1024) {
    throw std::runtime_error("ce_overlap: CE_OVERLAP_REDUCE_SMS=" + std::to_string(ctas) +
                             " must be a whole number of CTAs in 1..1024");
  }
  c.reduce_ctas = static_cast<int>(ctas);
  const double round_mb = std::min(env_double("CE_OVERLAP_RS_ROUND_MB", 32), 1048576.0);
  c.rs_round_bytes = std::max<size_t>(kPoolAlignment, static_cast<size_t>(round_mb * 1024 * 1024) / kPoolAlignment * kPoolAlignment);
  const double split = env_double("CE_OVERLAP_PULL_SPLIT", 1);
  if (split != std::floor(split) || split > kMaxPullSplit) {
    throw std::runtime_error("ce_overlap: CE_OVERLAP_PULL_SPLIT=" + std::to_string(split) + " must be a whole number in 1.." +
                             std::to_string(kMaxPullSplit));
  }
  c.pull_split = static_cast<int>(split);
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
  signal_waits(&flags->ready[peer], epoch, sig, ops);
  batch_mem_ops(comm_, ops, "group '" + name_ + "': waiting for rank " + std::to_string(peer) + " (epoch " +
                                std::to_string(epoch) + ")");
}

void Group::post_done(int peer) {
  FlagsRegion* flags = pool_->local_flags();
  CE_CUDA_CHECK(cudaMemcpyAsync(&pool_->peer_flags(peer)->done[rank_], &flags->done_outbox, sizeof(uint32_t),
                                cudaMemcpyDeviceToDevice, comm_),
                "group '" + name_ + "': signalling done to rank " + std::to_string(peer));
}

void Group::pull_copy(char* dst, const char* src, size_t bytes, const std::string& what) {
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
  retire_completed_locked();
  pending_.push_back(std::move(op));
}

void Group::retire_completed_locked() {
  // Every op, not only the oldest: point-to-point ops run on their channels' streams and complete out of order.
  for (auto it = pending_.begin(); it != pending_.end();) {
    cudaError_t st = cudaEventQuery(it->end);
    if (st == cudaErrorNotReady) {
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

void Group::synchronize(double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (true) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (failed_.load()) throw std::runtime_error(error());
      retire_completed_locked();  // marks the group failed on a CUDA error
      if (failed_.load()) throw std::runtime_error(error());
      if (pending_.empty()) return;
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
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock()) {
    // An enqueue (or synchronize / describe, briefly) holds the lock. Never wait for it: a CUDA call
    // inside an enqueue can block until our own streams drain, and only this thread can drain them.
    check_stuck_enqueue(now);
    return;
  }
  if (!open_ || pending_.empty()) return;
  if (cudaSetDevice(device_) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  retire_completed_locked();
  if (pending_.empty()) return;
  // Every in-flight op is timed from the moment its stream reached it: collectives start one after the other
  // on the comm stream, point-to-point ops on their own channels' streams, so any of them may be the stuck one.
  for (PendingOp& op : pending_) {
    if (op.started) continue;
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
      poison();
      last_poison_ = now;
    }
    return;
  }
  for (PendingOp& op : pending_) {
    if (!op.started || now - *op.started <= std::chrono::duration<double>(timeout_s_)) continue;
    // Failed BEFORE poisoned: once the poison lands the op completes, and nobody may see it complete
    // without also seeing the failure.
    fail_locked(diagnose_timeout_locked(op, now));
    if (!poison()) append_error(" Releasing the stuck GPU stream failed too (the unblocking write did not complete in 2 s).");
    last_poison_ = now;
    return;
  }
}

void Group::append_error(const std::string& text) {
  std::lock_guard<std::mutex> lk(err_mu_);
  error_ += text;
}

void Group::check_stuck_enqueue(Clock::time_point now) {
  const int64_t since_ns = enqueue_since_ns_.load();
  if (since_ns == 0) return;
  const Clock::time_point since{std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(since_ns))};
  const double stuck_s = std::chrono::duration<double>(now - since).count();
  if (stuck_s <= timeout_s_) return;
  if (cudaSetDevice(device_) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (!failed_.load()) {
    std::ostringstream m;
    m << "ce_overlap: timeout: enqueueing an op on group '" << name_ << "' (rank " << rank_ << ", GPU " << device_
      << ") has been blocked inside a CUDA call for " << stuck_s << " s (limit " << timeout_s_
      << " s), most likely one that waits for the device to go idle while this group's comm stream waits for a peer"
      << " that never posts the matching signal (a peer that did not call the collective, or called a different"
      << " one). The group's flags were poisoned so its streams drain; the outputs of this op and of every later op"
      << " on this group are invalid, and the group refuses further ops (restart the job).";
    fail_locked(m.str());  // before the poison (see watchdog_tick)
    if (!poison()) append_error(" Releasing the stuck GPU stream failed too.");
    last_poison_ = now;
  } else if (now - last_poison_ > std::chrono::seconds(1)) {
    poison();
    last_poison_ = now;
  }
}

std::string Group::diagnose_timeout_locked(const PendingOp& op, Clock::time_point now) {
  std::ostringstream m;
  if (op.rounds.empty()) {
    return "ce_overlap: timeout: " + op.name + " #" + std::to_string(op.seq) + " on group '" + name_ + "' (rank " +
           std::to_string(rank_) + ", no peers) did not complete within " + std::to_string(timeout_s_) +
           " s: the local copy or reduction is stuck.";
  }
  const double waited = std::chrono::duration<double>(now - *op.started).count();
  m << "ce_overlap: timeout: " << op.name << " #" << op.seq;
  if (op.peer >= 0) {
    m << (op.kind == OpKind::Send ? " to rank " : " from rank ") << op.peer << " (" << op.nbytes_per_rank << " bytes, "
      << variant_name(static_cast<uint32_t>(op.variant)) << ", " << op.rounds.size() << " round(s), channel rounds ";
  } else {
    m << " (" << op.nbytes_per_rank << " bytes per rank, " << variant_name(static_cast<uint32_t>(op.variant)) << ", "
      << op.rounds.size() << " round(s), epochs ";
  }
  m << op.rounds.front().epoch << ".." << op.rounds.back().epoch << ") on group '" << name_ << "' did not complete within "
    << timeout_s_ << " s (waited " << waited << " s) on rank " << rank_ << " (GPU " << device_ << ").";

  bool readable = cudaMemcpyAsync(host_flags_, pool_->local_flags(), sizeof(FlagsRegion), cudaMemcpyDeviceToHost,
                                  watchdog_stream_) == cudaSuccess &&
                  wait_stream_bounded(watchdog_stream_, 2.0);
  if (!readable) {
    (void)cudaGetLastError();
    m << " The flags could not be read back (the GPU does not respond), so the peers cannot be named.";
  } else if (op.peer >= 0) {
    m << " " << diagnose_p2p(op);
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
            PeerSignal ours{r.epoch, r.sig.sig_a, r.sig.sig_b, kind_round_word(op.kind, op.variant, r.round), r.nbytes,
                            r.offset};
            why = "it posted a different collective for epoch " + std::to_string(r.epoch) + ": " + signal_text(got) +
                  ", while this rank posted " + signal_text(ours) +
                  " -- mismatched sizes, dtypes or reduce ops, a symmetric tensor on one rank only, push on one rank"
                  " and pull on another, or ops called in a different order";
            break;
          }
          if (!epoch_ge(got.epoch, r.epoch)) {
            why = "it stopped after epoch " + std::to_string(got.epoch) + " and never signalled round " +
                  std::to_string(r.round) + " (epoch " + std::to_string(r.epoch) + ")";
            break;
          }
          if (op.push_style && !epoch_ge(done, r.epoch)) {
            why = "it signalled round " + std::to_string(r.round) + " (epoch " + std::to_string(r.epoch) +
                  ") but never finished writing its data into this rank (its done flag is at epoch " +
                  std::to_string(done) + ")";
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

std::string Group::diagnose_p2p(const PendingOp& op) const {
  const bool send = op.kind == OpKind::Send;
  const PeerSignal& got = send ? host_flags_->p2p_credit[op.peer] : host_flags_->p2p_landed[op.peer];
  const std::string who = "Rank " + std::to_string(op.peer);
  for (const RoundInfo& r : op.rounds) {
    const OpKind ours_kind = send ? OpKind::Send : OpKind::Recv;
    PeerSignal ours{r.epoch, r.sig.sig_a, r.sig.sig_b, kind_round_word(ours_kind, op.variant, r.round), r.nbytes, r.offset};
    if (!epoch_ge(got.epoch, r.epoch)) {
      std::string last = got.epoch == 0 ? "none" : "round " + std::to_string(got.epoch) + ": " + signal_text(got);
      return "Peer ranks whose flags never arrived: [" + std::to_string(op.peer) + "]. " + who +
             (send ? " has not posted the matching receive for channel round " : " has not sent channel round ") +
             std::to_string(r.epoch) + " (message round " + std::to_string(r.round) + ") of this message (its last " +
             (send ? "receive credit" : "landed signal") + ": " + last + ") -- it has not called " +
             (send ? "recv" : "send") + " (or batch_isend_irecv) for this message, called fewer, or is stuck before it.";
    }
    if (got.epoch == r.epoch && ((got.sig_a & r.sig.sig_a) == 0 || (got.sig_b & r.sig.sig_b) == 0)) {
      return "Peer ranks whose flags never arrived: [" + std::to_string(op.peer) + "]. " + who +
             " posted a different message for channel round " + std::to_string(r.epoch) + ": " + signal_text(got) +
             ", while this rank posted " + signal_text(ours) +
             " -- mismatched sizes, a symmetric tensor on one side only, or sends and receives matched in a different "
             "order.";
    }
  }
  return "Every signal of rank " + std::to_string(op.peer) + " has arrived; the stream is stuck elsewhere (a local "
         "copy or the copy engine).";
}

void Group::fail_locked(const std::string& message) {
  {
    std::lock_guard<std::mutex> lk(err_mu_);
    if (failed_.load()) return;
    error_ = message;
    failed_.store(true);
  }
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
}

bool Group::poison() {
  // Epoch values "far in the future" (cyclically) satisfy every GEQ wait of every enqueued op; the
  // all-ones signature satisfies every AND wait. Only the peer-written arrays are overwritten. Reads
  // only immutable state, epoch_hint_ and p2p_hint_, so it works while an enqueue holds the group lock (an op
  // enqueued after this write waits for epochs far below the poison, so it drains too).
  const uint32_t poison_epoch = epoch_hint_.load() + (1u << 29);
  const uint32_t poison_round = p2p_hint_.load() + (1u << 29);  // point-to-point channels count their own rounds
  for (int p = 0; p < world_size_; ++p) {
    host_poison_->ready[p] = PeerSignal{poison_epoch, 0xffffffffu, 0xffffffffu, 0, 0, 0};
    host_poison_->done[p] = poison_epoch;
    host_poison_->p2p_credit[p] = PeerSignal{poison_round, 0xffffffffu, 0xffffffffu, 0, 0, 0};
    host_poison_->p2p_landed[p] = PeerSignal{poison_round, 0xffffffffu, 0xffffffffu, 0, 0, 0};
  }
  const size_t bytes = offsetof(FlagsRegion, ready_outbox);
  if (cudaMemcpyAsync(pool_->local_flags(), host_poison_, bytes, cudaMemcpyHostToDevice, watchdog_stream_) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return wait_stream_bounded(watchdog_stream_, 2.0);
}

std::string Group::error() const {
  std::lock_guard<std::mutex> lk(err_mu_);
  return error_;
}

std::string Group::describe() {
  std::lock_guard<std::mutex> lk(mu_);
  std::ostringstream s;
  s << pool_->describe() << "; open=" << open_ << " ops=" << op_seq_ << " next_epoch=" << epoch_next_
    << " in_flight=" << pending_.size() << " timeout_s=" << timeout_s_ << " local_copy=" << local_copy_mode()
    << " pull_split=" << pull_split_.load() << " reduce_ctas=" << reduce_ctas_.load()
    << " rs_round_bytes=" << rs_round_bytes_.load() << " failed=" << failed_.load();
  return s.str();
}

// ---------------------------------------------------------------------------------------------------
// Runtime

Runtime& Runtime::get() {
  static Runtime* runtime = new Runtime();
  return *runtime;
}

std::shared_ptr<Group> Runtime::create_group(const std::string& name, int rank, int world_size, int device) {
  auto exists = [&] {
    throw std::runtime_error("ce_overlap: group '" + name + "' already has a symmetric pool on this process");
  };
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (groups_.count(name) || creating_.count(name)) exists();
    creating_.insert(name);
  }
  // Built without mu_: the constructor makes CUDA calls that can wait for the device (allocation, loading
  // the reduction kernels), and the watchdog thread, which takes mu_ every tick, must stay free to release
  // another group's stuck stream meanwhile.
  std::shared_ptr<Group> group;
  try {
    const GroupConfig config = GroupConfig::from_env();
    group = std::make_shared<Group>(name, rank, world_size, device, config);
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu_);
    creating_.erase(name);
    throw;
  }
  std::lock_guard<std::mutex> lk(mu_);
  creating_.erase(name);
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

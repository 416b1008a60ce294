// Symmetric pool: allocation, CUDA IPC export/import, the P2P check, and the user-region allocator.
// Also the CUDA error helpers and driver entry points declared in cuda_util.h.
#include "symmetric_pool.h"

#include "cuda_util.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <sstream>

namespace ce_overlap {

// ---------------------------------------------------------------------------------------------------
// cuda_util.h

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line,
                      const std::string& context) {
  // Clears a non-sticky error so it does not resurface in an unrelated later call (torch's or ours).
  (void)cudaGetLastError();
  std::ostringstream msg;
  msg << "ce_overlap: " << context << ": " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err)
      << ") from " << expr << " at " << file << ":" << line;
  throw std::runtime_error(msg.str());
}

void throw_cu_error(CUresult err, const char* expr, const char* file, int line,
                    const std::string& context) {
  const char* text = "unknown CUresult";
  const DriverApi& api = driver_api();
  if (api.get_error_string) api.get_error_string(err, &text);
  std::ostringstream msg;
  msg << "ce_overlap: " << context << ": CUresult " << static_cast<int>(err) << " (" << text
      << ") from " << expr << " at " << file << ":" << line;
  throw std::runtime_error(msg.str());
}

namespace {

void* resolve_driver_symbol(const char* name, bool required) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || fn == nullptr) {
    (void)cudaGetLastError();
    if (!required) return nullptr;
    std::ostringstream msg;
    msg << "ce_overlap: the CUDA driver does not provide " << name << " (cudaGetDriverEntryPointByVersion: "
        << cudaGetErrorName(err) << ", query status " << static_cast<int>(status)
        << "); the CE runtime needs a CUDA 12+ driver with stream memory operations";
    throw std::runtime_error(msg.str());
  }
  return fn;
}

}  // namespace

const DriverApi& driver_api() {
  static DriverApi api;
  static std::once_flag once;
  static std::string failure;
  std::call_once(once, [] {
    try {
      api.get_error_string = reinterpret_cast<decltype(api.get_error_string)>(
          resolve_driver_symbol("cuGetErrorString", false));
      api.stream_wait_value32 = reinterpret_cast<decltype(api.stream_wait_value32)>(
          resolve_driver_symbol("cuStreamWaitValue32", true));
      api.stream_write_value32 = reinterpret_cast<decltype(api.stream_write_value32)>(
          resolve_driver_symbol("cuStreamWriteValue32", true));
      api.stream_batch_mem_op = reinterpret_cast<decltype(api.stream_batch_mem_op)>(
          resolve_driver_symbol("cuStreamBatchMemOp", true));
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) throw std::runtime_error(failure);
  return api;
}

std::string pci_bus_id(int device) {
  char buf[32] = {0};
  if (cudaDeviceGetPCIBusId(buf, sizeof(buf), device) != cudaSuccess) {
    (void)cudaGetLastError();
    return "unknown";
  }
  return buf;
}

namespace {

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

std::string mib(size_t bytes) {
  std::ostringstream s;
  s << (bytes >> 20) << " MiB";
  return s.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// RangeAllocator

RangeAllocator::RangeAllocator(size_t capacity) : capacity_(capacity / kPoolAlignment * kPoolAlignment) {
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

size_t RangeAllocator::footprint(size_t bytes) { return align_up(std::max<size_t>(bytes, 1), kPoolAlignment); }

std::optional<size_t> RangeAllocator::allocate(size_t bytes) {
  const size_t need = footprint(bytes);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const size_t offset = it->first;
    const size_t rest = it->second - need;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + need, rest);
    used_.emplace(offset, need);
    return offset;
  }
  return std::nullopt;
}

void RangeAllocator::allocate_at(size_t offset, size_t bytes) {
  const size_t need = footprint(bytes);
  auto fail = [&](const std::string& why) {
    throw std::runtime_error("ce_overlap: symmetric pool range [" + std::to_string(offset) + ", " +
                             std::to_string(offset + need) + ") of the user region cannot be allocated: " + why);
  };
  if (offset % kPoolAlignment != 0) fail("offset not aligned to " + std::to_string(kPoolAlignment) + " bytes");
  if (offset > capacity_ || need > capacity_ - offset) fail("beyond the region's " + std::to_string(capacity_) + " bytes");
  // The free range that contains `offset`: the last one starting at or before it.
  auto it = free_.upper_bound(offset);
  if (it == free_.begin()) fail("not free on this rank");
  --it;
  const size_t start = it->first, size = it->second;
  if (offset + need > start + size) fail("not free on this rank");
  free_.erase(it);
  if (offset > start) free_.emplace(start, offset - start);
  if (start + size > offset + need) free_.emplace(offset + need, start + size - (offset + need));
  used_.emplace(offset, need);
}

std::vector<std::pair<size_t, size_t>> RangeAllocator::free_ranges() const {
  return std::vector<std::pair<size_t, size_t>>(free_.begin(), free_.end());
}

void RangeAllocator::free(size_t offset, size_t bytes) {
  auto it = used_.find(offset);
  const size_t need = footprint(bytes);
  if (it == used_.end() || it->second != need) {
    throw std::runtime_error("ce_overlap: symmetric pool free of offset " + std::to_string(offset) + " (" +
                             std::to_string(bytes) + " bytes) that was not allocated (double free?)");
  }
  used_.erase(it);
  size_t start = offset, size = need;
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first == start + size) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(start, size);
}

size_t RangeAllocator::free_bytes() const {
  size_t total = 0;
  for (const auto& [off, size] : free_) total += size;
  return total;
}

size_t RangeAllocator::largest_free() const {
  size_t best = 0;
  for (const auto& [off, size] : free_) best = std::max(best, size);
  return best;
}

int64_t RangeAllocator::self_test(uint64_t seed, int64_t steps) {
  // Model: a bitmap of alignment units. First-fit must return the lowest start of a free run that is
  // long enough, and the free list must always equal the bitmap's free runs, coalesced.
  std::mt19937_64 rng(seed);
  const size_t units = 256;
  RangeAllocator alloc(units * kPoolAlignment);
  std::vector<bool> used(units, false);
  std::vector<std::pair<size_t, size_t>> live;  // (offset, requested bytes)
  int64_t checks = 0;
  auto fail = [&](const std::string& what) {
    throw std::runtime_error("ce_overlap: RangeAllocator self-test (seed " + std::to_string(seed) + ") failed: " + what);
  };
  for (int64_t step = 0; step < steps; ++step) {
    const bool do_alloc = live.empty() || (rng() % 100) < 55;
    if (do_alloc && rng() % 4 == 0) {
      // allocate_at: a random aligned range; must succeed exactly when the model says it is free.
      const size_t req = 1 + rng() % (kPoolAlignment * 20);
      const size_t need_units = align_up(req, kPoolAlignment) / kPoolAlignment;
      const size_t start = rng() % units;
      bool free_in_model = start + need_units <= units;
      for (size_t u = start; free_in_model && u < start + need_units; ++u) free_in_model = !used[u];
      bool ok = true;
      try {
        alloc.allocate_at(start * kPoolAlignment, req);
      } catch (const std::runtime_error&) {
        ok = false;
      }
      if (ok != free_in_model) {
        fail("allocate_at(" + std::to_string(start * kPoolAlignment) + ", " + std::to_string(req) + ") " +
             (ok ? "succeeded on a used range" : "refused a free range"));
      }
      if (ok) {
        for (size_t u = start; u < start + need_units; ++u) used[u] = true;
        live.emplace_back(start * kPoolAlignment, req);
      }
    } else if (do_alloc) {
      const size_t req = 1 + rng() % (kPoolAlignment * 40);
      const size_t need_units = align_up(req, kPoolAlignment) / kPoolAlignment;
      std::optional<size_t> expect;
      for (size_t s = 0, run = 0; s < units; ++s) {
        run = used[s] ? 0 : run + 1;
        if (run == need_units) {
          expect = (s + 1 - need_units) * kPoolAlignment;
          break;
        }
      }
      const std::optional<size_t> got = alloc.allocate(req);
      if (got != expect) {
        fail("allocate(" + std::to_string(req) + ") returned " + (got ? std::to_string(*got) : "none") +
             ", first fit is " + (expect ? std::to_string(*expect) : "none"));
      }
      if (got) {
        for (size_t u = *got / kPoolAlignment; u < *got / kPoolAlignment + need_units; ++u) used[u] = true;
        live.emplace_back(*got, req);
      }
    } else {
      const size_t idx = rng() % live.size();
      const auto [off, req] = live[idx];
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(idx));
      alloc.free(off, req);
      const size_t need_units = align_up(req, kPoolAlignment) / kPoolAlignment;
      for (size_t u = off / kPoolAlignment; u < off / kPoolAlignment + need_units; ++u) used[u] = false;
    }
    // Free list == maximal free runs of the model.
    std::map<size_t, size_t> runs;
    for (size_t s = 0; s < units;) {
      if (used[s]) {
        ++s;
        continue;
      }
      size_t e = s;
      while (e < units && !used[e]) ++e;
      runs.emplace(s * kPoolAlignment, (e - s) * kPoolAlignment);
      s = e;
    }
    if (runs != alloc.free_) fail("free list is not the coalesced free runs after step " + std::to_string(step));
    if (alloc.free_ranges() != std::vector<std::pair<size_t, size_t>>(runs.begin(), runs.end())) {
      fail("free_ranges() differs from the free list after step " + std::to_string(step));
    }
    ++checks;
  }
  // A double free must be refused.
  if (!live.empty()) {
    alloc.free(live[0].first, live[0].second);
    bool refused = false;
    try {
      alloc.free(live[0].first, live[0].second);
    } catch (const std::runtime_error&) {
      refused = true;
    }
    if (!refused) fail("a double free was accepted");
    ++checks;
  }
  return checks;
}

// ---------------------------------------------------------------------------------------------------
// SymmetricPool

SymmetricPool::SymmetricPool(std::string group_name, int rank, int world_size, int device, size_t user_bytes,
                             size_t staging_bytes, size_t p2p_bytes)
    : group_name_(std::move(group_name)),
      rank_(rank),
      world_size_(world_size),
      device_(device),
      user_bytes_(align_up(user_bytes, kPoolAlignment)),
      staging_bytes_(align_up(staging_bytes, kPoolAlignment)),
      p2p_bytes_(align_up(p2p_bytes, kPoolAlignment)),
      total_bytes_(kFlagsBytes + user_bytes_ + staging_bytes_ + p2p_bytes_),
      peer_bases_(static_cast<size_t>(world_size), nullptr),
      user_alloc_(user_bytes_) {
  if (world_size < 1 || world_size > kMaxRanks) {
    throw std::runtime_error("ce_overlap: group '" + group_name_ + "' has " + std::to_string(world_size) +
                             " ranks; the CE runtime supports 1.." + std::to_string(kMaxRanks));
  }
  if (rank < 0 || rank >= world_size) {
    throw std::runtime_error("ce_overlap: rank " + std::to_string(rank) + " is outside group '" + group_name_ +
                             "' of size " + std::to_string(world_size));
  }
  const std::string ctx = "allocating the symmetric pool of group '" + group_name_ + "' (" + mib(total_bytes_) +
                          " on GPU " + std::to_string(device) + ", rank " + std::to_string(rank) + ")";
  DeviceScope scope(device);
  void* base = nullptr;
  CE_CUDA_CHECK(cudaMalloc(&base, total_bytes_), ctx + "; lower RuntimeConfig.pool_mb (CE_OVERLAP_POOL_MB)");
  local_base_ = static_cast<char*>(base);
  try {
    // Peers only ever write flags with values > 0, and every wait expects >= 1: zero means "nothing yet".
    // On a private non-blocking stream, waiting for that stream only: a device-wide synchronize here would
    // also wait for every other group's comm stream, one of which may wait for a peer until the watchdog
    // releases it (creating a group after another group's op got stuck must not hang).
    cudaStream_t s = nullptr;
    CE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), ctx);
    cudaError_t err = cudaMemsetAsync(local_base_, 0, kFlagsBytes, s);
    if (err == cudaSuccess) err = cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    CE_CUDA_CHECK(err, ctx);
  } catch (...) {
    cudaFree(local_base_);
    local_base_ = nullptr;
    throw;
  }
  peer_bases_[static_cast<size_t>(rank)] = local_base_;
}

SymmetricPool::~SymmetricPool() {
  int saved = 0;
  if (cudaGetDevice(&saved) != cudaSuccess) return;  // CUDA already torn down: nothing safe to do
  cudaSetDevice(device_);
  for (auto& d : deferred_) {
    for (cudaEvent_t e : d.ready) cudaEventDestroy(e);
  }
  for (int p = 0; p < world_size_; ++p) {
    if (p != rank_ && peer_bases_[static_cast<size_t>(p)] != nullptr) cudaIpcCloseMemHandle(peer_bases_[static_cast<size_t>(p)]);
  }
  if (local_base_) cudaFree(local_base_);
  (void)cudaGetLastError();
  cudaSetDevice(saved);
}

PoolHandleBlob SymmetricPool::export_blob(const std::string& node) const {
  PoolHandleBlob blob;
  std::memset(&blob, 0, sizeof(blob));
  blob.magic = kPoolBlobMagic;
  blob.version = kPoolBlobVersion;
  blob.rank = rank_;
  blob.world_size = world_size_;
  blob.device = device_;
  blob.pid = static_cast<int32_t>(getpid());
  blob.total_bytes = total_bytes_;
  blob.user_bytes = user_bytes_;
  blob.staging_bytes = staging_bytes_;
  blob.p2p_bytes = p2p_bytes_;
  std::strncpy(blob.pci_bus_id, pci_bus_id(device_).c_str(), sizeof(blob.pci_bus_id) - 1);
  if (node.empty()) {
    gethostname(blob.hostname, sizeof(blob.hostname) - 1);
  } else {
    std::strncpy(blob.hostname, node.c_str(), sizeof(blob.hostname) - 1);
  }
  DeviceScope scope(device_);
  CE_CUDA_CHECK(cudaIpcGetMemHandle(&blob.handle, local_base_),
                "exporting the symmetric pool of group '" + group_name_ + "' with cudaIpcGetMemHandle");
  return blob;
}

void SymmetricPool::open_peers(const std::vector<PoolHandleBlob>& blobs, bool refuse_p2p) {
  const std::string g = "group '" + group_name_ + "'";
  if (open_) throw std::runtime_error("ce_overlap: " + g + " is already rendezvoused");
  if (static_cast<int>(blobs.size()) != world_size_) {
    throw std::runtime_error("ce_overlap: rendezvous of " + g + " got " + std::to_string(blobs.size()) +
                             " pool handles for " + std::to_string(world_size_) + " ranks");
  }
  auto who = [&](int r) {
    const PoolHandleBlob& b = blobs[static_cast<size_t>(r)];
    return "rank " + std::to_string(r) + " (GPU " + std::to_string(b.device) + ", " + b.pci_bus_id + ", " +
           std::string(b.hostname) + ")";
  };
  for (int r = 0; r < world_size_; ++r) {
    const PoolHandleBlob& b = blobs[static_cast<size_t>(r)];
    if (b.magic != kPoolBlobMagic || b.version != kPoolBlobVersion) {
      throw std::runtime_error("ce_overlap: rendezvous of " + g + ": the handle of rank " + std::to_string(r) +
                               " is not a ce_overlap pool handle of version " + std::to_string(kPoolBlobVersion) +
                               " (a different ce_overlap build on that rank?)");
    }
    if (b.rank != r || b.world_size != world_size_) {
      throw std::runtime_error("ce_overlap: rendezvous of " + g + ": slot " + std::to_string(r) +
                               " holds the handle of rank " + std::to_string(b.rank) + " of " +
                               std::to_string(b.world_size) + " ranks; expected rank " + std::to_string(r) +
                               " of " + std::to_string(world_size_));
    }
    if (b.user_bytes != user_bytes_ || b.staging_bytes != staging_bytes_ || b.p2p_bytes != p2p_bytes_) {
      throw std::runtime_error("ce_overlap: rendezvous of " + g + ": " + who(r) + " has a pool of " +
                               mib(b.user_bytes) + " user + " + mib(b.staging_bytes) + " staging + " +
                               mib(b.p2p_bytes) + " p2p, rank " + std::to_string(rank_) + " has " + mib(user_bytes_) +
                               " + " + mib(staging_bytes_) + " + " + mib(p2p_bytes_) +
                               "; give every rank the same RuntimeConfig pool_mb / staging_mb / p2p_mb (environment "
                               "CE_OVERLAP_POOL_MB / CE_OVERLAP_STAGING_MB / CE_OVERLAP_P2P_MB)");
    }
    if (std::strncmp(b.hostname, blobs[0].hostname, sizeof(b.hostname)) != 0) {
      throw std::runtime_error("ce_overlap: " + g + " spans nodes: " + who(0) + " and " + who(r) +
                               "; copy-engine collectives need every rank on one host (one NVLink domain): keep "
                               "this group on NCCL");
    }
  }
  // Every ordered pair must be P2P-capable: each rank reads every peer's pool and writes every peer's
  // flags. Pairs whose GPUs this process cannot see are left to cudaIpcOpenMemHandle to refuse.
  std::vector<int> local_ordinal(static_cast<size_t>(world_size_), -1);
  for (int r = 0; r < world_size_; ++r) {
    int ord = -1;
    if (cudaDeviceGetByPCIBusId(&ord, blobs[static_cast<size_t>(r)].pci_bus_id) == cudaSuccess) {
      local_ordinal[static_cast<size_t>(r)] = ord;
    } else {
      (void)cudaGetLastError();
    }
  }
  for (int a = 0; a < world_size_; ++a) {
    for (int b = 0; b < world_size_; ++b) {
      const int da = local_ordinal[static_cast<size_t>(a)], db = local_ordinal[static_cast<size_t>(b)];
      if (a == b || da < 0 || db < 0) continue;
      if (da == db && !refuse_p2p) continue;  // same GPU shared by two ranks: IPC is local
      int can = 0;
      if (!refuse_p2p) CE_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, da, db), "checking P2P access for " + g);
      if (!can) {
        const char* why = refuse_p2p ? " (simulated: RuntimeConfig.fault_inject=p2p_refused)"
                                     : " (cudaDeviceCanAccessPeer is false)";
        throw std::runtime_error("ce_overlap: " + g + " is not fully P2P-connected: " + who(a) + " cannot access " +
                                 who(b) + why + "; keep this group on NCCL");
      }
    }
  }
  DeviceScope scope(device_);
  for (int p = 0; p < world_size_; ++p) {
    if (p == rank_) continue;
    void* ptr = nullptr;
    cudaError_t err =
        cudaIpcOpenMemHandle(&ptr, blobs[static_cast<size_t>(p)].handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      for (int q = 0; q < p; ++q) {
        if (q != rank_ && peer_bases_[static_cast<size_t>(q)]) {
          cudaIpcCloseMemHandle(peer_bases_[static_cast<size_t>(q)]);
          peer_bases_[static_cast<size_t>(q)] = nullptr;
        }
      }
      throw std::runtime_error("ce_overlap: " + g + ": " + who(rank_) + " cannot map the pool of " + who(p) +
                               " with cudaIpcOpenMemHandle: " + cudaGetErrorName(err) + " (" +
                               cudaGetErrorString(err) +
                               "); the GPUs must be P2P-connected and the processes on one host");
    }
    peer_bases_[static_cast<size_t>(p)] = static_cast<char*>(ptr);
  }
  open_ = true;
}

std::optional<size_t> SymmetricPool::user_region_offset(const void* ptr, size_t bytes) const {
  const char* p = static_cast<const char*>(ptr);
  const char* lo = local_base_ + user_offset();
  const char* hi = lo + user_bytes_;
  if (p < lo || p > hi || bytes > static_cast<size_t>(hi - p)) return std::nullopt;
  return static_cast<size_t>(p - local_base_);
}

bool SymmetricPool::contains(const void* ptr) const {
  const char* p = static_cast<const char*>(ptr);
  return p >= local_base_ && p < local_base_ + total_bytes_;
}

void SymmetricPool::reclaim_deferred(bool block) {
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    bool pending = false;
    for (cudaEvent_t e : it->ready) {
      cudaError_t st = block ? cudaEventSynchronize(e) : cudaEventQuery(e);
      if (st == cudaErrorNotReady) pending = true;
    }
    // An error other than NotReady means a broken context; the range is unusable either way.
    (void)cudaGetLastError();
    if (pending) {
      ++it;
      continue;
    }
    for (cudaEvent_t e : it->ready) cudaEventDestroy(e);
    user_alloc_.free(it->offset, it->bytes);
    it = deferred_.erase(it);
  }
}

void SymmetricPool::free_user(size_t offset, size_t bytes, std::vector<cudaEvent_t> ready) {
  deferred_.push_back(DeferredFree{offset - user_offset(), bytes, std::move(ready)});
}

std::vector<std::pair<size_t, size_t>> SymmetricPool::free_user_ranges(bool block, size_t* pending_bytes) {
  reclaim_deferred(block);
  if (pending_bytes) {
    *pending_bytes = 0;
    for (const DeferredFree& d : deferred_) *pending_bytes += RangeAllocator::footprint(d.bytes);
  }
  std::vector<std::pair<size_t, size_t>> out = user_alloc_.free_ranges();
  for (auto& r : out) r.first += user_offset();
  return out;
}

void SymmetricPool::allocate_user_at(size_t pool_offset, size_t bytes) {
  if (pool_offset < user_offset()) {
    throw std::runtime_error("ce_overlap: group '" + group_name_ + "': pool offset " + std::to_string(pool_offset) +
                             " lies before the user region (which starts at " + std::to_string(user_offset()) + ")");
  }
  try {
    user_alloc_.allocate_at(pool_offset - user_offset(), bytes);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error("ce_overlap: group '" + group_name_ + "' rank " + std::to_string(rank_) + ": " + e.what() +
                             " (pool offset " + std::to_string(pool_offset) + ", " + std::to_string(bytes) + " bytes)");
  }
}

std::string SymmetricPool::describe() const {
  std::ostringstream s;
  s << "group '" << group_name_ << "' rank " << rank_ << "/" << world_size_ << " on GPU " << device_ << " ("
    << pci_bus_id(device_) << "): pool " << mib(total_bytes_) << " = user " << mib(user_bytes_) << " ("
    << user_alloc_.free_bytes() << " bytes free) + staging " << mib(staging_bytes_) << " + p2p " << mib(p2p_bytes_);
  return s.str();
}

}  // namespace ce_overlap

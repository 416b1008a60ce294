// The symmetric pool of one process group: one cudaMalloc'd region per rank, exported with CUDA IPC and
// mapped into every peer, so rank r can address byte `off` of rank p's pool as peer_base(p) + off.
// Layout of every rank's region (identical on all ranks, which is what makes it "symmetric"):
//
//   [0, kFlagsBytes)                          FlagsRegion: signals written by peers (see group.h)
//   [kFlagsBytes, +user_bytes)                user region: tensors from empty_symmetric (zero-copy)
//   [kFlagsBytes + user_bytes, +staging_bytes) staging region: inputs that are not in the pool
//   [... + staging_bytes, +p2p_bytes)         p2p landing region: one slot per sender, 2 banks each (p2p.cc)
//
// No torch here; the handle exchange itself goes through the group's c10d store in Python, which
// passes the gathered blobs back to open_peers().
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ce_overlap {

constexpr int kMaxRanks = 128;
constexpr size_t kFlagsBytes = 64 * 1024;
// Offsets handed out by the user-region allocator; 512 B keeps copy-engine transfers aligned.
constexpr size_t kPoolAlignment = 512;

// What one rank tells a peer about one round of a collective. The peer waits on `epoch` (and `sig_bits`);
// the other fields are only read when a timeout is diagnosed ("rank 1 posted 4096 bytes, we expect
// 8192"). Written into the peer's FlagsRegion as one 32-byte copy.
struct alignas(32) PeerSignal {
  uint32_t epoch;
  // Signature of what the sender posted: a hash of (kind, sizes, round, offset) folded into two one-hot
  // words (one bit out of 31 each, so two different ops collide with probability 1/961). Bit 31 of
  // each is the poison bit set by the watchdog.
  uint32_t sig_a;
  uint32_t sig_b;
  uint32_t kind_round;  // OpKind << 24 | round (diagnostics)
  uint64_t nbytes;      // bytes of this round
  uint64_t offset;      // pool offset the peer should read this round's bytes from
};
static_assert(sizeof(PeerSignal) == 32, "PeerSignal is copied as 32 bytes");

// Lives at offset 0 of every rank's pool. Entries indexed by a peer rank p are written only by p
// (remotely, with a cudaMemcpyAsync); the outboxes are written only locally (stream memory ops) and
// are the sources of those remote copies.
//
// Collectives (group-wide epochs, comm stream) use ready[] / done[]; point-to-point channels (their own round
// numbers and streams, p2p.cc) use p2p_credit[] / p2p_landed[]. Everything a peer writes comes first, so the
// watchdog's unblocking write (group.cc, poison) is one copy of [0, offsetof(ready_outbox)).
struct FlagsRegion {
  PeerSignal ready[kMaxRanks];  // ready[p]: p's shard for ready[p].epoch is readable in p's pool
  uint32_t done[kMaxRanks];     // done[p]: p finished reading our pool for every epoch <= done[p]
  // p2p_credit[p]: receiver p accepts round .epoch of our message to it (a landing bank is free, or, direct,
  // its tensor may be written). p2p_landed[p]: round .epoch of sender p's message to us is in our pool.
  PeerSignal p2p_credit[kMaxRanks];
  PeerSignal p2p_landed[kMaxRanks];
  PeerSignal ready_outbox;      // source of our ready[] writes into peers
  uint32_t done_outbox;         // source of our done[] writes into peers
  PeerSignal p2p_credit_outbox[kMaxRanks];  // source of our p2p_credit[] write into peer p (its receive stream)
  PeerSignal p2p_landed_outbox[kMaxRanks];  // source of our p2p_landed[] write into peer p (its send stream)
};
static_assert(sizeof(FlagsRegion) <= kFlagsBytes, "flags must fit in kFlagsBytes");

// Published by every rank through the store. Fixed-size POD: Python treats it as opaque bytes.
struct PoolHandleBlob {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  int32_t world_size;
  int32_t device;  // CUDA ordinal in the publishing process (diagnostics only: ordinals differ per process)
  int32_t pid;
  uint64_t total_bytes;
  uint64_t user_bytes;
  uint64_t staging_bytes;
  uint64_t p2p_bytes;
  char pci_bus_id[32];  // identifies the GPU across processes
  char hostname[64];  // the node (the hostname, or the node the caller named: a simulated one)
  cudaIpcMemHandle_t handle;
};
constexpr uint32_t kPoolBlobMagic = 0x43454f50;  // "CEOP"
constexpr uint32_t kPoolBlobVersion = 2;  // 2: the p2p landing region

// First-fit allocator over [0, capacity) with coalescing frees. Pure host bookkeeping. Ranks do NOT rely on
// their allocators agreeing (frees land at different times on different ranks): empty_symmetric publishes
// free_ranges() of every rank through the store, intersects them and allocates the agreed offset with
// allocate_at() (python/ce_overlap/runtime/_symalloc.py).
class RangeAllocator {
 public:
  explicit RangeAllocator(size_t capacity = 0);
  // Bytes a request of `bytes` occupies: rounded up to kPoolAlignment, at least one unit (so every tensor,
  // 0-byte ones included, has a distinct offset).
  static size_t footprint(size_t bytes);
  std::optional<size_t> allocate(size_t bytes);  // first fit; nullopt when no free range fits
  // Allocates exactly [offset, offset + footprint(bytes)); throws (naming the range) unless it is free and
  // offset is aligned.
  void allocate_at(size_t offset, size_t bytes);
  void free(size_t offset, size_t bytes);        // throws on a double or foreign free
  size_t capacity() const { return capacity_; }
  size_t free_bytes() const;
  size_t largest_free() const;
  // The free ranges (offset, size), ascending, coalesced.
  std::vector<std::pair<size_t, size_t>> free_ranges() const;
  // Runs randomized allocate/free sequences against a brute-force model; throws on the first
  // disagreement. Exposed as an op so CPU-only CI checks it.
  static int64_t self_test(uint64_t seed, int64_t steps);

 private:
  size_t capacity_;
  std::map<size_t, size_t> free_;  // offset -> size, never adjacent (always coalesced)
  std::map<size_t, size_t> used_;  // offset -> size
};

class SymmetricPool {
 public:
  // Allocates and zeroes the local region on `device` (the calling thread's device is switched).
  SymmetricPool(std::string group_name, int rank, int world_size, int device, size_t user_bytes,
                size_t staging_bytes, size_t p2p_bytes);
  ~SymmetricPool();
  SymmetricPool(const SymmetricPool&) = delete;
  SymmetricPool& operator=(const SymmetricPool&) = delete;

  // `node`: the node this rank is on as ce_overlap.nodes sees it (its hostname, or a simulated node); "" for the
  // hostname. Ranks whose nodes differ are refused by open_peers.
  PoolHandleBlob export_blob(const std::string& node = "") const;
  // Validates every rank's blob (same host, sizes, world size; every pair P2P-capable), then opens the
  // peers' regions. Throws with a message naming the group, ranks and GPUs on any problem.
  // refuse_p2p (fault injection): every pair of ranks is treated as GPUs without peer access.
  void open_peers(const std::vector<PoolHandleBlob>& blobs, bool refuse_p2p = false);
  bool is_open() const { return open_; }

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }
  const std::string& group_name() const { return group_name_; }
  size_t total_bytes() const { return total_bytes_; }
  size_t user_bytes() const { return user_bytes_; }
  size_t staging_bytes() const { return staging_bytes_; }
  size_t p2p_bytes() const { return p2p_bytes_; }
  size_t user_offset() const { return kFlagsBytes; }
  size_t staging_offset() const { return kFlagsBytes + user_bytes_; }
  size_t p2p_offset() const { return kFlagsBytes + user_bytes_ + staging_bytes_; }

  char* local_base() const { return local_base_; }
  char* peer_base(int peer) const { return peer_bases_.at(peer); }  // == local_base() for our rank
  FlagsRegion* local_flags() const { return reinterpret_cast<FlagsRegion*>(local_base_); }
  FlagsRegion* peer_flags(int peer) const { return reinterpret_cast<FlagsRegion*>(peer_base(peer)); }

  // Pool offset of [ptr, ptr + bytes) when it lies entirely inside the local user region.
  std::optional<size_t> user_region_offset(const void* ptr, size_t bytes) const;
  bool contains(const void* ptr) const;

  // User-region allocation for empty_symmetric, which is collective: every rank publishes
  // free_user_ranges() through the store, all ranks intersect them and take the same first fit, and each
  // allocates it with allocate_user_at() (python/ce_overlap/runtime/_symalloc.py). Ranks' free lists may
  // differ (frees land at different times), the agreed offset never does.
  // Frees are deferred until every event in `ready` (one per stream that may still touch the range) has
  // completed, so a reused range is never written while an earlier op still reads it. The pool owns (and
  // destroys) the events.
  void free_user(size_t offset, size_t bytes, std::vector<cudaEvent_t> ready);
  // The user region's free ranges as POOL offsets (offset, size), after reclaiming the deferred frees whose
  // events completed (all of them, waiting in cudaEventSynchronize, when `block`: callers that hold the
  // group lock must not block). `pending_bytes` gets the bytes still deferred.
  std::vector<std::pair<size_t, size_t>> free_user_ranges(bool block, size_t* pending_bytes);
  // Allocates [pool_offset, pool_offset + footprint(bytes)) in the user region; throws unless free here.
  void allocate_user_at(size_t pool_offset, size_t bytes);

  std::string describe() const;

 private:
  void reclaim_deferred(bool block);

  std::string group_name_;
  int rank_;
  int world_size_;
  int device_;
  size_t user_bytes_;
  size_t staging_bytes_;
  size_t p2p_bytes_;
  size_t total_bytes_;
  char* local_base_ = nullptr;
  std::vector<char*> peer_bases_;
  bool open_ = false;
  RangeAllocator user_alloc_;
  struct DeferredFree {
    size_t offset;
    size_t bytes;
    std::vector<cudaEvent_t> ready;
  };
  std::vector<DeferredFree> deferred_;
};

// The PCI bus id of a CUDA device ("0000:1B:00.0"), used to name GPUs across processes.
std::string pci_bus_id(int device);

}  // namespace ce_overlap

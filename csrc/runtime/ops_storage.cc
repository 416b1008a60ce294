// Storage for gathered parameters (ce_overlap.fsdp's direct path), ops of TORCH_LIBRARY(ce_overlap):
//   _block_acquire(nbytes, device) -> a uint8 block from a cache of device blocks, reused in stream order: the
//     current stream waits (on the GPU, cudaStreamWaitEvent) for the event recorded when the block was last
//     released; the host never waits. A block is allocated (caching allocator) only when none of that size is free.
//   _storage_lease(dsts, block, offsets) -> points each dst's storage (FSDP2's all-gather output of a parameter,
//     whose unsharded parameter is a view of it) at block + offset: the copy engines then gather straight into the
//     parameter, with no copy-out. The storage keeps its allocator, so FSDP2's own resize_(0) at reshard releases
//     it; when every storage of a lease has been released (or re-leased, or destroyed), the block goes back to the
//     cache with an event recorded on the stream current at that moment (FSDP2 reshards on the stream that used the
//     parameters, after their last use was enqueued).
//   _block_cache_info() -> [free blocks, leased blocks, bytes held]; _block_cache_clear() drops the free blocks
//     (after their release events: the GPU may still be reading them).
// Why not the caching allocator: a block freed on one stream is reused on that stream at once, but the all-gather
// writes the next parameters from another stream while the compute stream may still read the previous ones;
// recordStream makes the allocator poll events from the host, so a host running ahead of the GPU (FSDP2 never
// synchronizes) holds every block of its run-ahead window. FSDP2 avoids that for its own all-gather buffers with
// an event its all-gather streams wait on; this cache does the same for the parameters.
#include "torch_common.h"

#include <ATen/ops/empty.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

namespace ce_overlap {
namespace {

class BlockCache {
 public:
  static BlockCache& get() {
    static BlockCache* cache = new BlockCache();  // never destroyed: leases may be released during exit
    return *cache;
  }

  at::Tensor acquire(int64_t nbytes, int device) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
    c10::Storage storage;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find({device, nbytes});
      if (it != free_.end() && !it->second.empty()) {
        Free f = std::move(it->second.front());
        it->second.pop_front();
        // The wait snapshots the event, which can then be reused.
        CE_CUDA_CHECK(cudaStreamWaitEvent(stream, f.released, 0), "ce_overlap._block_acquire: waiting for the block");
        spare_[device].push_back(f.released);
        storage = std::move(f.storage);
        ++leased_;
      }
    }
    if (!storage) {
      at::Tensor t = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
      storage = t.storage();
      std::lock_guard<std::mutex> lock(mu_);
      ++blocks_;
      ++leased_;
      bytes_ += nbytes;
    }
    return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device))
        .set_(storage, 0, {nbytes}, {1});
  }

  // Called when the last storage of a lease lets go of `storage` (any thread; no exception escapes).
  void release(c10::Storage storage, int device) noexcept {
    try {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
      std::lock_guard<std::mutex> lock(mu_);
      cudaEvent_t ev = nullptr;
      auto& spare = spare_[device];
      if (!spare.empty()) {
        ev = spare.back();
        spare.pop_back();
      } else if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
        --leased_;  // CUDA is gone (process exit): the block is dropped
        --blocks_;
        bytes_ -= static_cast<int64_t>(storage.nbytes());
        return;
      }
      if (cudaEventRecord(ev, stream) != cudaSuccess) {
        spare.push_back(ev);
        --leased_;
        --blocks_;
        bytes_ -= static_cast<int64_t>(storage.nbytes());
        return;
      }
      const int64_t nbytes = static_cast<int64_t>(storage.nbytes());
      free_[{device, nbytes}].push_back(Free{std::move(storage), ev});
      --leased_;
    } catch (...) {
    }
  }

  std::vector<int64_t> info() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t free_blocks = 0;
    for (const auto& kv : free_) free_blocks += static_cast<int64_t>(kv.second.size());
    return {free_blocks, leased_, bytes_};
  }

  void clear() {
    std::map<std::pair<int, int64_t>, std::deque<Free>> dropped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dropped.swap(free_);
    }
    for (auto& kv : dropped) {
      for (Free& f : kv.second) {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(kv.first.first));
        CE_CUDA_CHECK(cudaEventSynchronize(f.released), "ce_overlap._block_cache_clear");
        CE_CUDA_CHECK(cudaEventDestroy(f.released), "ce_overlap._block_cache_clear");
        std::lock_guard<std::mutex> lock(mu_);
        --blocks_;
        bytes_ -= kv.first.second;
      }
    }
  }

 private:
  struct Free {
    c10::Storage storage;
    cudaEvent_t released;
  };
  std::mutex mu_;
  std::map<std::pair<int, int64_t>, std::deque<Free>> free_;  // (device, bytes) -> oldest release first
  std::map<int, std::vector<cudaEvent_t>> spare_;
  int64_t blocks_ = 0;
  int64_t leased_ = 0;
  int64_t bytes_ = 0;
};

// One block lent to the storages of one _storage_lease call; back to the cache when the last of them lets go.
struct Lease {
  c10::Storage block;
  int device;
  Lease(c10::Storage b, int d) : block(std::move(b)), device(d) {}
  ~Lease() { BlockCache::get().release(std::move(block), device); }
};

struct LeaseRef {
  std::shared_ptr<Lease> lease;
};

void drop_lease_ref(void* ctx) { delete static_cast<LeaseRef*>(ctx); }

at::Tensor block_acquire(int64_t nbytes, c10::Device device) {
  TORCH_CHECK(nbytes > 0, "ce_overlap._block_acquire: nbytes must be > 0, got ", nbytes);
  TORCH_CHECK(device.is_cuda() && device.has_index(), "ce_overlap._block_acquire: needs a CUDA device with an index, "
              "got ", device);
  return BlockCache::get().acquire(nbytes, device.index());
}

void storage_lease(at::TensorList dsts, const at::Tensor& block, c10::IntArrayRef offsets) {
  static const char* kOp = "ce_overlap._storage_lease";
  TORCH_CHECK(dsts.size() == offsets.size(), kOp, ": ", dsts.size(), " tensors but ", offsets.size(), " offsets");
  TORCH_CHECK(block.is_cuda() && block.scalar_type() == at::kByte && block.dim() == 1 && block.is_contiguous() &&
                  block.storage_offset() == 0,
              kOp, ": block must be a 1-D contiguous uint8 CUDA tensor from _block_acquire");
  const int64_t block_bytes = block.numel();
  std::set<const c10::StorageImpl*> seen;
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& t = dsts[i];
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    TORCH_CHECK(t.is_cuda() && t.device() == block.device(), kOp, ": tensor ", i, " is on ", t.device(),
                ", the block on ", block.device());
    TORCH_CHECK(t.is_contiguous() && t.storage_offset() == 0, kOp, ": tensor ", i, " must be contiguous and start its "
                "storage (an all-gather output, not a view into one)");
    TORCH_CHECK(t.storage().unsafeGetStorageImpl()->resizable(), kOp, ": tensor ", i, "'s storage is not resizable "
                "(FSDP2 frees its all-gather outputs by resize_(0); a fixed storage would never give the block back)");
    TORCH_CHECK(seen.insert(t.storage().unsafeGetStorageImpl()).second, kOp, ": tensor ", i, " shares a storage with "
                "an earlier one");
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] % 16 == 0 && offsets[i] + nbytes <= block_bytes, kOp, ": offset ",
                offsets[i], " of tensor ", i, " (", nbytes, " bytes) must be a multiple of 16 inside the block of ",
                block_bytes, " bytes");
  }
  auto lease = std::make_shared<Lease>(block.storage(), static_cast<int>(block.device().index()));
  char* base = static_cast<char*>(block.data_ptr());
  for (size_t i = 0; i < dsts.size(); ++i) {
    c10::StorageImpl* impl = dsts[i].storage().unsafeGetStorageImpl();
    const size_t nbytes = static_cast<size_t>(dsts[i].numel()) * dsts[i].element_size();
    at::DataPtr previous = impl->set_data_ptr(
        c10::DataPtr(base + offsets[i], new LeaseRef{lease}, &drop_lease_ref, block.device()));
    impl->set_nbytes(nbytes);
    // `previous` (the storage's earlier memory: an allocator block, or an older lease) is released here.
  }
}

std::vector<int64_t> block_cache_info() { return BlockCache::get().info(); }

void block_cache_clear() { BlockCache::get().clear(); }

}  // namespace
}  // namespace ce_overlap

TORCH_LIBRARY_FRAGMENT(ce_overlap, m) {
  m.def("_block_acquire(int nbytes, Device device) -> Tensor", &ce_overlap::block_acquire);
  m.def("_storage_lease(Tensor(a!)[] dsts, Tensor block, int[] offsets) -> ()", &ce_overlap::storage_lease);
  m.def("_block_cache_info() -> int[]", &ce_overlap::block_cache_info);
  m.def("_block_cache_clear() -> ()", &ce_overlap::block_cache_clear);
}

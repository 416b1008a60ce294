// Copies within one GPU (self shards, staging): cudaMemcpyBatchAsync with the copy-engine hint, falling back to
// cudaMemcpyAsync (see local_copy_async in group.h).
#include "group.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

namespace ce_overlap {

namespace {

std::mutex g_local_copy_mu;
std::string g_local_copy_fallback;  // why the batch API was given up, empty while it works
bool g_local_copy_batch_used = false;

std::atomic<bool> g_local_copy_hint{true};  // RuntimeConfig.local_copy: "ce" (true) or "memcpy"

bool local_copy_wants_hint() { return g_local_copy_hint.load(); }

cudaError_t batch_copy(void* dst, const void* src, size_t bytes, int device, bool hint, cudaStream_t stream) {
  void* dsts[1] = {dst};
  const void* srcs[1] = {src};
  size_t sizes[1] = {bytes};
  return batch_copies(dsts, srcs, sizes, 1, device, hint, stream);
}

}  // namespace

#if CUDART_VERSION >= 12080
// Valid arguments, per the CUDA 12.8 / 13.0 headers: srcAccessOrder Stream (every source is read in stream order,
// after the work before it), location hints naming this device (they only matter for managed / pageable memory,
// ignored otherwise), one attribute for every copy (attrsIdxs = {0}, numAttrs = 1 <= count), and a stream that is not
// the legacy NULL stream. CUDA 12.x takes a failIdx out-parameter (removed in 13.0).
cudaError_t batch_copies(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count, int device,
                         bool hint, cudaStream_t stream) {
  if (is_legacy_stream(stream) || count == 0) return cudaErrorInvalidValue;
  cudaMemcpyAttributes attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.srcLocHint.type = cudaMemLocationTypeDevice;
  attr.srcLocHint.id = device;
  attr.dstLocHint.type = cudaMemLocationTypeDevice;
  attr.dstLocHint.id = device;
  attr.flags = hint ? cudaMemcpyFlagPreferOverlapWithCompute : cudaMemcpyFlagDefault;
  size_t attr_idx[1] = {0};
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, attr_idx, 1, stream);
#else
  size_t fail_idx = 0;
  return cudaMemcpyBatchAsync(const_cast<void**>(dsts), const_cast<void**>(srcs), const_cast<size_t*>(sizes), count,
                              &attr, attr_idx, 1, &fail_idx, stream);  // CUDA 12.x: non-const pointers
#endif
}
#else
cudaError_t batch_copies(void* const*, const void* const*, const size_t*, size_t, int, bool, cudaStream_t) {
  return cudaErrorNotSupported;
}
#endif

void set_local_copy_hint(bool hint) { g_local_copy_hint.store(hint); }

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

}  // namespace ce_overlap

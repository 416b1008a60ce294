// The reduce-scatter reduction kernel (reduce_kernels.cu): sums this rank's chunk and the n-1 chunks the
// peers pushed into its staging slots, in fp32, and writes the output (in the inputs' dtype, or in fp32). The only SM work of the runtime;
// its CTA count is bounded (RuntimeConfig.reduce_sms). Also the copy pacer of a rate-limited group (one thread that
// only waits). No torch here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace ce_overlap {

enum class ReduceDType : int { F32 = 0, F16 = 1, BF16 = 2 };
enum class ReduceOp : int { Sum = 0, Avg = 1 };

size_t reduce_elem_size(ReduceDType dtype);
const char* reduce_dtype_name(ReduceDType dtype);
const char* reduce_op_name(ReduceOp op);

struct ReduceParams {
  void* out;             // count elements (of the output dtype)
  const void* own;       // this rank's chunk, count elements (may equal `out`: in-place reduce-scatter)
  const void* slots;     // the peers' chunks: sender q's at slots + slot(q) * slot_stride, where
                         // slot(q) = q < rank ? q : q - 1 (n-1 slots, none for ourselves)
  size_t slot_stride;    // bytes, a multiple of 16
  size_t count;          // elements
  int nranks;
  int rank;
  ReduceOp op;
};

// Whether launch_reduce sums `in` inputs into an `out` output: the same dtype, or 16-bit inputs into fp32 (widening).
bool reduce_dtypes_supported(ReduceDType in, ReduceDType out);

// Enqueues out = sum_q chunk_q (rank order, fp32 accumulation; avg: times float(1 / nranks)) on `stream`, with at
// most max_ctas CTAs of 512 threads (16-byte vector loads when the inputs are 16-byte aligned and `out` is aligned
// to one output pack). The inputs are of `dtype`, the output of `out_dtype` (reduce_dtypes_supported; else
// cudaErrorInvalidValue). Returns the launch error (cudaSuccess for count == 0, which launches nothing).
cudaError_t launch_reduce(ReduceDType dtype, ReduceDType out_dtype, const ReduceParams& p, int max_ctas,
                          cudaStream_t stream);

// Loads every instantiation of the reduction kernel (cudaFuncGetAttributes plus one empty launch each on
// `stream`; the caller synchronizes it). Called when a group is created: under lazy module loading a
// kernel's first launch may wait for the device to go idle, which must not happen inside an enqueue.
cudaError_t preload_reduce_kernels(cudaStream_t stream);

// The copy pacer: holds `stream` until the GPU's global timer reaches *last + interval_ns (at once when behind or on
// first use, *last == 0), then sets *last to that time. One thread, no data moved (Group::peer_copy). Preloaded with
// the reduction kernels.
cudaError_t launch_pace(unsigned long long* last, unsigned long long interval_ns, cudaStream_t stream);

}  // namespace ce_overlap

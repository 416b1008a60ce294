// The reduce-scatter reduction kernel (reduce_kernels.cu): sums this rank's chunk and the n-1 chunks the
// peers pushed into its staging slots, in fp32, and writes the output. The only SM work of the runtime;
// its CTA count is bounded (RuntimeConfig.reduce_sms). No torch here.
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
  void* out;             // count elements
  const void* own;       // this rank's chunk, count elements (may equal `out`: in-place reduce-scatter)
  const void* slots;     // the peers' chunks: sender q's at slots + slot(q) * slot_stride, where
                         // slot(q) = q < rank ? q : q - 1 (n-1 slots, none for ourselves)
  size_t slot_stride;    // bytes, a multiple of 16
  size_t count;          // elements
  int nranks;
  int rank;
  ReduceOp op;
};

// Enqueues out = sum_q chunk_q (rank order, fp32 accumulation; avg: times float(1 / nranks)) on `stream`, with at
// most max_ctas CTAs of 512 threads (16-byte vector accesses when `out` and `own` are 16-byte aligned).
// Returns the launch error (cudaSuccess for count == 0, which launches nothing).
cudaError_t launch_reduce(ReduceDType dtype, const ReduceParams& p, int max_ctas, cudaStream_t stream);

// Loads every instantiation of the reduction kernel (cudaFuncGetAttributes plus one empty launch each on
// `stream`; the caller synchronizes it). Called when a group is created: under lazy module loading a
// kernel's first launch may wait for the device to go idle, which must not happen inside an enqueue.
cudaError_t preload_reduce_kernels(cudaStream_t stream);

}  // namespace ce_overlap

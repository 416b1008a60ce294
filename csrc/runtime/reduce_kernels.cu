// Reduction kernel of the CE reduce-scatter (see reduce_kernels.h). Memory-bound: each element reads n
// inputs and writes one output, so a few CTAs with 16-byte accesses and several loads in flight per
// thread reach a large share of HBM bandwidth while leaving the other SMs to compute.
#include "reduce_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace ce_overlap {

namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // independent vector loads in flight per thread and input (generic kernel)
// Groups of up to kMaxSpecialized ranks get a kernel with the rank count known at compile time: every input's
// loads are issued before the first add. The generic loop over a runtime rank count reached 36-40 GB/s per CTA on
// H200 against 82-96 GB/s for the specialized one (bf16, 2 ranks, 8-32 CTAs; bench/results/runtime-2026-11-23-
// shared-gpu), so the same CTA budget moved 2.3x less. Loads in flight per thread stay ~8 whatever the count.
constexpr int kMaxSpecialized = 8;
template <int NR>
inline constexpr int kUnrollFor = NR >= 8 ? 1 : 8 / NR;

template <typename T>
struct Cvt;
template <>
struct Cvt<float> {
  static __device__ __forceinline__ float to(float v) { return v; }
  static __device__ __forceinline__ float from(float v) { return v; }
};
template <>
struct Cvt<__half> {
  static __device__ __forceinline__ float to(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from(float v) { return __float2half_rn(v); }
};
template <>
struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ float to(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
};

// VEC elements accessed as one aligned load/store (16 bytes for the vector path, one element otherwise).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Loads one pack. 16-byte packs use ld.global.cs (evict-first, "streaming"): every input byte is read
// exactly once, so it should not push the compute beside it (a GEMM's tiles) out of L2.
template <typename P>
__device__ __forceinline__ P load_pack(const P* src) {
  if constexpr (sizeof(P) == 16 && alignof(P) == 16) {
    const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(src));
    P v;
    memcpy(&v, &raw, sizeof(P));
    return v;
  } else {
    return *src;
  }
}

template <typename T>
__device__ __forceinline__ const T* input_of(const ReduceParams& p, int q) {
  if (q == p.rank) return static_cast<const T*>(p.own);
  const int slot = q < p.rank ? q : q - 1;
  return reinterpret_cast<const T*>(static_cast<const char*>(p.slots) + static_cast<size_t>(slot) * p.slot_stride);
}

// avg: the fp32 sum times the fp32 reciprocal of the rank count, which is what Inductor emits for the pass's
// consumer-side mean (on GPUs it lowers a division by a constant to a multiplication by its reciprocal). A true
// division rounds differently for rank counts that are not powers of two (1 ulp in a few elements at 3 ranks).
template <typename T>
__device__ __forceinline__ float finish(const ReduceParams& p, float acc) {
  return p.op == ReduceOp::Avg ? acc * (1.0f / static_cast<float>(p.nranks)) : acc;
}

// Block 0 of either kernel does the count % VEC tail elements, one per thread.
template <typename T, typename TO, int VEC>
__device__ __forceinline__ void reduce_tail(const ReduceParams& p) {
  if (VEC > 1 && blockIdx.x == 0) {
    const size_t npacks = p.count / VEC;
    const size_t tail = p.count - npacks * VEC;
    if (threadIdx.x < tail) {
      const size_t i = npacks * VEC + threadIdx.x;
      float acc = 0.f;
      for (int q = 0; q < p.nranks; ++q) acc += Cvt<T>::to(input_of<T>(p, q)[i]);
      static_cast<TO*>(p.out)[i] = Cvt<TO>::from(finish<T>(p, acc));
    }
  }
}

// NR ranks known at compile time (p.nranks == NR): grid-stride loop over packs of VEC elements, each thread
// issuing all NR x kUnrollFor<NR> loads before its first add. Summation order is rank order (0 + x_0 + ... +
// x_{n-1}, in fp32), as in the generic kernel: both give bit-identical results. TO is the output's element type:
// T itself, or float for a widening reduction (16-bit inputs summed into an fp32 output, as FSDP2's fp32
// reduce_dtype asks for: the same fp32 sum of the same values as casting every input to fp32 first).
template <typename T, typename TO, int VEC, int NR>
__global__ void __launch_bounds__(kThreads) reduce_kernel_nr(const ReduceParams p) {
  using P = Pack<T, VEC>;
  using PO = Pack<TO, VEC>;
  constexpr int U = kUnrollFor<NR>;
  const size_t npacks = p.count / VEC;
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads * U;
  PO* out = static_cast<PO*>(p.out);
  const P* src[NR];
#pragma unroll
  for (int q = 0; q < NR; ++q) src[q] = reinterpret_cast<const P*>(input_of<T>(p, q));
  for (size_t base = static_cast<size_t>(blockIdx.x) * kThreads * U + threadIdx.x; base < npacks; base += stride) {
    P v[NR][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = base + static_cast<size_t>(u) * kThreads;
      if (i < npacks) {
#pragma unroll
        for (int q = 0; q < NR; ++q) v[q][u] = load_pack(src[q] + i);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = base + static_cast<size_t>(u) * kThreads;
      if (i < npacks) {
        PO o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          float acc = 0.f;
#pragma unroll
          for (int q = 0; q < NR; ++q) acc += Cvt<T>::to(v[q][u].v[j]);
          o.v[j] = Cvt<TO>::from(finish<T>(p, acc));
        }
        out[i] = o;
      }
    }
  }
  reduce_tail<T, TO, VEC>(p);
}

// Any rank count (groups larger than kMaxSpecialized, and the unaligned scalar path): grid-stride loop over
// packs of VEC elements, inputs two at a time. Summation order is rank order (q = 0..n-1) on every rank and for
// every element.
template <typename T, typename TO, int VEC>
__global__ void __launch_bounds__(kThreads) reduce_kernel(const ReduceParams p) {
  using P = Pack<T, VEC>;
  using PO = Pack<TO, VEC>;
  const size_t npacks = p.count / VEC;
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads * kUnroll;
  PO* out = static_cast<PO*>(p.out);
  for (size_t base = static_cast<size_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x; base < npacks; base += stride) {
    float acc[kUnroll][VEC];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[u][j] = 0.f;
    }
    // Two inputs per step: all their loads are issued before the first add, so 2 * kUnroll vector loads per
    // thread are in flight (the kernel is latency-bound with few CTAs). Adds stay in rank order.
    for (int q = 0; q < p.nranks; q += 2) {
      const bool two = q + 1 < p.nranks;
      const P* src0 = reinterpret_cast<const P*>(input_of<T>(p, q));
      const P* src1 = two ? reinterpret_cast<const P*>(input_of<T>(p, q + 1)) : src0;
      P v0[kUnroll];
      P v1[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const size_t i = base + static_cast<size_t>(u) * kThreads;
        if (i < npacks) {
          v0[u] = load_pack(src0 + i);
          if (two) v1[u] = load_pack(src1 + i);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const size_t i = base + static_cast<size_t>(u) * kThreads;
        if (i < npacks) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc[u][j] += Cvt<T>::to(v0[u].v[j]);
          if (two) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[u][j] += Cvt<T>::to(v1[u].v[j]);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const size_t i = base + static_cast<size_t>(u) * kThreads;
      if (i < npacks) {
        PO o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = Cvt<TO>::from(finish<T>(p, acc[u][j]));
        out[i] = o;
      }
    }
  }
  reduce_tail<T, TO, VEC>(p);
}

unsigned grid_for(size_t npacks, int unroll, int max_ctas) {
  const size_t per_cta = static_cast<size_t>(kThreads) * unroll;
  const size_t wanted = std::max<size_t>(1, (npacks + per_cta - 1) / per_cta);
  return static_cast<unsigned>(std::min<size_t>(wanted, static_cast<size_t>(std::max(1, max_ctas))));
}

// The vector kernel for p.nranks ranks: specialized for 2..kMaxSpecialized (NR counts up from 2), else generic.
template <typename T, typename TO, int VEC, int NR = 2>
void launch_vector(const ReduceParams& p, int max_ctas, cudaStream_t stream) {
  if constexpr (NR <= kMaxSpecialized) {
    if (p.nranks == NR) {
      reduce_kernel_nr<T, TO, VEC, NR><<<grid_for(p.count / VEC, kUnrollFor<NR>, max_ctas), kThreads, 0, stream>>>(p);
    } else {
      launch_vector<T, TO, VEC, NR + 1>(p, max_ctas, stream);
    }
  } else {
    reduce_kernel<T, TO, VEC><<<grid_for(p.count / VEC, kUnroll, max_ctas), kThreads, 0, stream>>>(p);
  }
}

template <typename T, typename TO>
cudaError_t launch_typed(const ReduceParams& p, int max_ctas, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr uintptr_t kOutAlign = sizeof(TO) * kVec;  // one output pack (32 bytes when widening)
  const bool aligned = reinterpret_cast<uintptr_t>(p.out) % kOutAlign == 0 &&
                       reinterpret_cast<uintptr_t>(p.own) % 16 == 0 && reinterpret_cast<uintptr_t>(p.slots) % 16 == 0 &&
                       p.slot_stride % 16 == 0;
  if (aligned) {
    launch_vector<T, TO, kVec>(p, max_ctas, stream);
  } else {
    reduce_kernel<T, TO, 1><<<grid_for(p.count, kUnroll, max_ctas), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

// Loads one kernel: its attributes, then one empty launch (count 0: the body does nothing), so it is resident.
template <typename Kernel>
cudaError_t preload_one(Kernel kernel, cudaStream_t stream) {
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  ReduceParams p{nullptr, nullptr, nullptr, 16, 0, 1, 0, ReduceOp::Sum};
  kernel<<<1, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename TO, int NR = 2>
cudaError_t preload_specialized(cudaStream_t stream) {
  if constexpr (NR <= kMaxSpecialized) {
    cudaError_t err = preload_one(reduce_kernel_nr<T, TO, 16 / sizeof(T), NR>, stream);
    return err == cudaSuccess ? preload_specialized<T, TO, NR + 1>(stream) : err;
  } else {
    return cudaSuccess;
  }
}

template <typename T, typename TO>
cudaError_t preload_typed(cudaStream_t stream) {
  cudaError_t err = preload_one(reduce_kernel<T, TO, 16 / sizeof(T)>, stream);
  if (err == cudaSuccess) err = preload_one(reduce_kernel<T, TO, 1>, stream);
  if (err == cudaSuccess) err = preload_specialized<T, TO>(stream);
  return err;
}

}  // namespace

namespace {

// The copy pacer (Group::peer_copy with a copy rate): one thread holds the stream until `*last + interval_ns` of the
// GPU's global timer, then records that start time for the next chunk. Behind schedule (a copy slower than the rate)
// or on its first use it does not wait. It moves no data and signals nothing: it only spaces the copies out.
__global__ void pace_kernel(unsigned long long* last, unsigned long long interval_ns) {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  unsigned long long target = *last + interval_ns;
  if (*last == 0 || target < now) target = now;
  while (now < target) {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  }
  *last = target;
}

}  // namespace

cudaError_t launch_pace(unsigned long long* last, unsigned long long interval_ns, cudaStream_t stream) {
  pace_kernel<<<1, 1, 0, stream>>>(last, interval_ns);
  return cudaGetLastError();
}

cudaError_t preload_reduce_kernels(cudaStream_t stream) {
  cudaFuncAttributes attrs;
  cudaError_t err = cudaFuncGetAttributes(&attrs, pace_kernel);
  if (err != cudaSuccess) return err;
  err = preload_typed<float, float>(stream);
  if (err == cudaSuccess) err = preload_typed<__half, __half>(stream);
  if (err == cudaSuccess) err = preload_typed<__nv_bfloat16, __nv_bfloat16>(stream);
  if (err == cudaSuccess) err = preload_typed<__half, float>(stream);
  if (err == cudaSuccess) err = preload_typed<__nv_bfloat16, float>(stream);
  return err;
}

size_t reduce_elem_size(ReduceDType dtype) {
  switch (dtype) {
    case ReduceDType::F32:
      return 4;
    case ReduceDType::F16:
    case ReduceDType::BF16:
      return 2;
  }
  return 0;
}

const char* reduce_dtype_name(ReduceDType dtype) {
  switch (dtype) {
    case ReduceDType::F32:
      return "float32";
    case ReduceDType::F16:
      return "float16";
    case ReduceDType::BF16:
      return "bfloat16";
  }
  return "unknown dtype";
}

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::Avg ? "avg" : "sum"; }

bool reduce_dtypes_supported(ReduceDType in, ReduceDType out) {
  return in == out || (out == ReduceDType::F32 && (in == ReduceDType::F16 || in == ReduceDType::BF16));
}

cudaError_t launch_reduce(ReduceDType dtype, ReduceDType out_dtype, const ReduceParams& p, int max_ctas,
                          cudaStream_t stream) {
  if (!reduce_dtypes_supported(dtype, out_dtype)) return cudaErrorInvalidValue;
  if (p.count == 0) return cudaSuccess;
  const bool widen = dtype != out_dtype;
  switch (dtype) {
    case ReduceDType::F32:
      return launch_typed<float, float>(p, max_ctas, stream);
    case ReduceDType::F16:
      return widen ? launch_typed<__half, float>(p, max_ctas, stream) : launch_typed<__half, __half>(p, max_ctas, stream);
    case ReduceDType::BF16:
      return widen ? launch_typed<__nv_bfloat16, float>(p, max_ctas, stream)
                   : launch_typed<__nv_bfloat16, __nv_bfloat16>(p, max_ctas, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ce_overlap

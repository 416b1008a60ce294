// CUDA error checking and the few driver-API entry points the runtime uses (stream memory operations).
// No torch here: errors are std::runtime_error, which torch's op dispatcher turns into a Python
// RuntimeError with the same text.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace ce_overlap {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line,
                                   const std::string& context);
[[noreturn]] void throw_cu_error(CUresult err, const char* expr, const char* file, int line,
                                 const std::string& context);

// CE_CUDA_CHECK(expr, context): context is a std::string-convertible phrase naming what was being
// done ("rendezvous of group '0'"), so the message says more than "invalid argument".
#define CE_CUDA_CHECK(expr, context)                                                   \
  do {                                                                                 \
    cudaError_t ce_err_ = (expr);                                                      \
    if (ce_err_ != cudaSuccess) {                                                      \
      ::ce_overlap::throw_cuda_error(ce_err_, #expr, __FILE__, __LINE__, (context));   \
    }                                                                                  \
  } while (0)

#define CE_CU_CHECK(expr, context)                                                     \
  do {                                                                                 \
    CUresult ce_res_ = (expr);                                                         \
    if (ce_res_ != CUDA_SUCCESS) {                                                     \
      ::ce_overlap::throw_cu_error(ce_res_, #expr, __FILE__, __LINE__, (context));     \
    }                                                                                  \
  } while (0)

// Driver entry points, resolved once through cudaGetDriverEntryPointByVersion so the library never
// links libcuda (it must load on machines without a driver). Requesting the CUDA 12.0 ABI pins the
// _v2 stream-memop signatures, which CUDA 13 still serves.
struct DriverApi {
  CUresult (*stream_wait_value32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*stream_write_value32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*stream_batch_mem_op)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int) =
      nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
};

// Throws (naming the symbol) when the driver does not provide one of them.
const DriverApi& driver_api();

// Switches the calling thread's current device and restores it: torch code around us relies on it.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    CE_CUDA_CHECK(cudaGetDevice(&saved_), "reading the current CUDA device");
    if (saved_ != device) CE_CUDA_CHECK(cudaSetDevice(device), "selecting CUDA device " + std::to_string(device));
  }
  ~DeviceScope() { (void)cudaSetDevice(saved_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int saved_ = 0;
};

inline CUdeviceptr as_cu_ptr(const void* p) {
  return static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
}

}  // namespace ce_overlap

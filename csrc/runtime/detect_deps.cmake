# Finds what the CE runtime needs (a CUDA compiler and toolkit, a CUDA build of torch) without failing:
# sets CE_RUNTIME_DEPS_FOUND (TRUE/FALSE) and CE_RUNTIME_DEPS_WHY (the reason when FALSE), plus
# CE_TORCH_DIR, CE_TORCH_VERSION, CE_TORCH_CXX11_ABI for csrc/runtime/CMakeLists.txt.
#
# Why not find_package(Torch): TorchConfig.cmake drags in the legacy FindCUDA and the full CUDA math
# library set (cuBLAS, nvrtc, ...), overrides CMAKE_CUDA_ARCHITECTURES and stops the configure with a
# FATAL_ERROR when one is missing; the pip CUDA toolkits on our machines have no cuBLAS headers, so it
# fails there. The runtime needs only torch's headers and c10/c10_cuda/torch_cpu, which we take from
# the installed torch exactly as torch.utils.cpp_extension does. Included at file scope on purpose:
# enable_language() may not run inside a function.

set(CE_RUNTIME_DEPS_FOUND FALSE)
set(CE_RUNTIME_DEPS_WHY "")

# 1. A CUDA compiler. The runtime has no device code today (all data movement is copy engines), but
#    the reduce-scatter reduction kernel will, so the CUDA language is enabled here once.
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  set(CE_RUNTIME_DEPS_WHY "no CUDA compiler (nvcc) found; set CUDACXX or put nvcc on PATH")
  return()
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  # H100 / H200. Override with -DCMAKE_CUDA_ARCHITECTURES=... for other GPUs.
  set(CMAKE_CUDA_ARCHITECTURES 90)
endif()
enable_language(CUDA)
find_package(CUDAToolkit)
if(NOT CUDAToolkit_FOUND OR NOT TARGET CUDA::cudart)
  set(CE_RUNTIME_DEPS_WHY "nvcc found at ${CMAKE_CUDA_COMPILER} but not the CUDA toolkit (cudart)")
  return()
endif()

# 2. torch, asked through the same interpreter that builds the package.
if(DEFINED Python_EXECUTABLE)
  set(_ce_python "${Python_EXECUTABLE}")
elseif(DEFINED Python3_EXECUTABLE)
  set(_ce_python "${Python3_EXECUTABLE}")
else()
  find_program(_ce_python NAMES python3 python)
endif()
if(NOT _ce_python)
  set(CE_RUNTIME_DEPS_WHY "no Python interpreter found to locate torch")
  return()
endif()
execute_process(
  COMMAND "${_ce_python}" -c
    "import os, torch; print(os.path.dirname(torch.__file__)); print(torch.__version__); print(torch.version.cuda or ''); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  RESULT_VARIABLE _ce_rc
  OUTPUT_VARIABLE _ce_out
  ERROR_VARIABLE _ce_err
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _ce_rc EQUAL 0)
  string(STRIP "${_ce_err}" _ce_err)
  string(REGEX REPLACE ".*\n" "" _ce_err "${_ce_err}")
  set(CE_RUNTIME_DEPS_WHY "`${_ce_python} -c 'import torch'` failed: ${_ce_err}")
  return()
endif()
string(REPLACE "\n" ";" _ce_out "${_ce_out}")
list(GET _ce_out 0 CE_TORCH_DIR)
list(GET _ce_out 1 CE_TORCH_VERSION)
list(GET _ce_out 2 _ce_torch_cuda)
list(GET _ce_out 3 CE_TORCH_CXX11_ABI)
if(_ce_torch_cuda STREQUAL "")
  set(CE_RUNTIME_DEPS_WHY "torch ${CE_TORCH_VERSION} is a CPU-only build (torch.version.cuda is None)")
  return()
endif()
# libcudart is shared with torch's: a different CUDA major would load two runtimes into one process.
string(REGEX MATCH "^[0-9]+" _ce_torch_cuda_major "${_ce_torch_cuda}")
if(NOT _ce_torch_cuda_major STREQUAL CUDAToolkit_VERSION_MAJOR)
  set(CE_RUNTIME_DEPS_WHY
    "torch ${CE_TORCH_VERSION} is built for CUDA ${_ce_torch_cuda} but the toolkit is CUDA ${CUDAToolkit_VERSION}; the major versions must match")
  return()
endif()
foreach(_ce_lib c10 c10_cuda torch_cpu)
  if(NOT EXISTS "${CE_TORCH_DIR}/lib/lib${_ce_lib}.so")
    set(CE_RUNTIME_DEPS_WHY "torch at ${CE_TORCH_DIR} has no lib/lib${_ce_lib}.so")
    return()
  endif()
endforeach()

set(CE_RUNTIME_DEPS_FOUND TRUE)
message(STATUS "ce_overlap: CE runtime against torch ${CE_TORCH_VERSION} (CUDA ${_ce_torch_cuda}) at ${CE_TORCH_DIR}, "
               "CUDA toolkit ${CUDAToolkit_VERSION}, CUDA architectures ${CMAKE_CUDA_ARCHITECTURES}")

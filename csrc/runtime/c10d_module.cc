// ce_overlap._c10d: the Python face of the torch.distributed backend (c10d_backend.h). A pybind11 module built with
// torch's own pybind11 headers, so c10d::Backend objects pass between it and torch.distributed; it links
// _runtime.so, where the backend and the runtime live. Used by ce_overlap/distributed.py only.
#include "c10d_backend.h"

#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

PYBIND11_MODULE(_c10d, m) {
  m.doc() = "ce_overlap's torch.distributed backend (internal: use ce_overlap.distributed)";
  m.def(
      "make_backend",
      [](int rank, int size, const std::string& group_name, int device, c10::intrusive_ptr<c10d::Backend> inner,
         const std::string& ce_unavailable) {
        return ce_overlap::make_c10d_backend(rank, size, group_name, device, std::move(inner), ce_unavailable);
      },
      py::arg("rank"), py::arg("size"), py::arg("group_name"), py::arg("device"), py::arg("inner"),
      py::arg("ce_unavailable"),
      "The backend of group `group_name` (rendezvoused unless `ce_unavailable` says why not), delegating to `inner`.");
  m.def("counts", &ce_overlap::c10d_backend_counts, py::arg("backend"),
        "Per op, calls that ran on copy engines ('<op>:ce') and on the inner backend ('<op>:inner').");
  m.def("inner", &ce_overlap::c10d_backend_inner, py::arg("backend"), "The inner backend.");
}

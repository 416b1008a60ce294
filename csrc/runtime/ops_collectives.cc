// The collective ops of TORCH_LIBRARY(ce_overlap), the production op set (what the pass emits and
// ce_overlap.runtime calls): their CUDA kernels and their Meta kernels (so FakeTensor / torch.compile can trace
// them). Point-to-point ops: ops_p2p.cc; rendezvous, pool and process settings: ops_pool.cc (fragments of the same
// library). Test and benchmark hooks live in their own namespace, ce_overlap_testing (ops_testing.cc).
#include "torch_common.h"

#include <ATen/core/enum_tag.h>
#include <ATen/ops/empty.h>
#include <c10/core/SymBool.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

namespace ce_overlap {
namespace {

// The op's own copy rate (its copy_rate_gbps argument) for the copies it enqueues; a bad value names the op.
Group::OpCopyRate op_copy_rate(double gbps, const char* op) {
  TORCH_CHECK(std::isfinite(gbps) && gbps >= 0, "ce_overlap.", op, ": copy_rate_gbps must be a finite number >= 0 "
              "(GB/s; 0: the group's RuntimeConfig.copy_rate_gbps), got ", gbps);
  return Group::OpCopyRate(gbps);
}

// ---------------------------------------------------------------------------------------------------
// All-gather

at::Tensor all_gather_cuda(const at::Tensor& input, int64_t group_size, std::string group_name, double copy_rate_gbps) {
  check_input(input, group_size, "all_gather_into_tensor");
  std::shared_ptr<Group> g = group_for(group_name, group_size, input, "all_gather_into_tensor");
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes[0] *= group_size;
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty(sizes, input.options());
  const Group::OpCopyRate rate = op_copy_rate(copy_rate_gbps, "all_gather_into_tensor");
  run_all_gather(*g, input, out, Join::Functional);
  return out;
}

void all_gather_out_cuda(const at::Tensor& input, int64_t group_size, std::string group_name, at::Tensor out) {
  check_input(input, group_size, "all_gather_into_tensor_out");
  check_out(input, out, group_size, "all_gather_into_tensor_out");
  std::shared_ptr<Group> g = group_for(group_name, group_size, input, "all_gather_into_tensor_out");
  run_all_gather(*g, input, out, Join::Now);
}

at::Tensor all_gather_meta(const at::Tensor& input, int64_t group_size, std::string group_name, double copy_rate_gbps) {
  (void)group_name;
  (void)copy_rate_gbps;
  check_input(input, group_size, "all_gather_into_tensor");
  std::vector<c10::SymInt> sizes = input.sym_sizes().vec();
  sizes[0] = sizes[0] * group_size;
  return at::empty_symint(sizes, input.options());
}

void all_gather_out_meta(const at::Tensor& input, int64_t group_size, std::string group_name, at::Tensor out) {
  (void)group_name;
  check_input(input, group_size, "all_gather_into_tensor_out");
  check_out(input, out, group_size, "all_gather_into_tensor_out");
}

// all_gather_into_tensors: several tensors gathered as one op (a bucket without a bucket buffer). Output i is what
// all_gather_into_tensor(inputs[i]) returns.
std::vector<at::Tensor> all_gather_tensors_cuda(at::TensorList inputs, int64_t group_size, std::string group_name,
                                                double copy_rate_gbps) {
  static const char* kOp = "all_gather_into_tensors";
  check_ag_parts(inputs, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, inputs[0], kOp);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(g->device()));
  std::vector<at::Tensor> outs;
  for (const at::Tensor& input : inputs) {
    std::vector<int64_t> sizes = input.sizes().vec();
    sizes[0] *= group_size;
    outs.push_back(at::empty(sizes, input.options()));
  }
  const Group::OpCopyRate rate = op_copy_rate(copy_rate_gbps, kOp);
  run_all_gather_parts(*g, inputs.vec(), outs, Join::Functional);
  return outs;
}

std::vector<at::Tensor> all_gather_tensors_meta(at::TensorList inputs, int64_t group_size, std::string group_name,
                                                double copy_rate_gbps) {
  (void)group_name;
  (void)copy_rate_gbps;
  check_ag_parts(inputs, group_size, "all_gather_into_tensors");
  std::vector<at::Tensor> outs;
  for (const at::Tensor& input : inputs) {
    std::vector<c10::SymInt> sizes = input.sym_sizes().vec();
    sizes[0] = sizes[0] * group_size;
    outs.push_back(at::empty_symint(sizes, input.options()));
  }
  return outs;
}

// all_gather_into_tensors_out: the same op into given outputs (outs[i] holds group_size * inputs[i].numel()
// elements of its dtype), joined on the current stream before it returns. ce_overlap.fsdp gathers FSDP2's
// parameters straight into their unsharded storages with it: the inputs are one symmetric slot (every shard cast
// into it back to back, the same offset on every rank), so peers pull each part in place.
void check_ag_parts_out(at::TensorList inputs, at::TensorList outs, int64_t group_size, const char* op) {
  check_ag_parts(inputs, group_size, op);
  TORCH_CHECK(outs.size() == inputs.size(), "ce_overlap.", op, ": ", inputs.size(), " inputs but ", outs.size(),
              " outs (one out per input)");
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_out_like_input(inputs[i], outs[i], op);
    TORCH_CHECK(outs[i].sym_numel() == inputs[i].sym_numel() * group_size, "ce_overlap.", op, ": outs[", i, "] has ",
                outs[i].sym_numel(), " elements; it needs group_size * inputs[", i, "].numel() = ", group_size, " * ",
                inputs[i].sym_numel());
  }
}

void all_gather_tensors_out_cuda(at::TensorList inputs, int64_t group_size, std::string group_name,
                                 at::TensorList outs) {
  static const char* kOp = "all_gather_into_tensors_out";
  check_ag_parts_out(inputs, outs, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, inputs[0], kOp);
  run_all_gather_parts(*g, inputs.vec(), outs.vec(), Join::Now);
}

void all_gather_tensors_out_meta(at::TensorList inputs, int64_t group_size, std::string group_name,
                                 at::TensorList outs) {
  (void)group_name;
  check_ag_parts_out(inputs, outs, group_size, "all_gather_into_tensors_out");
}

// ---------------------------------------------------------------------------------------------------
// Reduce-scatter

at::Tensor reduce_scatter_cuda(const at::Tensor& input, std::string reduce_op, int64_t group_size, std::string group_name,
                               double copy_rate_gbps) {
  static const char* kOp = "reduce_scatter_tensor";
  check_rs_input(input, reduce_op, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, input, kOp);
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes[0] /= group_size;
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty(sizes, input.options());
  const Group::OpCopyRate rate = op_copy_rate(copy_rate_gbps, kOp);
  run_reduce_scatter(*g, input, out, reduce_op, kOp, Join::Functional);
  return out;
}

void reduce_scatter_out_cuda(const at::Tensor& input, std::string reduce_op, int64_t group_size, std::string group_name,
                             at::Tensor out) {
  static const char* kOp = "reduce_scatter_tensor_out";
  check_rs_input(input, reduce_op, group_size, kOp);
  check_rs_out(input, out, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, input, kOp);
  run_reduce_scatter(*g, input, out, reduce_op, kOp, Join::Now);
}

at::Tensor reduce_scatter_meta(const at::Tensor& input, std::string reduce_op, int64_t group_size, std::string group_name,
                               double copy_rate_gbps) {
  (void)group_name;
  (void)copy_rate_gbps;
  check_rs_input(input, reduce_op, group_size, "reduce_scatter_tensor");
  std::vector<c10::SymInt> sizes = input.sym_sizes().vec();
  sizes[0] = sizes[0] / group_size;
  return at::empty_symint(sizes, input.options());
}

void reduce_scatter_out_meta(const at::Tensor& input, std::string reduce_op, int64_t group_size, std::string group_name,
                             at::Tensor out) {
  (void)group_name;
  check_rs_input(input, reduce_op, group_size, "reduce_scatter_tensor_out");
  check_rs_out(input, out, group_size, "reduce_scatter_tensor_out");
}

// reduce_scatter_tensors: several tensors reduce-scattered as one op (a bucket without a bucket buffer). The output
// is 1-D: the concatenation, in input order, of what reduce_scatter_tensor(inputs[i]) returns, flattened.
at::Tensor reduce_scatter_tensors_cuda(at::TensorList inputs, std::string reduce_op, int64_t group_size,
                                       std::string group_name, double copy_rate_gbps) {
  static const char* kOp = "reduce_scatter_tensors";
  check_rs_parts(inputs, reduce_op, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, inputs[0], kOp);
  ReduceScatterArgs args{};
  args.dtype = reduce_dtype_of(inputs[0].scalar_type(), kOp);
  args.op = reduce_op_of(reduce_op, kOp);
  int64_t numel = 0;
  for (const at::Tensor& input : inputs) numel += input.numel() / group_size;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(g->device()));
  at::Tensor out = at::empty({numel}, inputs[0].options());
  const Group::OpCopyRate rate = op_copy_rate(copy_rate_gbps, kOp);
  run_reduce_scatter_parts(*g, inputs.vec(), out, args, Join::Functional);
  return out;
}

// reduce_scatter_tensors_out: reduce_scatter_tensors into a given 1-D `out`, joined on the current stream before it
// returns. `out` has the inputs' dtype, or float32 for float16 / bfloat16 inputs: a widening reduction (the fp32
// sum of the 16-bit values, what casting every input to fp32 and reducing gives; FSDP2's reduce_dtype=float32 over
// bfloat16 gradients), which moves half the bytes of the fp32 cast.
void check_rs_parts_out(at::TensorList inputs, const std::string& reduce_op, int64_t group_size, const at::Tensor& out,
                        const char* op) {
  check_rs_parts(inputs, reduce_op, group_size, op);
  TORCH_CHECK(out.defined(), "ce_overlap.", op, ": out is undefined");
  const ReduceDType in_dt = reduce_dtype_of(inputs[0].scalar_type(), op);
  TORCH_CHECK(reduce_dtypes_supported(in_dt, reduce_dtype_of(out.scalar_type(), op)), "ce_overlap.", op,
              ": out has dtype ", out.scalar_type(), "; it must be the inputs' dtype ", inputs[0].scalar_type(),
              " or, for 16-bit inputs, float32");
  TORCH_CHECK(out.device() == inputs[0].device(), "ce_overlap.", op, ": out is on ", out.device(), " but the inputs on ",
              inputs[0].device());
  TORCH_CHECK(out.is_contiguous(), "ce_overlap.", op, ": out must be contiguous");
  c10::SymInt numel = 0;
  for (const at::Tensor& input : inputs) numel = numel + input.sym_numel() / group_size;
  TORCH_SYM_CHECK(out.sym_numel().sym_eq(numel), "ce_overlap.", op, ": out has ", out.sym_numel(),
                  " elements; it needs the sum of inputs[i].numel() / group_size = ", numel);
}

void reduce_scatter_tensors_out_cuda(at::TensorList inputs, std::string reduce_op, int64_t group_size,
                                     std::string group_name, at::Tensor out) {
  static const char* kOp = "reduce_scatter_tensors_out";
  check_rs_parts_out(inputs, reduce_op, group_size, out, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, inputs[0], kOp);
  for (const at::Tensor& input : inputs) {
    const char* in = static_cast<const char*>(input.data_ptr());
    const char* o = static_cast<const char*>(out.data_ptr());
    const size_t in_bytes = static_cast<size_t>(input.numel()) * input.element_size();
    const size_t out_bytes = static_cast<size_t>(out.numel()) * out.element_size();
    TORCH_CHECK(in + in_bytes <= o || o + out_bytes <= in, "ce_overlap.", kOp, ": out overlaps an input (the "
                "reduction reads every input's own chunk while it writes out)");
  }
  ReduceScatterArgs args{};
  args.dtype = reduce_dtype_of(inputs[0].scalar_type(), kOp);
  args.op = reduce_op_of(reduce_op, kOp);
  const ReduceDType out_dt = reduce_dtype_of(out.scalar_type(), kOp);
  if (out_dt != args.dtype) args.out_dtype = out_dt;
  run_reduce_scatter_parts(*g, inputs.vec(), out, args, Join::Now);
}

void reduce_scatter_tensors_out_meta(at::TensorList inputs, std::string reduce_op, int64_t group_size,
                                     std::string group_name, at::Tensor out) {
  (void)group_name;
  check_rs_parts_out(inputs, reduce_op, group_size, out, "reduce_scatter_tensors_out");
}

at::Tensor reduce_scatter_tensors_meta(at::TensorList inputs, std::string reduce_op, int64_t group_size,
                                       std::string group_name, double copy_rate_gbps) {
  (void)group_name;
  (void)copy_rate_gbps;
  check_rs_parts(inputs, reduce_op, group_size, "reduce_scatter_tensors");
  c10::SymInt numel = 0;
  for (const at::Tensor& input : inputs) numel = numel + input.sym_numel() / group_size;
  return at::empty_symint({numel}, inputs[0].options());
}

// reduce_scatter_tensors_unreduced: the exchange of reduce_scatter_tensors without its reduction. Returns
// [group_size - 1, N] (N = sum of numel / group_size over the inputs): row j is what the j-th OTHER rank (rank
// order, this rank skipped) holds for this rank, its inputs' chunks concatenated like reduce_scatter_tensors'
// output. The reduce-scatter's result is this rank's own chunks plus the sum of the rows (mean: times
// 1 / group_size), which the caller computes (the pass emits it as graph ops that Inductor fuses into the
// consumer). Any dtype (nothing is reduced here); all inputs share it.
at::Tensor reduce_scatter_tensors_unreduced_cuda(at::TensorList inputs, int64_t group_size, std::string group_name,
                                                  double copy_rate_gbps) {
  static const char* kOp = "reduce_scatter_tensors_unreduced";
  check_unreduced_parts(inputs, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, inputs[0], kOp);
  ReduceScatterArgs args{};
  args.unreduced = true;
  int64_t numel = 0;
  for (const at::Tensor& input : inputs) numel += input.numel() / group_size;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(g->device()));
  at::Tensor out = at::empty({group_size - 1, numel}, inputs[0].options());  // no rows for a group of one
  const Group::OpCopyRate rate = op_copy_rate(copy_rate_gbps, kOp);
  run_reduce_scatter_parts(*g, inputs.vec(), out, args, Join::Functional);
  return out;
}

at::Tensor reduce_scatter_tensors_unreduced_meta(at::TensorList inputs, int64_t group_size, std::string group_name,
                                                  double copy_rate_gbps) {
  (void)group_name;
  (void)copy_rate_gbps;
  check_unreduced_parts(inputs, group_size, "reduce_scatter_tensors_unreduced");
  c10::SymInt numel = 0;
  for (const at::Tensor& input : inputs) numel = numel + input.sym_numel() / group_size;
  return at::empty_symint({c10::SymInt(group_size - 1), numel}, inputs[0].options());
}

// ---------------------------------------------------------------------------------------------------
// All-to-all (equal splits) and broadcast

at::Tensor all_to_all_cuda(const at::Tensor& input, int64_t group_size, std::string group_name) {
  static const char* kOp = "all_to_all_single";
  check_a2a_input(input, group_size, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, input, kOp);
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty(input.sizes(), input.options());
  run_all_to_all(*g, input, out, kOp, Join::Functional);
  return out;
}

void all_to_all_out_cuda(const at::Tensor& input, int64_t group_size, std::string group_name, at::Tensor out) {
  static const char* kOp = "all_to_all_single_out";
  check_a2a_input(input, group_size, kOp);
  check_a2a_out(input, out, kOp);
  std::shared_ptr<Group> g = group_for(group_name, group_size, input, kOp);
  run_all_to_all(*g, input, out, kOp, Join::Now);
}

at::Tensor all_to_all_meta(const at::Tensor& input, int64_t group_size, std::string group_name) {
  (void)group_name;
  check_a2a_input(input, group_size, "all_to_all_single");
  return at::empty_symint(input.sym_sizes(), input.options());
}

void all_to_all_out_meta(const at::Tensor& input, int64_t group_size, std::string group_name, at::Tensor out) {
  (void)group_name;
  check_a2a_input(input, group_size, "all_to_all_single_out");
  check_a2a_out(input, out, "all_to_all_single_out");
}

void broadcast_cuda(at::Tensor tensor, int64_t root, int64_t group_size, std::string group_name) {
  check_broadcast(tensor, root, group_size);
  std::shared_ptr<Group> g = group_for(group_name, group_size, tensor, "broadcast_");
  run_broadcast(*g, tensor, static_cast<int>(root), Join::Now);
}

void broadcast_meta(at::Tensor tensor, int64_t root, int64_t group_size, std::string group_name) {
  (void)group_name;
  check_broadcast(tensor, root, group_size);
}

// The functional ops return before the caller's stream waits for them (DeferredJoins): this makes the current
// stream wait for the op that produced `tensor` (no host wait), and surfaces a watchdog failure (timeout) as
// an exception at the point the result is consumed. A tensor with no pending op passes through.
at::Tensor wait_tensor(const at::Tensor& tensor) {
  if (std::optional<std::string> err = Runtime::get().first_failure()) {
    TORCH_CHECK(false, "ce_overlap.wait_tensor: ", *err);
  }
  if (tensor.is_cuda() && tensor.has_storage()) {
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(tensor.device().index());
    DeferredJoins::get().join(tensor.storage().data_ptr().get(), current.stream());
  }
  return tensor;
}

// Hands back its input. Inductor cannot see through it, so what reads the result reads the stored bytes instead of
// recomputing them from what produced them (the pass reads a CE reduce-scatter's own chunks through it: fx/rewrite.py).
at::Tensor stored(const at::Tensor& tensor) { return tensor; }

}  // namespace
}  // namespace ce_overlap

TORCH_LIBRARY(ce_overlap, m) {
  const std::vector<at::Tag> pt2 = {at::Tag::pt2_compliant_tag};
  // copy_rate_gbps: this op's peer copies paced at that rate (GB/s; the pass's per-bucket rate, docs/plan.md); 0: the
  // group's RuntimeConfig.copy_rate_gbps. On the ops the pass emits.
  m.def("all_gather_into_tensor(Tensor input, int group_size, str group_name, float copy_rate_gbps=0) -> Tensor", pt2);
  // Returns nothing: torch.compile functionalizes mutating custom ops only when no output aliases an input.
  m.def("all_gather_into_tensor_out(Tensor input, int group_size, str group_name, *, Tensor(a!) out) -> ()", pt2);
  // Several tensors as one collective (a bucket with no bucket buffer): output i / the chunks of input i are what
  // the one-tensor op gives for tensor i.
  m.def("all_gather_into_tensors(Tensor[] inputs, int group_size, str group_name, float copy_rate_gbps=0) -> Tensor[]",
        pt2);
  m.def("all_gather_into_tensors_out(Tensor[] inputs, int group_size, str group_name, *, Tensor(a!)[] outs) -> ()",
        pt2);
  m.def("reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, str group_name, float copy_rate_gbps=0) "
        "-> Tensor", pt2);
  m.def("reduce_scatter_tensors(Tensor[] inputs, str reduce_op, int group_size, str group_name, "
        "float copy_rate_gbps=0) -> Tensor", pt2);
  m.def("reduce_scatter_tensors_out(Tensor[] inputs, str reduce_op, int group_size, str group_name, *, "
        "Tensor(a!) out) -> ()", pt2);
  m.def("reduce_scatter_tensors_unreduced(Tensor[] inputs, int group_size, str group_name, float copy_rate_gbps=0) "
        "-> Tensor", pt2);
  m.def("reduce_scatter_tensor_out(Tensor input, str reduce_op, int group_size, str group_name, *, Tensor(a!) out) -> ()",
        pt2);
  m.def("all_to_all_single(Tensor input, int group_size, str group_name) -> Tensor", pt2);
  m.def("all_to_all_single_out(Tensor input, int group_size, str group_name, *, Tensor(a!) out) -> ()", pt2);
  m.def("broadcast_(Tensor(a!) tensor, int root, int group_size, str group_name) -> ()", pt2);
  // Hands back its input, and says so: the alias annotation keeps torch's custom-op aliasing check (an error
  // under CI, a deprecation warning elsewhere) quiet and tells Inductor's reinplacing that the result is the
  // collective's buffer, not a fresh one.
  m.def("wait_tensor(Tensor(a) tensor) -> Tensor(a)",
        torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(ce_overlap::wait_tensor)), pt2);
  m.def("stored(Tensor(a) tensor) -> Tensor(a)",
        torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(ce_overlap::stored)), pt2);
}

TORCH_LIBRARY_IMPL(ce_overlap, CUDA, m) {
  m.impl("all_gather_into_tensor", TORCH_FN(ce_overlap::all_gather_cuda));
  m.impl("all_gather_into_tensor_out", TORCH_FN(ce_overlap::all_gather_out_cuda));
  m.impl("all_gather_into_tensors", TORCH_FN(ce_overlap::all_gather_tensors_cuda));
  m.impl("all_gather_into_tensors_out", TORCH_FN(ce_overlap::all_gather_tensors_out_cuda));
  m.impl("reduce_scatter_tensors", TORCH_FN(ce_overlap::reduce_scatter_tensors_cuda));
  m.impl("reduce_scatter_tensors_out", TORCH_FN(ce_overlap::reduce_scatter_tensors_out_cuda));
  m.impl("reduce_scatter_tensors_unreduced", TORCH_FN(ce_overlap::reduce_scatter_tensors_unreduced_cuda));
  m.impl("reduce_scatter_tensor", TORCH_FN(ce_overlap::reduce_scatter_cuda));
  m.impl("reduce_scatter_tensor_out", TORCH_FN(ce_overlap::reduce_scatter_out_cuda));
  m.impl("all_to_all_single", TORCH_FN(ce_overlap::all_to_all_cuda));
  m.impl("all_to_all_single_out", TORCH_FN(ce_overlap::all_to_all_out_cuda));
  m.impl("broadcast_", TORCH_FN(ce_overlap::broadcast_cuda));
}

TORCH_LIBRARY_IMPL(ce_overlap, Meta, m) {
  m.impl("all_gather_into_tensor", TORCH_FN(ce_overlap::all_gather_meta));
  m.impl("all_gather_into_tensor_out", TORCH_FN(ce_overlap::all_gather_out_meta));
  m.impl("all_gather_into_tensors", TORCH_FN(ce_overlap::all_gather_tensors_meta));
  m.impl("all_gather_into_tensors_out", TORCH_FN(ce_overlap::all_gather_tensors_out_meta));
  m.impl("reduce_scatter_tensors", TORCH_FN(ce_overlap::reduce_scatter_tensors_meta));
  m.impl("reduce_scatter_tensors_out", TORCH_FN(ce_overlap::reduce_scatter_tensors_out_meta));
  m.impl("reduce_scatter_tensors_unreduced", TORCH_FN(ce_overlap::reduce_scatter_tensors_unreduced_meta));
  m.impl("reduce_scatter_tensor", TORCH_FN(ce_overlap::reduce_scatter_meta));
  m.impl("reduce_scatter_tensor_out", TORCH_FN(ce_overlap::reduce_scatter_out_meta));
  m.impl("all_to_all_single", TORCH_FN(ce_overlap::all_to_all_meta));
  m.impl("all_to_all_single_out", TORCH_FN(ce_overlap::all_to_all_out_meta));
  m.impl("broadcast_", TORCH_FN(ce_overlap::broadcast_meta));
}

// Hardware profiles (schema ce_overlap.profile/2, docs/profiles.md): the one place hardware numbers live.
// Built-in profiles are JSON files in python/ce_overlap/profiles/; `ce-overlap topo --json` writes a topology.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../graph/ir.h"
#include "shapes.h"

namespace ce_overlap {

inline constexpr const char* kProfileSchema = "ce_overlap.profile/2";
inline constexpr int kMaxGpusPerNode = 1024;

struct GpuSpec {
  std::string name;
  int sms = 0;
  double peak_bf16_tflops = 0;  // dense tensor-core peak, also used for fp16
  double peak_fp32_tflops = 0;  // non-tensor-core fp32 peak
  double hbm_gbps = 0;          // GB/s (1e9 bytes/s)
  int copy_engines = 0;         // async copy engines (cudaDeviceProp::asyncEngineCount)
  double memory_gib = 0;
};

struct LinkSpec {
  std::string kind;                // "nvlink4", "pcie5", "sys", "ib-ndr", ...
  double gbps_per_direction = 0;   // GB/s one way; links are symmetric
  bool p2p = false;                // the two GPUs can map each other's memory (what CE needs)
};

// A per-pair exception to the default intra-node link (compact form). gpus are local indices, a < b.
struct PairLink {
  int a = 0;
  int b = 0;
  LinkSpec link;
};

// GPUs are numbered globally; GPU g sits on node g / gpus_per_node at local index g % gpus_per_node.
// Within a node, exactly one of two forms describes every pair: `intra_node` (a default) with optional
// `pairs` overrides, or `matrix` (all gpus_per_node^2 entries, row-major, diagonal unused).
struct TopologySpec {
  int gpus_per_node = 1;
  std::vector<int> numa_node;          // per local GPU
  std::optional<LinkSpec> intra_node;  // compact form
  std::vector<PairLink> pairs;         // compact form overrides
  std::vector<LinkSpec> matrix;        // per-pair form
  std::optional<LinkSpec> inter_node;  // between nodes, per NIC (rail); absent: groups must fit one node
  // NICs per node, each on its own rail (rail-optimized: local GPU l on rail l % rails); a group with q ranks on each
  // node drives min(q, rails) of them at once. Optional ("rails"; absent: 1).
  int rails = 1;

  // The link between local GPUs a != b of one node.
  const LinkSpec& link(int a, int b) const;
};

// What fraction of peak real kernels reach, and fixed costs.
struct EfficiencySpec {
  double gemm = 0;             // of peak tensor-core FLOP/s, large GEMMs
  double gemm_ramp_flops = 0;  // FLOPs at which a GEMM reaches half of `gemm` (0: no ramp)
  double memory = 0;           // of HBM bandwidth, memory-bound kernels
  double kernel_launch_us = 0; // floor per compute kernel
  // Optional (0: absent). Attention kernels (forward / backward) on the FLOPs they execute (causal masking
  // discounted), of peak tensor-core FLOP/s; absent: `gemm`. A fused optimizer step (AdamW) of HBM bandwidth;
  // absent: `memory`. The cost model does not charge optimizers itself; step models (bench/train.py) read it.
  double attention = 0;
  double attention_backward = 0;
  double optimizer = 0;
  // Optional (0: absent). The GPU's idle time between two consecutive kernels of a stream (the next launch's
  // latency that back-to-back kernels still pay): charged once per kernel the graph runs (CostModel::durations_us).
  double kernel_gap_us = 0;
  // Optional (0: absent). Of HBM bandwidth, what the fused kernels of a compiled step reach (Inductor's Triton
  // kernels: casts, norms and their reductions, RoPE's strided halves, the loss): a fusion group's bytes are charged
  // at it (CostModel::durations_us); absent: `memory`, the rate of a plain memory-bound kernel in a burst.
  double fused_memory = 0;
  // Optional (0: absent). Flex attention's kernels (Inductor's Triton templates, forward / backward) on the FLOPs
  // their block mask executes, of peak tensor-core FLOP/s; absent: `attention` / `attention_backward` (then `gemm`).
  double flex_attention = 0;
  double flex_attention_backward = 0;

  double fused_memory_or_memory() const { return fused_memory > 0 ? fused_memory : memory; }
  double attention_or_gemm(bool backward) const {
    const double e = backward ? attention_backward : attention;
    return e > 0 ? e : gemm;
  }
  double flex_attention_or_attention(bool backward) const {
    const double e = backward ? flex_attention_backward : flex_attention;
    return e > 0 ? e : attention_or_gemm(backward);
  }
};

// One line of NCCL's cost model: time = base + steps x per_step + bus_bytes / (link x bus_efficiency).
// NCCL runs the fastest line for a size, as its tuner picks a protocol.
struct NcclProtocol {
  std::string name;  // "ll", "ll128", "simple"
  double base_latency_us = 0;
  double per_step_latency_us = 0;
  double bus_efficiency = 0;  // busbw / link GB/s at large sizes, within one node
};

// A factor on every protocol line's bus_efficiency for one collective on one group size inside a node. The lines are
// fitted to 2-rank all-gathers and reduce-scatters; NCCL's ring runs faster per bus byte at 3-4 ranks (~1.2-1.3x on
// H100 / H200) and its broadcast ~1.4x at every size measured.
struct NcclScale {
  CollectiveType collective = CollectiveType::AllGather;
  int group_size = 2;
  double scale = 1;
};

struct NcclSpec {
  int channels = 0;  // CTAs NCCL keeps resident while a collective runs = SMs it takes
  std::vector<NcclProtocol> protocols;
  // Optional (profile key nccl.bus_efficiency_scale); at most one entry per (collective, group size).
  std::vector<NcclScale> bus_efficiency_scale;
  // The factor for `collective` on `group_size` ranks of one node: the listed one; between two listed sizes linear
  // in the group size; below the smallest / above the largest listed, that size's; 1 when none is listed.
  double scale(CollectiveType collective, int group_size) const;
  double reduction_bandwidth_factor = 1;  // reduce-scatter / all-reduce bus bandwidth relative to copies
  double inter_node_step_latency_us = 0;  // added to every ring/tree step of a group that spans nodes
  double inter_node_bus_efficiency = 0;   // busbw / inter-node link GB/s
};

// Copy-engine collectives (csrc/runtime): per-peer pulls over P2P mappings, flags for signalling.
struct CeSpec {
  double copy_latency_us = 0;           // per cudaMemcpyAsync, back to back on one engine
  double signal_latency_us = 0;         // per collective: ready/done flags between ranks
  double one_way_efficiency = 0;        // of link GB/s, traffic in one direction only
  double bidirectional_efficiency = 0;  // of link GB/s per direction, both directions busy
  double engine_gbps = 0;               // one copy engine's ceiling
  int reduce_sms = 0;                   // SMs of the reduce-scatter's reduction kernel
  double reduce_gbps_per_sm = 0;        // HBM GB/s one SM of that kernel moves
};

// Slowdown of a kernel class beside traffic that takes c SMs and R GB/s of HBM:
//   sm_sensitivity x c / (sms - c) + hbm_sensitivity x R / (hbm x memory efficiency - R).
struct KernelSensitivity {
  double sm_sensitivity = 0;
  double hbm_sensitivity = 0;
};

// Fractional slowdown of a collective while compute-bound / memory-bound kernels run beside it, and the time it
// holds its SMs beyond that when compute runs beside it at all (residency_us, optional, default 0): per collective,
// not per byte. NCCL's kernels and cuBLAS's persistent GEMMs (one CTA per SM, the whole register file) take turns
// on the SMs, so a collective beside compute waits, for its peer or for SMs, and the kernels beside it wait too.
struct CollectiveSensitivity {
  double compute_bound = 0;
  double memory_bound = 0;
  double residency_us = 0;
};

// Measured fractional slowdown of compute-bound / memory-bound kernels while some other kernel runs beside them.
struct KernelClassSlowdown {
  double compute_bound = 0;
  double memory_bound = 0;
};

struct ContentionSpec {
  KernelSensitivity compute_bound;
  KernelSensitivity memory_bound;
  CollectiveSensitivity nccl_beside_compute;
  CollectiveSensitivity ce_beside_compute;
  // Optional: the CE reduction kernel (ce.reduce_sms CTAs, running non-stop) beside each kernel class, measured
  // (bench/ce_probe.py (d), ce-overlap calibrate). Its CTAs share SMs with the kernels beside rather than taking
  // them, so the SM/HBM formula, which is used without this, overcharges it (one H200: GEMM +10% measured at
  // 8..32 CTAs, +42% by the formula at 32).
  std::optional<KernelClassSlowdown> ce_reduction;
  // Optional: what the copy engines' traffic adds to each kernel class beside it beyond the SM/HBM formula, measured
  // (ce-overlap calibrate: the GEMM and the memory-bound add beside the CE all-gather, less what the formula gives).
  // The copies take no SMs and little HBM, yet on 2x H200 a bf16 GEMM ran 13.8% slower beside them (the formula:
  // 1%): their power lowers the SM clock. Added to every CE phase that moves bytes by copy engine.
  std::optional<KernelClassSlowdown> ce_copies;
};

// Hier: a hierarchical all-gather / reduce-scatter over a group that spans nodes: copy engines among the ranks of
// each node, NCCL among the rail-aligned ranks of the nodes (ce_overlap.runtime.hierarchical).
enum class Backend { Nccl, Ce, Hier };
const char* to_string(Backend b);
Backend backend_from_string(const std::string& s);  // throws IrError listing the accepted names

// Measured time vs bytes for one (collective, backend, group size); used instead of the analytic model.
// bytes follow CollectiveInfo::bytes (all-gather: the shard; reduce-scatter: the full input).
struct CurvePoint {
  double bytes = 0;
  double us = 0;
};
struct Curve {
  CollectiveType collective = CollectiveType::AllGather;
  Backend backend = Backend::Nccl;
  int group_size = 2;
  std::vector<CurvePoint> points;  // bytes strictly increasing, us non-decreasing, at least 2
};

// The host's time to issue a training step (Python, Dynamo, AOTAutograd, the launches): the step the GPU runs can
// not be shorter. Per compiled graph: `launch_us` per kernel it runs (the analysis's kernels: Inductor's wrapper,
// launcher and the driver), `graph_input_us` per input (guards, AOTAutograd's runtime wrappers, autograd's edges),
// `collective_us` per collective (its op's dispatch and the runtime's or NCCL's enqueue); per step, `step_us`
// outside the graphs (optimizer.step, zero_grad, the backward's entry). Fitted to host-bound steps
// (bench/compute_models.py --host-bound; `source` names the run). The loader checks the section; the step model
// (python/ce_overlap/analyzer/step_model.py, host_us) prices a step with it, from the analysis's counts per graph.
struct HostSpec {
  double launch_us = 0;
  double graph_input_us = 0;
  double collective_us = 0;
  double step_us = 0;
  std::string source;
};

struct Profile {
  std::string name;
  std::string description;
  GpuSpec gpu;
  TopologySpec topology;
  EfficiencySpec efficiency;
  NcclSpec nccl;
  CeSpec ce;
  ContentionSpec contention;
  std::vector<Curve> curves;
  // Optional ("shapes"): compute priced by shape (shapes.h); absent, the scalar efficiencies above price every kernel.
  std::optional<ComputeShapes> shapes;
  // Optional ("host"); absent, the host is not priced (a step is its GPU time).
  std::optional<HostSpec> host;
};

// Parse and validate; throws IrError naming the field ("gpu.hbm_gbps: expected a positive number, got -1").
Profile load_profile(const std::string& json_text);
Profile profile_from_json(const nlohmann::json& j);
nlohmann::json profile_to_json(const Profile& p);
// The topology object alone, validated against gpus_per_node rules (what `ce-overlap topo --json` emits).
TopologySpec topology_from_json(const nlohmann::json& j, const std::string& path = "topology");
nlohmann::json topology_to_json(const TopologySpec& t);

}  // namespace ce_overlap

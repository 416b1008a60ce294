// Test helpers for the planner: FSDP-like graphs (per block: shard -> dtype cast -> all-gather -> wait
// -> matmuls; backward: gradients -> reduce-scatter -> wait -> output), a random DAG generator, and a
// Plan built from a Schedule with placeholder backends so check_plan can judge graph-only results.
#pragma once

#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "graph/bucketing.h"
#include "graph/ir.h"
#include "graph/plan.h"
#include "graph/schedule.h"
#include "graph_builder.h"

namespace ce_overlap::testing {

inline constexpr const char* kAllGatherOp = "_c10d_functional.all_gather_into_tensor.default";
inline constexpr const char* kReduceScatterOp = "_c10d_functional.reduce_scatter_tensor.default";
inline constexpr const char* kAllReduceOp = "_c10d_functional.all_reduce.default";

// A mergeable functional collective of `type` reading `input`; bytes as the IR counts them
// (all-gather: the input shard; reduce-scatter, all-reduce: the full input).
inline int functional_collective(GraphBuilder& b, const std::string& name, int input, CollectiveType type,
                                 int group_size = 8, const std::string& group = "0") {
  const TensorInfo in = b.graph().nodes[input].outputs[0];
  TensorInfo out = in;
  int64_t out_numel = 1;
  for (int64_t d : in.shape) out_numel *= d;
  if (type == CollectiveType::AllGather) {
    out.shape[0] *= group_size;
    out_numel *= group_size;
  } else if (type == CollectiveType::ReduceScatter) {
    out.shape[0] /= group_size;
    out_numel /= group_size;
  }
  out.bytes = out_numel * dtype_itemsize(out.dtype);
  const int id = b.collective(name, {input}, type, out, group_size);
  Node& node = b.node(id);
  node.op = type == CollectiveType::AllGather       ? kAllGatherOp
            : type == CollectiveType::ReduceScatter ? kReduceScatterOp
                                                    : kAllReduceOp;
  node.collective->bytes = in.bytes;
  node.collective->group = group;
  return id;
}

struct FsdpOptions {
  int blocks = 3;
  int params_per_block = 3;
  int64_t shard_rows = 64;  // each parameter: [shard_rows x 8, 256] bf16 gathered from [shard_rows, 256]
  int matmuls_per_param = 2;
  bool backward = false;    // also a reduce-scatter of a gradient per parameter
  bool outside = true;      // an embedding all-gather before the blocks and an output one after them
};

inline void set_block(Node& n, int block) {
  n.block = block;
  if (block >= 0) n.module_stack = {{"layers." + std::to_string(block), "Block"}};
}

// Forward (or a backward-like) graph of an FSDP model; blocks and module stacks filled in.
inline Document fsdp_doc(const FsdpOptions& o) {
  GraphBuilder b(o.backward ? "backward" : "forward");
  const int tokens = b.placeholder("tokens", tensor({16, 256}, "bfloat16"));
  std::vector<int> shards;
  const int total = o.blocks * o.params_per_block + (o.outside ? 2 : 0);
  for (int p = 0; p < total; ++p) {
    shards.push_back(b.placeholder("shard_" + std::to_string(p), tensor({o.shard_rows, 256}, "bfloat16")));
  }
  int next_shard = 0;
  auto gather = [&](const std::string& suffix, int block) {
    const int shard = shards[next_shard++];
    const int cast = b.compute("cast_" + suffix, {shard}, b.graph().nodes[shard].outputs[0]);
    set_block(b.node(cast), block);
    const int ag = functional_collective(b, "ag_" + suffix, cast, CollectiveType::AllGather);
    set_block(b.node(ag), block);
    if (block >= 0) {
      b.node(ag).module_stack.push_back({"layers." + std::to_string(block) + ".w" + suffix, "Linear"});
    } else {
      b.node(ag).module_stack = {{suffix == "emb" ? "tok_embeddings" : "output", "Linear"}};
    }
    const int w = b.wait("wait_ag_" + suffix, ag, b.graph().nodes[ag].outputs[0]);
    set_block(b.node(w), block);
    return w;
  };
  std::vector<int> outputs;
  int x = tokens;
  if (o.outside) {
    const int emb = gather("emb", -1);
    x = b.compute("embedding", {emb, tokens}, tensor({16, 256}, "bfloat16"));
  }
  const int64_t rows = o.shard_rows * 8;
  for (int l = 0; l < o.blocks; ++l) {
    for (int p = 0; p < o.params_per_block; ++p) {
      const std::string suffix = std::to_string(l) + "_" + std::to_string(p);
      const int w = gather(suffix, l);
      const int t = b.view("t_" + suffix, w, tensor({256, rows}, "bfloat16"));
      set_block(b.node(t), l);
      int y = x;
      for (int k = 0; k < o.matmuls_per_param; ++k) {
        y = b.compute("mm_" + suffix + "_" + std::to_string(k), {y, t}, tensor({16, 256}, "bfloat16"),
                      int64_t{2} * 16 * 256 * rows * 64);
        set_block(b.node(y), l);
      }
      x = y;
      if (o.backward) {
        const int grad = b.compute("grad_" + suffix, {x}, tensor({rows, 256}, "bfloat16"),
                                   int64_t{2} * 16 * 256 * rows);
        set_block(b.node(grad), l);
        const int rs = functional_collective(b, "rs_" + suffix, grad, CollectiveType::ReduceScatter);
        set_block(b.node(rs), l);
        const int rw = b.wait("wait_rs_" + suffix, rs, b.graph().nodes[rs].outputs[0]);
        set_block(b.node(rw), l);
        const int g32 = b.compute("grad32_" + suffix, {rw}, tensor({o.shard_rows, 256}, "float32"));
        set_block(b.node(g32), l);
        outputs.push_back(g32);
      }
    }
  }
  if (o.outside) {
    const int out_w = gather("out", -1);
    x = b.compute("logits", {x, out_w}, tensor({16, 256}, "bfloat16"), int64_t{2} * 16 * 256 * rows);
  }
  outputs.insert(outputs.begin(), x);
  b.output(outputs);
  Document doc = make_doc({b.graph()});
  for (int l = 0; l < o.blocks; ++l) doc.blocks.push_back({l, "layers." + std::to_string(l), "Block"});
  return doc;
}

// FSDP x TP, forward-like: per block, the data-parallel all-gather of the block's weight (group "dp", 4 ranks, role dp)
// and the tensor-parallel collectives around its GEMM (group "tp", 2 ranks, role tp): norm -> all-gather of the
// sequence -> GEMM with the gathered weight -> reduce-scatter of the sequence -> residual add. `shard_rows` sizes the
// weights (bf16 [shard_rows, 256] per rank, gathered to 4x), `seq` the activations ([seq, 256] per rank), `mm_flops`
// the GEMM (0: 2 x 2seq x 256 x 256); `post_flops` > 0: a second GEMM of that many FLOPs after the residual add (the
// feed-forward's, without its TP collectives): compute a bucket issued in the block can stretch over.
inline Document tp_doc(int blocks = 3, int64_t shard_rows = 64, int64_t seq = 16, int64_t mm_flops = 0,
                       int64_t post_flops = 0) {
  GraphBuilder b("forward");
  int x = b.placeholder("x", tensor({seq, 256}, "bfloat16"));
  std::vector<int> shards;
  for (int l = 0; l < blocks; ++l) {
    shards.push_back(b.placeholder("shard_" + std::to_string(l), tensor({shard_rows, 256}, "bfloat16")));
  }
  // A collective of `role` on `group` in block l reading `input`, and its wait: the wait's id.
  auto collective = [&](const std::string& name, int input, CollectiveType type, int ranks, const std::string& group,
                        CollectiveRole role, int l) {
    const int c = functional_collective(b, name, input, type, ranks, group);
    b.node(c).collective->role = role;
    set_block(b.node(c), l);
    const int w = b.wait(name + "_wait", c, b.graph().nodes[c].outputs[0]);
    set_block(b.node(w), l);
    return w;
  };
  for (int l = 0; l < blocks; ++l) {
    const std::string s = std::to_string(l);
    const int cast = b.compute("cast_" + s, {shards[l]}, tensor({shard_rows, 256}, "bfloat16"));
    set_block(b.node(cast), l);
    const int w = collective("dp_ag_" + s, cast, CollectiveType::AllGather, 4, "dp", CollectiveRole::DataParallel, l);
    const int norm = b.compute("norm_" + s, {x}, tensor({seq, 256}, "bfloat16"));
    set_block(b.node(norm), l);
    const int tw = collective("tp_ag_" + s, norm, CollectiveType::AllGather, 2, "tp", CollectiveRole::TensorParallel, l);
    const int mm = b.compute("mm_" + s, {tw, w}, tensor({2 * seq, 256}, "bfloat16"),
                             mm_flops > 0 ? mm_flops : int64_t{2} * 2 * seq * 256 * 256);
    set_block(b.node(mm), l);
    const int rw = collective("tp_rs_" + s, mm, CollectiveType::ReduceScatter, 2, "tp", CollectiveRole::TensorParallel,
                              l);
    x = b.compute("residual_" + s, {x, rw}, tensor({seq, 256}, "bfloat16"));
    set_block(b.node(x), l);
    if (post_flops > 0) {
      x = b.compute("post_" + s, {x}, tensor({seq, 256}, "bfloat16"), post_flops);
      set_block(b.node(x), l);
    }
  }
  b.output({x});
  Document doc = make_doc({b.graph()});
  for (int l = 0; l < blocks; ++l) doc.blocks.push_back({l, "layers." + std::to_string(l), "Block"});
  return doc;
}

// A Plan of a schedule with NCCL everywhere and no predictions: enough for check_plan to judge the
// bucketing and the order.
inline Plan plan_of(const Document& doc, const Graph& g, const Schedule& s, const PlanConfig& config) {
  Plan plan;
  plan.graph = g.name;
  plan.profile = "test";
  plan.config = config;
  std::vector<size_t> by_issue(s.buckets.size());
  std::iota(by_issue.begin(), by_issue.end(), 0);
  std::stable_sort(by_issue.begin(), by_issue.end(),
                   [&](size_t a, size_t b) { return s.issue_position[a] < s.issue_position[b]; });
  for (size_t b : by_issue) {
    const Bucket& bucket = s.buckets[b];
    PlanBucket pb;
    pb.id = static_cast<int>(plan.buckets.size());
    pb.type = bucket.type;
    if (bucket.block >= 0) pb.block = bucket.block;
    if (bucket.scope != BucketScope::Outside) pb.block_path = bucket.key;
    pb.group = bucket.group;
    pb.group_size = bucket.group_size;
    pb.dtype = bucket.dtype;
    pb.reduce_op = bucket.reduce_op;
    for (size_t k = 0; k < bucket.members.size(); ++k) {
      PlanMember m;
      m.collective = g.nodes[bucket.members[k]].name;
      if (bucket.waits[k] >= 0) m.wait = g.nodes[bucket.waits[k]].name;
      m.bytes = g.nodes[bucket.members[k]].collective->bytes;
      pb.members.push_back(m);
    }
    pb.bytes = bucket.bytes;
    pb.backend = "nccl";
    pb.reason = "nccl: test";
    plan.summary.collectives += static_cast<int64_t>(bucket.members.size());
    plan.buckets.push_back(pb);
  }
  for (int v : s.order) plan.order.push_back(g.nodes[v].name);
  plan.summary.buckets = static_cast<int64_t>(plan.buckets.size());
  plan.summary.peak_memory_bytes_before = s.peak_bytes_before;
  plan.summary.peak_memory_bytes_after = s.peak_bytes_after;
  plan.summary.memory_budget_bytes = config.memory_budget_bytes;
  (void)doc;
  return plan;
}

// A random valid graph: placeholders, then compute, views and collectives (all-gather, reduce-scatter,
// all-reduce on two groups, some coalesced through getitem views, some read directly), random blocks
// in runs, an output. Deterministic in `seed`.
inline Document random_doc(uint32_t seed, int body_nodes = 120) {
  std::mt19937 rng(seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint32_t>(n)); };
  GraphBuilder b("forward");
  std::vector<int> values;  // nodes whose output may be read (not collectives, which need a wait)
  const int placeholders = 1 + pick(6);
  for (int i = 0; i < placeholders; ++i) {
    values.push_back(b.placeholder("p" + std::to_string(i), tensor({8 * (1 + pick(4)), 16}, "bfloat16")));
  }
  const int blocks = pick(4);
  int block = blocks > 0 ? 0 : -1;
  for (int i = 0; i < body_nodes; ++i) {
    if (blocks > 0 && pick(25) == 0) block = block + 1 < blocks ? block + 1 : -1;
    const std::string s = std::to_string(i);
    const int r = pick(10);
    const int src = values[values.size() - 1 - pick(std::min<int>(static_cast<int>(values.size()), 12))];
    int made = -1;
    if (r < 5) {
      std::vector<int> ins = {src};
      if (pick(2)) ins.push_back(values[pick(static_cast<int>(values.size()))]);
      const TensorInfo out = tensor({8 * (1 + pick(4)), 16}, pick(5) ? "bfloat16" : "float32");
      made = b.compute("c" + s, ins, out, pick(3) ? int64_t{1} << (20 + pick(12)) : 0);
    } else if (r == 5) {
      made = b.view("v" + s, src, b.graph().nodes[src].outputs[0]);
    } else {
      const CollectiveType types[] = {CollectiveType::AllGather, CollectiveType::ReduceScatter,
                                      CollectiveType::AllReduce};
      CollectiveType type = types[pick(3)];
      if (type == CollectiveType::ReduceScatter && b.graph().nodes[src].outputs[0].shape[0] % 8 != 0) {
        type = CollectiveType::AllReduce;  // the output shape must divide
      }
      const int c = functional_collective(b, "coll" + s, src, type, 8, pick(4) ? "0" : "1");
      b.node(c).block = block;
      const int shape = pick(8);
      if (shape == 0) {  // coalesced: two getitems, a wait each
        const int g0 = b.view("gi0_" + s, c, b.graph().nodes[c].outputs[0]);
        const int g1 = b.view("gi1_" + s, c, b.graph().nodes[c].outputs[0]);
        made = b.wait("w0_" + s, g0, b.graph().nodes[c].outputs[0]);
        values.push_back(b.wait("w1_" + s, g1, b.graph().nodes[c].outputs[0]));
      } else if (shape == 1) {  // no wait at all; something reads it directly
        made = b.compute("direct" + s, {c}, tensor({8, 16}, "bfloat16"));
      } else {
        made = b.wait("w" + s, c, b.graph().nodes[c].outputs[0]);
      }
    }
    b.node(made).block = block;
    values.push_back(made);
  }
  std::vector<int> outs;
  for (int k = 0; k < 3; ++k) outs.push_back(values[values.size() - 1 - k % values.size()]);
  b.output(outs);
  Document doc = make_doc({b.graph()});
  for (int l = 0; l < blocks; ++l) doc.blocks.push_back({l, "layers." + std::to_string(l), "Block"});
  for (Node& n : doc.graphs[0].nodes) {
    if (n.block >= 0) n.module_stack = {{"layers." + std::to_string(n.block), "Block"}};
  }
  return doc;
}

}  // namespace ce_overlap::testing

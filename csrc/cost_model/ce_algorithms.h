// How the copy-engine runtime picks an algorithm by world size and message size, shared by the runtime (which runs
// it: csrc/runtime/all_to_all.cc) and the cost model (which prices it): one owner for each rule. Header-only, no CUDA,
// no torch.
#pragma once

#include <cstddef>

namespace ce_overlap {

// Most segments a scatter + all-gather broadcast is pipelined over (each is one round, plus one at the end).
constexpr int kMaxBcastSegments = 64;

// A broadcast round's cost in bytes it could have moved: link rate B times the per-round latency o. Fitted on 4x
// H200 (2026-11-27, bench/results/collectives-2026-11-27): 256 MiB over K = 2, 4, 8 segments took
// (1 + 2/(3K)) N / B + (K + 1) o with B ~ 380 GB/s and o = 40-46 us, so B * o ~ 16 MiB.
constexpr double kBroadcastRoundBytes = 16.0 * 1024 * 1024;

// The segments a broadcast of `nbytes` over `world_size` ranks is pipelined over as a scatter + all-gather, or 0:
// every non-root pulls the whole tensor from the root (2 ranks, small tensors). Pulling it whole takes (n-1) N / B + o
// (the root's links carry every copy); K segments take (K + (n-2)/(n-1)) N / (K B) + (K + 1) o (the first round only
// scatters, the last only exchanges); the K that minimizes it (near sqrt((n-2)/(n-1) N / (B o))). `tuned` > 0 forces
// that count from 3 ranks on (the runtime's bcast_segments knob).
inline size_t broadcast_segments(int world_size, size_t nbytes, int tuned) {
  if (world_size < 3 || nbytes == 0) return 0;
  if (tuned > 0) return static_cast<size_t>(tuned);
  const double n = world_size, N = static_cast<double>(nbytes) / kBroadcastRoundBytes;  // N in units of B * o
  double best = (n - 1) * N + 1;  // the whole pull, in units of o
  size_t segments = 0;
  for (int K = 1; K <= kMaxBcastSegments; ++K) {  // the argmin (ties: more segments, the shorter pipeline fill)
    const double t = (K + (n - 2) / (n - 1)) * N / K + (K + 1);
    if (t <= best) best = t, segments = static_cast<size_t>(K);
  }
  return segments;
}

// The push broadcast (a symmetric tensor, 3+ ranks, one round: all_to_all.cc): each non-root pulls its piece of every
// segment from the root and pushes it on into the other non-roots, the pull of segment k+1 beside the pushes of
// segment k. The segments it is cut into: one unless `tuned` > 0 (the bcast_segments knob). Measured on 4x H100
// (2026-11-27, bench/results/collectives-2026-11-27-b), every segment count above one was slower at 16, 64 and 256 MiB
// (e.g. 64 MiB, 4 ranks: 211.5 GB/s for one, 204.8 / 195.4 / 169.4 for 2 / 4 / 8): the pulls and pushes did not
// overlap enough to pay for their extra copies.
inline size_t broadcast_push_segments(int world_size, size_t nbytes, int tuned) {
  if (world_size < 3 || nbytes == 0) return 0;
  return tuned > 0 ? static_cast<size_t>(tuned) : 1;
}

}  // namespace ce_overlap

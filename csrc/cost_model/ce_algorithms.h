// How the copy-engine runtime picks an algorithm by world size and message size, shared by the runtime (which runs
// it: csrc/runtime/all_to_all.cc) and the cost model (which prices it): one owner for each rule. Header-only, no CUDA,
// no torch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <deque>
#include <vector>

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
// segment from the root and pushes it on into the other non-roots.
//
// RELAY: with an odd number m = n - 1 of non-roots (n = 4, 6, 8) each non-root runs its copies on one stream in the
// order below, so that in steady state one non-root pulls from the root while the others push to each other in pairs,
// every NVLink port carrying one copy each way. (A GPU's copy engines ran a pull and a push of one op one after the
// other, not side by side: traced on 4x H100, 2026-11-27-b; so the overlap has to come from one non-root pulling
// while the others push.) Slots s = 0, 1, ...: the puller is non-root s mod m; every other non-root x pushes to its
// partner 2s - x (mod m), the round-robin pairing in which each non-root meets every other once in m slots. Before
// slot 0 every non-root pulls segment 0 (all at once: the pipeline's fill). A non-root whose slot has nothing to do
// goes on to its next copy.
//   Cost: (m K + m - 1) slots of N / (m K) bytes each, i.e. (1 + (m-1)/(m K)) N / B, plus one copy's fixed cost g per
// slot: K = sqrt(N (m-1) / (B g m^2)) balances the two. Measured on 4x H200 (2026-11-28, bench/results/
// collectives-2026-11-28-c): a slot's copy of 5.6 MB ran 16.4-17.5 us (~330 GB/s) with ~2 us between copies, so
// B g ~ 1.5 MiB; 256 MiB: 192 / 250 / 283 / 275 / 202 GB/s over 1 / 2 / 4 / 8 / 16 segments.
//   Below kRelayMinBytes the relay's extra copies cost more than they overlap: at 16 MiB it ran 150 GB/s against the
// lane order's 158; at 64 MiB 219 against 206.
// Otherwise (odd n, or a small tensor): LANE order, the pull on the comm stream and the pushes on a second stream
// after it, one segment unless tuned (measured on 4x H100, 2026-11-27-b: more segments were slower, the pushes queued
// behind the pulls).

constexpr double kRelayCopyBytes = 1.5 * 1024 * 1024;  // B g above
constexpr size_t kRelayMinBytes = size_t{32} << 20;

inline bool broadcast_relays(int world_size, size_t nbytes) {
  return world_size >= 4 && world_size % 2 == 0 && nbytes >= kRelayMinBytes;
}

// The segments the push broadcast is cut into: `tuned` > 0 forces it; else the relay's balance (above), or 1.
inline size_t broadcast_push_segments(int world_size, size_t nbytes, int tuned) {
  if (world_size < 3 || nbytes == 0) return 0;
  if (tuned > 0) return static_cast<size_t>(tuned);
  if (!broadcast_relays(world_size, nbytes)) return 1;
  const double m = world_size - 1;
  const double K = std::sqrt(static_cast<double>(nbytes) * (m - 1) / (kRelayCopyBytes * m * m));
  return static_cast<size_t>(std::clamp(std::lround(K), 1L, static_cast<long>(kMaxBcastSegments)));
}

// One copy of a relaying non-root: a pull of its piece of `segment` from the root, or a push of it to the non-root
// whose index (rank - root - 1 mod n, as `me`) is `to`.
struct RelayCopy {
  bool pull = false;
  int segment = 0;
  int to = -1;
};

// Non-root `me`'s copies, in stream order, for `segments` segments (world_size even, >= 4): the slots above, each
// piece pushed to the other non-roots in the order it was pulled.
inline std::vector<RelayCopy> broadcast_relay_order(int world_size, int me, size_t segments) {
  const int m = world_size - 1;
  const int K = static_cast<int>(segments);
  std::vector<RelayCopy> out;
  if (m < 3 || m % 2 == 0 || me < 0 || me >= m || K <= 0) return out;
  std::vector<std::deque<int>> pending(static_cast<size_t>(m));  // per destination: segments still to push there
  auto pulled = [&](int k) {
    out.push_back(RelayCopy{true, k, -1});
    for (int q = 0; q < m; ++q) {
      if (q != me) pending[static_cast<size_t>(q)].push_back(k);
    }
  };
  pulled(0);  // the fill: every non-root at once
  int next = 1;
  auto any_pending = [&] {
    for (const auto& d : pending) {
      if (!d.empty()) return true;
    }
    return false;
  };
  for (int s = 0; next < K || any_pending(); ++s) {
    const int puller = s % m;
    if (puller == me) {
      if (next < K) pulled(next++);
      continue;
    }
    const int partner = ((2 * puller - me) % m + m) % m;
    auto& queue = pending[static_cast<size_t>(partner)];
    if (!queue.empty()) {
      out.push_back(RelayCopy{false, queue.front(), partner});
      queue.pop_front();
    }
  }
  return out;
}

}  // namespace ce_overlap

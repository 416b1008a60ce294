// The watchdog: every group's in-flight ops timed from when their streams reached them, the diagnosis of an op
// that did not complete in time (which peer's flags never arrived, and what they said instead), the poison that
// drains a stuck stream, and the process-wide group registry that runs it (see group.h).
#include "group.h"

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

namespace ce_overlap {

namespace {

// Polls a stream without blocking in the driver: a hung stream must not hang the watchdog.
bool wait_stream_bounded(cudaStream_t stream, double seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (true) {
    cudaError_t st = cudaStreamQuery(stream);
    if (st == cudaSuccess) return true;
    if (st != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

std::string signal_text(const PeerSignal& s) {
  std::ostringstream o;
  o << op_kind_name(s.kind_round >> 24) << " (" << variant_name((s.kind_round >> 20) & 0xfu) << ") round "
    << (s.kind_round & 0xfffff) << ", " << s.nbytes << " bytes at pool offset " << s.offset << " (signature 0x"
    << std::hex << s.sig_a << "/0x" << s.sig_b << std::dec << ")";
  return o.str();
}

}  // namespace

void Group::synchronize(double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (true) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (failed_.load()) throw std::runtime_error(error());
      retire_completed_locked();  // marks the group failed on a CUDA error
      if (failed_.load()) throw std::runtime_error(error());
      if (pending_.empty()) return;
      if (Clock::now() > deadline) {
        throw std::runtime_error("ce_overlap.synchronize: group '" + name_ + "' (rank " + std::to_string(rank_) +
                                 ") still has " + std::to_string(pending_.size()) + " ops in flight after " +
                                 std::to_string(timeout_s) + " s, and the watchdog (RuntimeConfig.timeout_s=" +
                                 std::to_string(timeout_s_) + ") has not reported a stuck op");
      }
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void Group::watchdog_tick(Clock::time_point now) {
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock()) {
    // An enqueue (or synchronize / describe, briefly) holds the lock. Never wait for it: a CUDA call
    // inside an enqueue can block until our own streams drain, and only this thread can drain them.
    check_stuck_enqueue(now);
    return;
  }
  if (!open_ || pending_.empty()) return;
  if (cudaSetDevice(device_) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  retire_completed_locked();
  if (pending_.empty()) return;
  // Every in-flight op is timed from the moment its stream reached it: collectives start one after the other
  // on the comm stream, point-to-point ops on their own channels' streams, so any of them may be the stuck one.
  for (PendingOp& op : pending_) {
    if (op.started) continue;
    cudaError_t st = cudaEventQuery(op.start);
    if (st == cudaSuccess) {
      op.started = now;
    } else if (st != cudaErrorNotReady) {
      (void)cudaGetLastError();
    }
  }
  if (failed_.load()) {
    // Keep the comm stream draining: a late peer write can overwrite the poison with a smaller epoch.
    if (now - last_poison_ > std::chrono::seconds(1)) {
      poison();
      last_poison_ = now;
    }
    return;
  }
  for (PendingOp& op : pending_) {
    if (!op.started || now - *op.started <= std::chrono::duration<double>(timeout_s_)) continue;
    // Failed BEFORE poisoned: once the poison lands the op completes, and nobody may see it complete
    // without also seeing the failure.
    fail_locked(diagnose_timeout_locked(op, now));
    if (!poison()) append_error(" Releasing the stuck GPU stream failed too (the unblocking write did not complete in 2 s).");
    last_poison_ = now;
    return;
  }
}

void Group::append_error(const std::string& text) {
  std::lock_guard<std::mutex> lk(err_mu_);
  error_ += text;
}

void Group::check_stuck_enqueue(Clock::time_point now) {
  const int64_t since_ns = enqueue_since_ns_.load();
  if (since_ns == 0) return;
  const Clock::time_point since{std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(since_ns))};
  const double stuck_s = std::chrono::duration<double>(now - since).count();
  if (stuck_s <= timeout_s_) return;
  if (cudaSetDevice(device_) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (!failed_.load()) {
    std::ostringstream m;
    m << "ce_overlap: timeout: enqueueing an op on group '" << name_ << "' (rank " << rank_ << ", GPU " << device_
      << ") has been blocked inside a CUDA call for " << stuck_s << " s (limit " << timeout_s_
      << " s), most likely one that waits for the device to go idle while this group's comm stream waits for a peer"
      << " that never posts the matching signal (a peer that did not call the collective, or called a different"
      << " one). The group's flags were poisoned so its streams drain; the outputs of this op and of every later op"
      << " on this group are invalid, and the group refuses further ops (restart the job).";
    fail_locked(m.str());  // before the poison (see watchdog_tick)
    if (!poison()) append_error(" Releasing the stuck GPU stream failed too.");
    last_poison_ = now;
  } else if (now - last_poison_ > std::chrono::seconds(1)) {
    poison();
    last_poison_ = now;
  }
}

std::string Group::diagnose_timeout_locked(const PendingOp& op, Clock::time_point now) {
  std::ostringstream m;
  if (op.rounds.empty()) {
    return "ce_overlap: timeout: " + op.name + " #" + std::to_string(op.seq) + " on group '" + name_ + "' (rank " +
           std::to_string(rank_) + ", no peers) did not complete within " + std::to_string(timeout_s_) +
           " s: the local copy or reduction is stuck.";
  }
  const double waited = std::chrono::duration<double>(now - *op.started).count();
  m << "ce_overlap: timeout: " << op.name << " #" << op.seq;
  if (op.peer >= 0) {
    m << (op.kind == OpKind::Send ? " to rank " : " from rank ") << op.peer << " (" << op.nbytes_per_rank << " bytes, "
      << variant_name(static_cast<uint32_t>(op.variant)) << ", " << op.rounds.size() << " round(s), channel rounds ";
  } else {
    m << " (" << op.nbytes_per_rank << " bytes per rank, " << variant_name(static_cast<uint32_t>(op.variant)) << ", "
      << op.rounds.size() << " round(s), epochs ";
  }
  m << op.rounds.front().epoch << ".." << op.rounds.back().epoch << ") on group '" << name_ << "' did not complete within "
    << timeout_s_ << " s (waited " << waited << " s) on rank " << rank_ << " (GPU " << device_ << ").";

  bool readable = cudaMemcpyAsync(host_flags_, pool_->local_flags(), sizeof(FlagsRegion), cudaMemcpyDeviceToHost,
                                  watchdog_stream_) == cudaSuccess &&
                  wait_stream_bounded(watchdog_stream_, 2.0);
  if (!readable) {
    (void)cudaGetLastError();
    m << " The flags could not be read back (the GPU does not respond), so the peers cannot be named.";
  } else if (op.peer >= 0) {
    m << " " << diagnose_p2p(op);
  } else {
    std::vector<int> missing;
    std::ostringstream details;
    for (int i = 1; i < world_size_; ++i) {
      const int p = (rank_ + i) % world_size_;
      const PeerSignal& got = host_flags_->ready[p];
      const uint32_t done = host_flags_->done[p];
      std::string why;
      if (op.done_needed_before != 0 && !epoch_ge(done, op.done_needed_before)) {
        why = "it has not finished reading this rank's data of epoch " + std::to_string(op.done_needed_before) +
              " (its done flag is at epoch " + std::to_string(done) + ")";
      } else if (!epoch_ge(got.epoch, op.rounds.front().epoch)) {
        why = "it never signalled this op: its last ready signal is epoch " + std::to_string(got.epoch) +
              (got.epoch == 0 ? " (none)" : " (" + signal_text(got) + ")") + ", this op needs epoch " +
              std::to_string(op.rounds.front().epoch) + " -- it has not called the collective, or called fewer ops";
      } else {
        for (const RoundInfo& r : op.rounds) {
          if (got.epoch == r.epoch && ((got.sig_a & r.sig.sig_a) == 0 || (got.sig_b & r.sig.sig_b) == 0)) {
            PeerSignal ours{r.epoch, r.sig.sig_a, r.sig.sig_b, kind_round_word(op.kind, op.variant, r.round), r.nbytes,
                            r.offset};
            why = "it posted a different collective for epoch " + std::to_string(r.epoch) + ": " + signal_text(got) +
                  ", while this rank posted " + signal_text(ours) +
                  " -- mismatched sizes, dtypes or reduce ops, a symmetric tensor on one rank only, push on one rank"
                  " and pull on another, or ops called in a different order";
            break;
          }
          if (!epoch_ge(got.epoch, r.epoch)) {
            why = "it stopped after epoch " + std::to_string(got.epoch) + " and never signalled round " +
                  std::to_string(r.round) + " (epoch " + std::to_string(r.epoch) + ")";
            break;
          }
          if (op.push_style && !epoch_ge(done, r.epoch)) {
            why = "it signalled round " + std::to_string(r.round) + " (epoch " + std::to_string(r.epoch) +
                  ") but never finished writing its data into this rank (its done flag is at epoch " +
                  std::to_string(done) + ")";
            break;
          }
        }
        if (why.empty() && op.done_needed_after != 0 && !epoch_ge(done, op.done_needed_after)) {
          why = "it has not finished reading this rank's shard (done flag at epoch " + std::to_string(done) +
                ", needed " + std::to_string(op.done_needed_after) + ")";
        }
      }
      if (!why.empty()) {
        missing.push_back(p);
        details << " Rank " << p << ": " << why << ".";
      }
    }
    if (missing.empty()) {
      m << " Every peer's flags have arrived; the comm stream is stuck elsewhere (local copy or copy engine).";
    } else {
      m << " Peer ranks whose flags never arrived: [";
      for (size_t i = 0; i < missing.size(); ++i) m << (i ? ", " : "") << missing[i];
      m << "]." << details.str();
    }
  }
  m << " The GPU stream was released; the outputs of this op and of every later op on this group are invalid,"
    << " and the group refuses further ops (restart the job). Set RuntimeConfig.timeout_s (CE_OVERLAP_TIMEOUT_S) to change the limit.";
  return m.str();
}

std::string Group::diagnose_p2p(const PendingOp& op) const {
  const bool send = op.kind == OpKind::Send;
  const PeerSignal& got = send ? host_flags_->p2p_credit[op.peer] : host_flags_->p2p_landed[op.peer];
  const std::string who = "Rank " + std::to_string(op.peer);
  for (const RoundInfo& r : op.rounds) {
    const OpKind ours_kind = send ? OpKind::Send : OpKind::Recv;
    PeerSignal ours{r.epoch, r.sig.sig_a, r.sig.sig_b, kind_round_word(ours_kind, op.variant, r.round), r.nbytes, r.offset};
    if (!epoch_ge(got.epoch, r.epoch)) {
      std::string last = got.epoch == 0 ? "none" : "round " + std::to_string(got.epoch) + ": " + signal_text(got);
      return "Peer ranks whose flags never arrived: [" + std::to_string(op.peer) + "]. " + who +
             (send ? " has not posted the matching receive for channel round " : " has not sent channel round ") +
             std::to_string(r.epoch) + " (message round " + std::to_string(r.round) + ") of this message (its last " +
             (send ? "receive credit" : "landed signal") + ": " + last + ") -- it has not called " +
             (send ? "recv" : "send") + " (or batch_isend_irecv) for this message, called fewer, or is stuck before it.";
    }
    if (got.epoch == r.epoch && ((got.sig_a & r.sig.sig_a) == 0 || (got.sig_b & r.sig.sig_b) == 0)) {
      return "Peer ranks whose flags never arrived: [" + std::to_string(op.peer) + "]. " + who +
             " posted a different message for channel round " + std::to_string(r.epoch) + ": " + signal_text(got) +
             ", while this rank posted " + signal_text(ours) +
             " -- mismatched sizes, a symmetric tensor on one side only, or sends and receives matched in a different "
             "order.";
    }
  }
  return "Every signal of rank " + std::to_string(op.peer) + " has arrived; the stream is stuck elsewhere (a local "
         "copy or the copy engine).";
}

void Group::fail_locked(const std::string& message) {
  {
    std::lock_guard<std::mutex> lk(err_mu_);
    if (failed_.load()) return;
    error_ = message;
    failed_.store(true);
  }
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
}

bool Group::poison() {
  // Epoch values "far in the future" (cyclically) satisfy every GEQ wait of every enqueued op; the
  // all-ones signature satisfies every AND wait. Only the peer-written arrays are overwritten. Reads
  // only immutable state, epoch_hint_ and p2p_hint_, so it works while an enqueue holds the group lock (an op
  // enqueued after this write waits for epochs far below the poison, so it drains too).
  const uint32_t poison_epoch = epoch_hint_.load() + (1u << 29);
  const uint32_t poison_round = p2p_hint_.load() + (1u << 29);  // point-to-point channels count their own rounds
  for (int p = 0; p < world_size_; ++p) {
    host_poison_->ready[p] = PeerSignal{poison_epoch, 0xffffffffu, 0xffffffffu, 0, 0, 0};
    host_poison_->done[p] = poison_epoch;
    host_poison_->p2p_credit[p] = PeerSignal{poison_round, 0xffffffffu, 0xffffffffu, 0, 0, 0};
    host_poison_->p2p_landed[p] = PeerSignal{poison_round, 0xffffffffu, 0xffffffffu, 0, 0, 0};
  }
  const size_t bytes = offsetof(FlagsRegion, ready_outbox);
  if (cudaMemcpyAsync(pool_->local_flags(), host_poison_, bytes, cudaMemcpyHostToDevice, watchdog_stream_) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return wait_stream_bounded(watchdog_stream_, 2.0);
}

std::string Group::error() const {
  std::lock_guard<std::mutex> lk(err_mu_);
  return error_;
}

std::string Group::describe() {
  std::lock_guard<std::mutex> lk(mu_);
  std::ostringstream s;
  s << pool_->describe() << "; open=" << open_ << " ops=" << op_seq_ << " next_epoch=" << epoch_next_
    << " in_flight=" << pending_.size() << " timeout_s=" << timeout_s_ << " local_copy=" << local_copy_mode()
    << " pull_split=" << pull_split_.load() << " peer_lanes=" << peer_lanes_.load()
    << " copy_rate_gbps=" << copy_rate_gbps_.load() << " reduce_ctas=" << reduce_ctas_.load()
    << " rs_round_bytes=" << rs_round_bytes_.load() << " failed=" << failed_.load();
  return s.str();
}

// ---------------------------------------------------------------------------------------------------
// Runtime

Runtime& Runtime::get() {
  static Runtime* runtime = new Runtime();
  return *runtime;
}

std::shared_ptr<Group> Runtime::create_group(const std::string& name, int rank, int world_size, int device,
                                             const GroupConfig& config) {
  auto exists = [&] {
    throw std::runtime_error("ce_overlap: group '" + name + "' already has a symmetric pool on this process");
  };
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (groups_.count(name) || creating_.count(name)) exists();
    creating_.insert(name);
  }
  // Built without mu_: the constructor makes CUDA calls that can wait for the device (allocation, loading
  // the reduction kernels), and the watchdog thread, which takes mu_ every tick, must stay free to release
  // another group's stuck stream meanwhile.
  std::shared_ptr<Group> group;
  try {
    group = std::make_shared<Group>(name, rank, world_size, device, config);
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu_);
    creating_.erase(name);
    throw;
  }
  std::lock_guard<std::mutex> lk(mu_);
  creating_.erase(name);
  groups_[name] = group;
  start_watchdog_locked();
  return group;
}

std::shared_ptr<Group> Runtime::find(const std::string& name) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = groups_.find(name);
  return it == groups_.end() ? nullptr : it->second;
}

std::shared_ptr<Group> Runtime::require(const std::string& name, const char* op) {
  std::shared_ptr<Group> g = find(name);
  if (!g) {
    throw std::runtime_error(std::string("ce_overlap.") + op + ": group '" + name +
                             "' has no ce_overlap symmetric pool in this process; call "
                             "ce_overlap.runtime.rendezvous(group) on every rank first (outside CUDA graph capture)");
  }
  return g;
}

void Runtime::remove(const std::string& name) {
  std::shared_ptr<Group> doomed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = groups_.find(name);
    if (it == groups_.end()) return;
    doomed = it->second;
    groups_.erase(it);
  }
  // Destroyed here (outside mu_) unless the watchdog still holds it; then it dies after its tick.
}

std::optional<std::string> Runtime::first_failure() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& [name, g] : groups_) {
    if (g->failed()) return g->error();
  }
  return std::nullopt;
}

void Runtime::start_watchdog_locked() {
  if (watchdog_.joinable()) return;
  watchdog_ = std::thread([this] { watchdog_main(); });
  // Stop before the CUDA runtime's own atexit teardown (atexit handlers run in reverse order of
  // registration, and the CUDA runtime registered its handler when it initialized, before us).
  std::atexit([] { Runtime::get().stop_watchdog(); });
}

void Runtime::watchdog_main() {
  while (true) {
    std::vector<std::shared_ptr<Group>> groups;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait_for(lk, std::chrono::milliseconds(20), [this] { return stop_.load(); });
      if (stop_.load()) return;
      for (auto& [name, g] : groups_) groups.push_back(g);
    }
    const auto now = Clock::now();
    for (auto& g : groups) {
      try {
        g->watchdog_tick(now);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ce_overlap: watchdog error on group '%s': %s\n", g->name().c_str(), e.what());
      }
    }
  }
}

void Runtime::stop_watchdog() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

}  // namespace ce_overlap

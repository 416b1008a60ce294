"""A randomized model check of the CE runtime's signalling protocol, op for op as csrc/runtime/all_gather.cc (pull:
staged, zero-copy, in place; push) and csrc/runtime/reduce_scatter.cc enqueue it: per rank a caller, comm, self and
reduce stream (FIFO queues), flags written by peers, events. A random scheduler runs any stream whose head op is
ready; copies and kernels are two-phase (start/end) so other streams interleave. Pool memory carries content tags, so
a read of stale or half-written bytes, a write while someone reads, and a deadlock all raise `Race`.

It checks the protocol, not the C++: keep the `ag` / `rs` methods in step with the enqueue code. `bugs` switches off
one safeguard at a time; tests/runtime/test_protocol_model.py checks that each one is caught (the model has teeth).
Pure Python, no torch:  python tests/runtime/protocol_model.py 3000
"""
import random
import sys
from collections import deque


class Race(Exception):
    pass


class Ev:
    def __init__(self):
        self.last = None


class Op:
    _id = 0

    def __init__(self, kind, **kw):
        Op._id += 1
        self.id = Op._id
        self.kind = kind
        self.done = False
        self.__dict__.update(kw)


class World:
    def __init__(self, n, S, N, bugs=frozenset()):
        self.n, self.S, self.N = n, S, N
        self.bugs = bugs
        self.B = (n - 1) * S          # bank bytes
        self.U0 = 2 * self.B          # user region start (staging is [0, 2B))
        self.flags = [{"ready": [0] * n, "done": [0] * n} for _ in range(n)]
        self.mem = [[] for _ in range(n)]     # (lo, hi, tag)
        self.active = [[] for _ in range(n)]  # (lo, hi, mode, opid)
        self.streams = [{s: deque() for s in ("caller", "comm", "self", "red")} for _ in range(n)]
        self.epoch_next = [1] * n
        self.done_waited = [0] * n
        self.ev = [{k: Ev() for k in ("caller", "self", "arrived", "bank0", "bank1", "end")} for _ in range(n)]
        self.op_counter = 0

    # ---------- memory
    def write_start(self, r, lo, hi, opid):
        for (a, b, m, i) in self.active[r]:
            if a < hi and lo < b:
                raise Race(f"rank {r}: write [{lo},{hi}) while {m} [{a},{b}) active")
        self.active[r].append((lo, hi, "write", opid))

    def write_end(self, r, lo, hi, tag, opid):
        self.active[r] = [x for x in self.active[r] if x[3] != opid]
        segs = []
        for (a, b, t) in self.mem[r]:
            if b <= lo or a >= hi:
                segs.append((a, b, t))
            else:
                if a < lo:
                    segs.append((a, lo, t))
                if b > hi:
                    segs.append((hi, b, t))
        segs.append((lo, hi, tag))
        self.mem[r] = sorted(segs)

    def read_start(self, r, lo, hi, tag, opid, what):
        for (a, b, m, i) in self.active[r]:
            if m == "write" and a < hi and lo < b:
                raise Race(f"rank {r}: read [{lo},{hi}) ({what}) while write [{a},{b}) active")
        covered = lo
        for (a, b, t) in self.mem[r]:
            if b <= lo or a >= hi:
                continue
            if t != tag:
                raise Race(f"rank {r}: {what} read [{lo},{hi}) found tag {t}, expected {tag}")
        # coverage
        pts = sorted((max(a, lo), min(b, hi)) for (a, b, t) in self.mem[r] if a < hi and b > lo)
        for (a, b) in pts:
            if a > covered:
                break
            covered = max(covered, b)
        if covered < hi:
            raise Race(f"rank {r}: {what} read [{lo},{hi}) of unwritten memory (expected {tag})")
        self.active[r].append((lo, hi, "read", opid))

    def read_end(self, r, opid):
        self.active[r] = [x for x in self.active[r] if x[3] != opid]

    # ---------- enqueue helpers
    def q(self, r, s, op):
        self.streams[r][s].append(op)
        op.rank = r
        return op

    def record(self, r, s, evname):
        op = self.q(r, s, Op("record"))
        self.ev[r][evname].last = op

    def wait_ev(self, r, s, evname):
        self.q(r, s, Op("waitev", target=self.ev[r][evname].last))

    def wait_flag(self, r, s, kind, p, v):
        self.q(r, s, Op("waitflag", fkind=kind, peer=p, value=v))

    def wait_peers_done(self, r, e):
        if self.done_waited[r] >= e:
            return
        for i in range(1, self.n):
            self.wait_flag(r, "comm", "done", (r + i) % self.n, e)
        self.done_waited[r] = e

    def post_ready(self, r, e):
        for i in range(1, self.n):
            self.q(r, "comm", Op("setflag", dst=(r + i) % self.n, fkind="ready", src_rank=r, value=e))

    def post_done(self, r, p, e):
        self.q(r, "comm", Op("setflag", dst=p, fkind="done", src_rank=r, value=e))

    def copy(self, r, s, reads, writes):
        """reads: list of (rank, lo, hi, tag, what); writes: list of (rank, lo, hi, tag)."""
        start = self.q(r, s, Op("cstart", reads=reads, writes=writes))
        self.q(r, s, Op("cend", start=start))

    # ---------- ops (mirrors of the C++ enqueue sequences)
    def caller_prep(self, r, writes):
        if writes:
            self.copy(r, "caller", [], writes)
        self.record(r, "caller", "caller")
        self.wait_ev(r, "comm", "caller")

    def finish(self, r, in_place, caller_reads):
        if not in_place:
            self.wait_ev(r, "comm", "self")
        self.record(r, "comm", "end")
        self.wait_ev(r, "caller", "end")
        if caller_reads:
            self.copy(r, "caller", caller_reads, [])

    def ag(self, r, opid, variant, N, staged_rounds=1):
        n = self.n
        O = self.U0           # symmetric output at user offset 0 (reused by every op: tests reuse hazards)
        X = self.U0 + n * N   # symmetric input
        in_place = variant in ("inplace", "push_inplace")
        preps = []
        if variant == "symm_input":
            preps.append((r, X, X + N, ("ag", opid, r)))
        if in_place:
            preps.append((r, O + r * N, O + (r + 1) * N, ("ag", opid, r)))
        self.caller_prep(r, preps)
        if not in_place:  # self copy: reads private input (or the symmetric input), writes out[r]
            self.wait_ev(r, "self", "caller")
            out_pool = variant in ("push_from_input",)
            reads = [(r, X, X + N, ("ag", opid, r), "self copy src")] if variant == "symm_input" else []
            writes = [(r, O + r * N, O + (r + 1) * N, ("ag", opid, r))] if out_pool else []
            self.copy(r, "self", reads, writes)
            self.record(r, "self", "self")
        out_in_pool = variant in ("inplace", "push_inplace", "push_from_input")
        if variant.startswith("push"):
            e = self.epoch_next[r]
            self.epoch_next[r] += 1
            self.wait_peers_done(r, e - 1)
            self.post_ready(r, e)
            for i in range(1, n):
                p = (r + i) % n
                self.wait_flag(r, "comm", "ready", p, e)
                reads = [(r, O + r * N, O + (r + 1) * N, ("ag", opid, r), "push src")] if in_place else []
                self.copy(r, "comm", reads, [(p, O + r * N, O + (r + 1) * N, ("ag", opid, r))])
                self.post_done(r, p, e)
            if "push_no_final_done_wait" not in self.bugs:
                self.wait_peers_done(r, e)
        else:
            rounds = staged_rounds if variant == "staged" else 1
            for k in range(rounds):
                e = self.epoch_next[r]
                self.epoch_next[r] += 1
                if "no_done_wait_before_round" not in self.bugs:
                    self.wait_peers_done(r, e - 1)
                if variant == "staged":
                    self.copy(r, "comm", [], [(r, 0, 2 * self.B, ("ag", opid, k, r))])
                self.post_ready(r, e)
                for i in range(1, n):
                    p = (r + i) % n
                    self.wait_flag(r, "comm", "ready", p, e)
                    if variant == "staged":
                        src = (p, 0, 2 * self.B, ("ag", opid, k, p), "pull staged")
                    elif variant == "symm_input":
                        src = (p, X, X + N, ("ag", opid, p), "pull zero-copy")
                    else:
                        src = (p, O + p * N, O + (p + 1) * N, ("ag", opid, p), "pull in place")
                    writes = [(r, O + p * N, O + (p + 1) * N, ("ag", opid, p))] if out_in_pool else []
                    self.copy(r, "comm", [src], writes)
                    self.post_done(r, p, e)
            if variant != "staged" and "zero_copy_no_final_wait" not in self.bugs:
                self.wait_peers_done(r, e)
        caller_reads = [(r, O + q * N, O + (q + 1) * N, ("ag", opid, q), "caller reads out") for q in range(n)] \
            if out_in_pool else []
        self.finish(r, in_place, caller_reads)

    def rs(self, r, opid, rounds):
        n, S, B = self.n, self.S, self.B
        self.caller_prep(r, [])
        for k in range(rounds):
            bank = 0 if "rs_one_bank" in self.bugs else k % 2
            e = self.epoch_next[r]
            self.epoch_next[r] += 1
            self.wait_peers_done(r, e - 1)
            if k >= 2 and "rs_no_bank_wait" not in self.bugs:
                self.wait_ev(r, "comm", f"bank{bank}")
            self.post_ready(r, e)
            for i in range(1, n):
                p = (r + i) % n
                self.wait_flag(r, "comm", "ready", p, e)
                slot = r if r < p else r - 1
                lo = bank * B + slot * S
                self.copy(r, "comm", [], [(p, lo, lo + S, ("rs", opid, k, r))])
                self.post_done(r, p, e)
            if "rs_no_arrival_wait" not in self.bugs:
                self.wait_peers_done(r, e)
            self.record(r, "comm", "arrived")
            self.wait_ev(r, "red", "arrived")
            reads = []
            for q in range(n):
                if q == r:
                    continue
                slot = q if q < r else q - 1
                lo = bank * B + slot * S
                reads.append((r, lo, lo + S, ("rs", opid, k, q), f"reduction slot of {q}"))
            self.copy(r, "red", reads, [])
            self.record(r, "red", f"bank{bank}")
        if rounds > 0 and "rs_no_final_join" not in self.bugs:
            self.wait_ev(r, "comm", f"bank{(rounds - 1) % 2}")
        self.record(r, "comm", "end")
        self.wait_ev(r, "caller", "end")

    # ---------- execution
    def ready(self, op):
        if op.kind == "waitev":
            return op.target is None or op.target.done
        if op.kind == "waitflag":
            return self.flags[op.rank][op.fkind][op.peer] >= op.value
        return True

    def run(self, op):
        if op.kind == "setflag":
            f = self.flags[op.dst][op.fkind]
            f[op.src_rank] = op.value
        elif op.kind == "cstart":
            for (rr, lo, hi, tag, what) in op.reads:
                self.read_start(rr, lo, hi, tag, op.id, what)
            for (rr, lo, hi, tag) in op.writes:
                self.write_start(rr, lo, hi, op.id)
        elif op.kind == "cend":
            s = op.start
            for (rr, lo, hi, tag, what) in s.reads:
                self.read_end(rr, s.id)
            for (rr, lo, hi, tag) in s.writes:
                self.write_end(rr, lo, hi, tag, s.id)
        op.done = True

    def execute(self, rng):
        while True:
            cands = []
            for r in range(self.n):
                for s, dq in self.streams[r].items():
                    if dq and self.ready(dq[0]):
                        cands.append(dq)
            if not cands:
                left = sum(len(dq) for r in range(self.n) for dq in self.streams[r].values())
                if left:
                    heads = [(r, s, dq[0].kind, getattr(dq[0], "fkind", ""), getattr(dq[0], "value", ""))
                             for r in range(self.n) for s, dq in self.streams[r].items() if dq]
                    raise Race(f"DEADLOCK with {left} ops left; heads {heads}")
                return
            dq = rng.choice(cands)
            self.run(dq.popleft())


KINDS = ["rs", "staged", "symm_input", "inplace", "push_inplace", "push_from_input"]


def one(seed, bugs=frozenset(), kinds=KINDS):
    """One random group size, op sequence (the same on every rank) and schedule. Raises Race."""
    rng = random.Random(seed)
    n = rng.choice([2, 3, 4])
    w = World(n, S=100, N=37, bugs=bugs)
    seq = []
    for j in range(rng.randint(3, 10)):
        kind = rng.choice(kinds)
        seq.append((kind, rng.randint(1, 5)))
    # Host enqueue: interleave ranks op by op in random order (host threads are independent).
    for j, (kind, rounds) in enumerate(seq):
        for r in rng.sample(range(n), n):
            if kind == "rs":
                w.rs(r, j, rounds)
            else:
                w.ag(r, j, kind, 37, staged_rounds=rounds)
    w.execute(rng)
    return n, seq


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    for seed in range(count):
        try:
            one(seed)
        except Race as e:
            print("seed", seed, "FAILED:", e)
            sys.exit(1)
    print(f"{count} random schedules: no race, no stale read, no deadlock")

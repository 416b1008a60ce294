"""The collectives `ce-overlap calibrate` and bench/cost_model_validation.py measure, on one process group: NCCL and
the ce_overlap copy-engine all-gather / reduce-scatter (checked against NCCL's result first) and send/recv, and
the compute kernels' slowdown beside each of them. torch is imported when a measurement runs."""
from __future__ import annotations

from typing import Callable

from .common import MIB, Progress, format_bytes, one_line
from .kernels import make_compute
from .timing import NotAvailable, all_ranks_ok, dist_if_initialized, measure_beside, median_us, torch_module


def pool_config(max_bytes_per_rank: int, world: int):
    """The RuntimeConfig of the measured group: a symmetric pool big enough for the in-place all-gather output and a
    whole reduce-scatter input staged in one round, a 30 s timeout; a field its CE_OVERLAP_* variable sets keeps the
    variable's value (the environment overrides calibrate's choice, as it overrides every default)."""
    from .. import environment
    from ..runtime.config import RuntimeConfig

    mb = -(-max_bytes_per_rank // MIB)
    wanted = {"staging_mb": float(world * mb), "pool_mb": float(3 * world * mb + 64), "timeout_s": 30.0}
    return RuntimeConfig.from_env(**{field: value for field, value in wanted.items()
                                     if environment.read(RuntimeConfig.ENV[field]) in (None, "")})


class Collectives:
    """Sets up and runs the collectives that calibrate and bench/cost_model_validation.py measure, on one group.

    Sizes are per rank: all-gather moves a shard of `nbytes` per rank (IR bytes = nbytes), reduce-scatter leaves
    `nbytes` per rank (input world x nbytes = the IR bytes), send/recv moves `nbytes` from rank 0 to rank 1.
    The CE all-gather is the in-place one on symmetric memory (the own shard is not copied), which is what the cost
    model describes."""

    def __init__(self, group, max_bytes: int):
        torch, dist = torch_module(), dist_if_initialized()
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.max_bytes = max_bytes
        self.ce_reason = ""
        self.ce_rs_reason = ""
        self._sym = None
        self._rs_call = None
        self._rs_candidates = None
        try:
            import ce_overlap.runtime as rt

            ok, reason = rt.available()
            if not ok:
                raise NotAvailable(reason)
            rt.rendezvous(group, pool_config(max_bytes, self.world))
            self._sym = rt.empty_symmetric((self.world * (max_bytes // 2),), torch.bfloat16, group)
        except NotAvailable as e:
            self.ce_reason = str(e)
        except Exception as e:  # noqa: BLE001 (CE is optional: report why it is off)
            self.ce_reason = one_line(e)
        if not all_ranks_ok(not self.ce_reason):
            self.ce_reason = self.ce_reason or "the ce_overlap runtime is not available on every rank"
        if self.ce_reason:
            self.ce_rs_reason = self.ce_reason
        else:
            self._rs_candidates, self.ce_rs_reason = self._find_ce_reduce_scatter()
            if not all_ranks_ok(self._rs_candidates is not None):
                self._rs_candidates, self.ce_rs_reason = None, self.ce_rs_reason or "not available on every rank"

    def _find_ce_reduce_scatter(self):
        """(callables to try in order, '') or (None, why not). Each callable is fn(out, inp); check() keeps the first
        that gives NCCL's result."""
        torch = torch_module()
        import ce_overlap.runtime as rt

        try:
            op = torch.ops.ce_overlap.reduce_scatter_tensor
        except (AttributeError, RuntimeError):
            return None, "torch.ops.ce_overlap.reduce_scatter_tensor is not in this build of the runtime"
        name = self.group.group_name
        candidates = []
        if hasattr(rt, "reduce_scatter_tensor"):  # the Python wrapper, by analogy with all_gather_into_tensor
            candidates.append(lambda out, inp: rt.reduce_scatter_tensor(out, inp, group=self.group))
        try:  # the functional op: map its schema's arguments by name
            schema = op.default._schema
            args = []
            for a in schema.arguments:
                if str(a.type).startswith("Tensor") and not args:
                    args.append("input")
                elif "op" in a.name:
                    args.append("sum")
                elif a.name == "group_size":
                    args.append(self.world)
                elif a.name == "group_name":
                    args.append(name)
                elif a.has_default_value():
                    break
                else:
                    raise ValueError(f"unknown argument {a.name!r} in {schema}")

            def call(out, inp):
                res = op(*[inp if a == "input" else a for a in args])
                out.copy_(res)  # the functional op returns a new tensor; the copy is a small local kernel

            candidates.append(call)
        except Exception as e:  # noqa: BLE001
            if not candidates:
                return None, f"cannot call torch.ops.ce_overlap.reduce_scatter_tensor: {e}"
        return candidates, ""

    @property
    def ce_reduce_scatter_verified(self) -> bool:
        """Whether verify() found a way to call the CE reduce-scatter that gives NCCL's result."""
        return self._rs_call is not None

    def backends(self, coll: str) -> dict[str, str]:
        """backend -> '' if it can run, else why not."""
        if coll in ("send", "recv"):
            return {"nccl": ""}
        if coll == "all_gather":
            return {"nccl": "", "ce": self.ce_reason}
        return {"nccl": "", "ce": self.ce_rs_reason or ("" if self._rs_call else "not checked against NCCL (verify())")}

    def runner(self, coll: str, backend: str, nbytes: int) -> tuple[Callable[[], None], Callable[[], None]]:
        """(run one op on the current stream, settle) for this collective at `nbytes` per rank."""
        torch, dist = torch_module(), dist_if_initialized()
        count = max(1, nbytes // 2)
        w, g = self.world, self.group
        if backend == "ce":
            import ce_overlap.runtime as rt

            def sync():
                rt.synchronize(g)
                torch.cuda.synchronize()
        else:
            sync = torch.cuda.synchronize
        if coll == "all_gather" and backend == "nccl":
            inp = torch.randint(-8, 8, (count,), device="cuda").to(torch.bfloat16)
            out = torch.empty(w * count, dtype=torch.bfloat16, device="cuda")
            return (lambda: dist.all_gather_into_tensor(out, inp, group=g)), sync
        if coll == "all_gather" and backend == "ce":
            if nbytes > self.max_bytes:
                raise NotAvailable(f"{format_bytes(nbytes)} is above the symmetric buffer's {format_bytes(self.max_bytes)}")
            out = self._sym[: w * count]
            shard = out.view(w, count)[self.rank]
            shard.copy_(torch.randint(-8, 8, (count,), device="cuda").to(torch.bfloat16))
            return (lambda: rt.all_gather_into_tensor(out, shard, g)), sync
        if coll == "reduce_scatter":
            inp = torch.randint(-8, 8, (w * count,), device="cuda").to(torch.bfloat16)
            out = torch.empty(count, dtype=torch.bfloat16, device="cuda")
            if backend == "nccl":
                return (lambda: dist.reduce_scatter_tensor(out, inp, group=g)), sync
            if self._rs_call is None:
                raise NotAvailable(self.ce_rs_reason)
            call = self._rs_call
            return (lambda: call(out, inp)), sync
        if coll in ("send", "recv"):
            buf = torch.zeros(count, dtype=torch.bfloat16, device="cuda")
            if self.rank == 0:
                return (lambda: dist.send(buf, 1, group=g)), sync
            if self.rank == 1:
                return (lambda: dist.recv(buf, 0, group=g)), sync
            return (lambda: None), sync
        raise ValueError((coll, backend))

    def _check(self, coll: str, nbytes: int, rs_call=None) -> str:
        """'' when the CE op gives NCCL's result bit for bit on small integers (exact in bf16), else why not.
        TypeError (a call that does not fit the op) propagates: nothing was enqueued."""
        torch, dist = torch_module(), dist_if_initialized()
        import ce_overlap.runtime as rt

        count = nbytes // 2
        try:
            if coll == "all_gather":
                fn, settle = self.runner(coll, "ce", nbytes)
                fn()
                settle()
                got = self._sym[: self.world * count].clone()
                shard = got.view(self.world, count)[self.rank].contiguous()
                want = torch.empty_like(got)
                dist.all_gather_into_tensor(want, shard, group=self.group)
            else:
                g = torch.Generator(device="cuda")
                g.manual_seed(17 + self.rank)
                inp = torch.randint(-8, 8, (self.world * count,), device="cuda", generator=g).to(torch.bfloat16)
                got = torch.empty(count, dtype=torch.bfloat16, device="cuda")
                want = torch.empty_like(got)
                rs_call(got, inp)
                rt.synchronize(self.group)
                dist.reduce_scatter_tensor(want, inp, group=self.group)
            torch.cuda.synchronize()
            bad = int((got != want).sum().item())
            return "" if bad == 0 else f"{bad} of {got.numel()} elements differ from NCCL's result"
        except TypeError:
            raise
        except Exception as e:  # noqa: BLE001
            return one_line(e)

    def verify(self, nbytes: int = 1 << 16) -> dict[str, str]:
        """Checks the CE ops against NCCL once (all ranks agree on the verdict); turns off what fails. Returns
        {what: why} for everything CE that will not be measured."""
        na: dict[str, str] = {}
        if self.ce_reason:
            return {"ce": self.ce_reason}
        try:
            bad = self._check("all_gather", nbytes)
        except TypeError as e:
            bad = f"TypeError: {e}"
        if not all_ranks_ok(not bad):
            self.ce_reason = self.ce_rs_reason = f"wrong result: {bad or 'on another rank'}"
            self._rs_candidates = None
            return {"ce": self.ce_reason}
        errors = []
        for call in self._rs_candidates or []:
            try:
                bad = self._check("reduce_scatter", nbytes, call)
            except TypeError as e:  # this way of calling does not fit the op; try the next
                bad = f"TypeError: {str(e).splitlines()[0][:200]}"
            if all_ranks_ok(not bad):
                self._rs_call = call
                break
            errors.append(bad or "wrong result on another rank")
        if self._rs_candidates is not None and self._rs_call is None:
            self.ce_rs_reason = "; ".join(errors)
        if self.ce_rs_reason:
            na["ce reduce_scatter"] = self.ce_rs_reason
        return na


def measure_slowdowns(cols: Collectives, nbytes: int, iters: int, warmup: int, prog: Progress | None = None,
                      pairs: list[tuple[str, str]] | None = None) -> list[dict]:
    """GEMM (bf16 8192^3) and memory-bound slowdowns beside each collective/backend at `nbytes` per rank, and the
    collective's own time beside them."""
    torch, dist = torch_module(), dist_if_initialized()
    out = []
    pairs = pairs or [("all_gather", "nccl"), ("all_gather", "ce"), ("reduce_scatter", "nccl"), ("reduce_scatter", "ce")]
    for compute in ("gemm", "memory_bound"):
        cfn, _ = make_compute(compute)
        for coll, backend in pairs:
            reason = cols.backends(coll).get(backend, "unknown backend")
            if reason:
                if prog:
                    prog.step(f"{compute} beside {coll} {backend}: skipped")
                continue
            fn, settle = cols.runner(coll, backend, nbytes)
            dist.barrier()
            coll_alone = median_us(fn, iters, warmup, settle)
            comp_alone = median_us(cfn, iters, warmup)
            dist.barrier()
            comp_beside, coll_beside = measure_beside(cfn, fn, settle, comp_alone, coll_alone, iters)
            out.append({"collective": coll, "backend": backend, "group_size": cols.world,
                        "bytes": cols.world * nbytes if coll == "reduce_scatter" else nbytes,
                        "bytes_per_rank": nbytes, "compute": compute, "compute_alone_us": comp_alone,
                        "compute_beside_us": comp_beside, "collective_alone_us": coll_alone,
                        "collective_beside_us": coll_beside})
            del fn
            if prog:
                prog.step(f"{compute} beside {coll} {backend}: {(comp_beside / comp_alone - 1) * 100:+.1f}%")
        del cfn
        torch.cuda.empty_cache()
    return out

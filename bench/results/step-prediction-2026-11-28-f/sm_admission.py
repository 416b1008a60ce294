"""Does a kernel of a few CTAs wait for the SMs a persistent GEMM holds? One GPU, no NCCL. A stand-in for an NCCL
kernel (a Triton copy of CTAS programs, each looping over its share of a buffer, as NCCL's channels do) is launched on
a second stream while the step's GEMM shapes run back to back on the first, at several offsets into a GEMM; each
kernel's start and duration come from the profiler. If the stand-in's CTAs cannot be placed while a GEMM CTA fills
an SM (nvjet: one CTA per SM, 384 threads x 168 registers = the whole register file), the stand-in launched mid-GEMM
starts when the GEMM ends, or runs for as long as the GEMM has left. Run on a GPU from the repository root:

    python bench/results/step-prediction-2026-11-28-f/sm_admission.py > sm-admission.txt
"""
import statistics

import torch
import triton
import triton.language as tl

SHAPES = [(4096, 14336, 4096), (4096, 4096, 4096), (4096, 1024, 4096)]  # (m, n, k): the 8B step's GEMMs


@triton.jit
def _copy(src, dst, n, per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid * per_prog
    for off in range(start, start + per_prog, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        mask = idx < n
        tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)


def stand_in(src, dst, ctas):
    n = src.numel()
    per = -(-n // ctas)
    per = -(-per // 4096) * 4096
    _copy[(ctas,)](src, dst, n, per, BLOCK=4096, num_warps=8)


def is_gemm(name: str) -> bool:
    return name.startswith("nvjet") or "gemm" in name.lower() or "cutlass" in name.lower()


def kernels(prof):
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            out.append((e.time_range.start, e.time_range.elapsed_us(), e.name))
    return sorted(out)


def main():
    dev = torch.device("cuda")
    s_gemm, s_side = torch.cuda.Stream(), torch.cuda.Stream()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "SMs",
          torch.cuda.get_device_properties(0).multi_processor_count)
    for mib, ctas in ((1, 2), (16, 16), (64, 32)):
        src = torch.randn(mib << 18, device=dev)  # fp32: mib MiB
        dst = torch.empty_like(src)
        for m, n, k in SHAPES:
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
            for _ in range(3):
                a @ b
                stand_in(src, dst, ctas)
            torch.cuda.synchronize()
            # alone
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    a @ b
                torch.cuda.synchronize()
                for _ in range(10):
                    stand_in(src, dst, ctas)
                torch.cuda.synchronize()
            ks = kernels(prof)
            gemm_alone = statistics.median(d for _, d, nm in ks if is_gemm(nm))
            gemm_name = next(nm for _, _, nm in ks if is_gemm(nm))
            side_alone = statistics.median(d for _, d, nm in ks if "_copy" in nm)
            rows = []
            for frac in (0.1, 0.3, 0.5, 0.7, 0.9):
                cycles = int(gemm_alone * frac * 1.98e3)  # ~1.98 GHz boost clock: cycles per us
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(8):
                        torch.cuda.synchronize()
                        with torch.cuda.stream(s_side):
                            torch.cuda._sleep(cycles + 20000)  # the GEMM goes first: ~10 us of launch slack
                            stand_in(src, dst, ctas)
                        with torch.cuda.stream(s_gemm):
                            torch.cuda._sleep(20000)
                            a @ b
                    torch.cuda.synchronize()
                ks = kernels(prof)
                gemms = [x for x in ks if is_gemm(x[2])]
                sides = [x for x in ks if "_copy" in x[2]]
                assert len(gemms) == len(sides) == 8, (len(gemms), len(sides), sorted({x[2] for x in ks}))
                for (gs, gd, _), (ss, sd, _) in zip(gemms, sides):
                    rows.append((frac, ss - gs, sd, gd, gs + gd - ss))  # profiler times: us
            print(f"\nstand-in {mib} MiB over {ctas} CTAs (alone {side_alone:.1f} us) beside GEMM {m}x{n}x{k} "
                  f"(alone {gemm_alone:.1f} us, {gemm_name})")
            print("  stand-in starts after the GEMM's start, us | stand-in runs us | GEMM runs us | GEMM left at the "
                  "stand-in's start us")
            for frac in sorted({r[0] for r in rows}):
                rs = [r for r in rows if r[0] == frac]
                med = lambda j: statistics.median(r[j] for r in rs)
                print(f"  {med(1):8.1f} us | {med(2):8.1f} | {med(3):8.1f} | {med(4):8.1f}")


if __name__ == "__main__":
    main()

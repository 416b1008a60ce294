import json, sys, time, torch
from ce_overlap.calibrate.kernels import measure_compute_grid
from ce_overlap.calibrate.timing import kernel_medians_us, median_us
a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda"); b = torch.randn_like(a); c = torch.empty_like(a)
print("smoke: mm kernel us", kernel_medians_us([lambda: torch.mm(a, b, out=c), lambda: torch.add(a, b, out=c)], 20, 5),
      "events", median_us(lambda: torch.mm(a, b, out=c), 20, 5), flush=True)
t = time.time()
g = measure_compute_grid(20, 5, log=lambda s: print(s, round(time.time() - t, 1), flush=True))
g["meta"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda, "iters": 20,
             "warmup": 5, "seconds": round(time.time() - t, 1),
             "command": "measure_compute_grid(20, 5) (ce-overlap calibrate --compute-grid --iters 20 --warmup 5)",
             "timing": "kernel durations (torch.profiler), calibrate/timing.py kernel_medians_us"}
json.dump(g, open(sys.argv[1], "w"), indent=1)
for r in g["memory"]:
    print(r["name"], r["mib"], round(r["bytes"] / r["us"] / 4800e3, 3))

import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(0)
for dtype in (torch.float32, torch.bfloat16):
    for n in (1, 7, 1001, 4096 * 3 + 1):
        g = torch.Generator().manual_seed(100 + r)
        inp_cpu = torch.randint(-8, 8, (w * n,), generator=g).to(dtype)
        full = [torch.empty_like(inp_cpu) for _ in range(w)]
        dist.all_gather(full, inp_cpu)
        want = torch.stack([f.float() for f in full]).sum(0).view(w, n)[r].to(dtype)
        for how in ("dist", "functional"):
            inp = inp_cpu.cuda()
            out = torch.empty(n, dtype=dtype, device="cuda")
            try:
                if how == "dist":
                    dist.reduce_scatter_tensor(out, inp)
                else:
                    name = dist.group.WORLD.group_name
                    out = torch.ops._c10d_functional.wait_tensor(
                        torch.ops._c10d_functional.reduce_scatter_tensor(inp, "sum", w, name))
                torch.cuda.synchronize()
                bad = (out.cpu().float() != want.float()).sum().item()
                print(f"rank {r} {dtype} n={n} {how}: wrong {bad} of {n}", flush=True)
            except Exception as e:
                print(f"rank {r} {dtype} n={n} {how}: {type(e).__name__}: {str(e)[:200]}", flush=True)
dist.destroy_process_group()

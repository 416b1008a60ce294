"""The cost model's compute on models it was not fitted to: each model of MODELS at world size 1, measured on one GPU
and predicted by the cost model (ce_overlap.analyzer.step_model), side by side with the kernel time per class on both sides.

Measured (on a GPU, each model in a process of its own): the model under `ce_overlap.fully_shard` (each block, then the
root; bf16 parameters, MixedPrecisionPolicy), compiled whole with ce_overlap's pass (the loss inside), fused AdamW;
steps timed as bench/train.py times them (CUDA events between step ends, the host never waits inside the loop, Python's
collector off with a generation-1 collection every 50 steps), the host's time to issue each step beside it, then the
GPU kernel time per class over a few steps run after 1.5 s of the same (bench/lib/kernel_profile.py). Predicted (no GPU:
--predict): the same model captured at world size 1 on fake CUDA tensors and priced by the built-in profile.

    python bench/compute_models.py --out measured.json                       # on the GPU box
    python bench/compute_models.py --predict --measured measured.json --out compute-models.json   # anywhere
    python bench/compute_models.py --predict --models gpt2-1024 --profile h200-sxm

Prints one table (model, measured / predicted ms, error, host ms) and, with --measured, each model's kernel classes
(predicted vs measured). The JSON's rows: {"model", "predicted_ms", "measured_ms", ...}.

Host time (issue 56): `--setups fully_shard,plain,fsdp2` measures each model also unsharded (fp32 weights under bf16
autocast, compiled whole) and under FSDP2 as torchtitan runs it (each block compiled, then sharded, bf16 parameters), and `--host-profile` adds the host's time to issue one step on an idle device, the step
with a sync after, and cProfile's functions over 10 steps (HOST_MODELS holds that issue's host-bound shapes).
`--host-bound` runs each model at batch 1 and HOST_SEQ tokens, where the host bounds the step; `--paired N` measures
the setups side by side in one process (measure_paired: the host's speed drifts between processes more than the
difference measured); `--world N` puts N ranks on GPU 0, every collective on the copy engines (fully_shard only).
bench/fit_host.py fits the profile's host section to such rows.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SCHEMA = "ce_overlap.compute_models/1"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model of the table: a zoo Llama (`zoo`) or a test model file's class (`file`, `cls`, its config class
    `config` with `overrides`); `inputs` "tokens" (tokens and labels of the config's batch x seq_len) or "images"."""
    what: str
    zoo: str = ""
    layers: int = 0
    seq_len: int = 0
    batch: int = 1
    file: str = ""
    cls: str = ""
    config: str = ""
    overrides: tuple = ()
    inputs: str = "tokens"


# Shapes chosen so the GPU, not the host, bounds each step (issue 56 is the host-bound case): the host's ms per step is
# measured beside every row.
MODELS = {
    "llama3-1b": ModelSpec("zoo Llama-3-1B widths, 4 layers, seq 4096, batch 1", zoo="llama3-1b", layers=4,
                           seq_len=4096),
    "llama3-8b": ModelSpec("zoo Llama-3-8B widths, 4 layers, seq 4096, batch 1", zoo="llama3-8b", layers=4,
                           seq_len=4096),
    "gpt2-1024": ModelSpec("GPT-2 style (LayerNorm, GELU, biases, tied), width 1024, 16 heads, 12 layers, seq 1024, "
                           "batch 24", file="tests/data/gpt2_tied.py", cls="Gpt2", config="Gpt2Config",
                           overrides=(("vocab_size", 50257), ("n_ctx", 1024), ("dim", 1024), ("n_heads", 16),
                                      ("n_layers", 12), ("seq_len", 1024), ("batch", 24))),
    "gpt2-2048": ModelSpec("GPT-2 style, width 2048, 16 heads, 8 layers, seq 2048, batch 4",
                           file="tests/data/gpt2_tied.py", cls="Gpt2", config="Gpt2Config",
                           overrides=(("vocab_size", 50257), ("n_ctx", 2048), ("dim", 2048), ("n_heads", 16),
                                      ("n_layers", 8), ("seq_len", 2048), ("batch", 4))),
    "moe-2048": ModelSpec("MoE (shared + 4 routed experts, top 2, dense dispatch, QK-norm, GQA 16/4), width 2048, "
                          "6 layers, seq 2048, batch 4", file="tests/data/moe.py", cls="Moe", config="MoeConfig",
                          overrides=(("vocab_size", 32000), ("dim", 2048), ("n_layers", 6), ("n_heads", 16),
                                     ("n_kv_heads", 4), ("n_experts", 4), ("top_k", 2), ("expert_hidden", 2816),
                                     ("seq_len", 2048), ("batch", 4))),
    "vit-b16": ModelSpec("ViT-B/16 (conv patches, class token, LayerNorm, GELU), 224 px, 12 layers, batch 256",
                         file="tests/data/vit.py", cls="Vit", config="VitConfig", inputs="images",
                         overrides=(("image", 224), ("patch", 16), ("dim", 768), ("n_heads", 12), ("n_layers", 12),
                                    ("classes", 1000), ("batch", 256))),
    "titan-flex": ModelSpec("torchtitan-shaped Llama (flex attention, complex RoPE, GQA 32/8), width 2048, 4 layers, "
                            "seq 4096, batch 1", file="tests/data/titan_llama.py", cls="WithLoss",
                            config="TitanConfig",
                            overrides=(("vocab_size", 128256), ("dim", 2048), ("n_layers", 4), ("n_heads", 32),
                                       ("n_kv_heads", 8), ("ffn_dim", 8192), ("seq_len", 4096), ("batch", 1))),
}
# Issue 56's host-bound shapes (the host, not the GPU, bounds these steps): measured with --setups fully_shard,plain
# --host-profile, not part of the seven-model check.
HOST_MODELS = {
    "gpt2-1536-host": ModelSpec("GPT-2 style, width 1536, 12 heads, 8 layers, seq 1024, batch 4",
                                file="tests/data/gpt2_tied.py", cls="Gpt2", config="Gpt2Config",
                                overrides=(("vocab_size", 50257), ("n_ctx", 1024), ("dim", 1536), ("n_heads", 12),
                                           ("n_layers", 8), ("seq_len", 1024), ("batch", 4))),
    "moe-1536-host": ModelSpec("MoE (shared + 4 routed experts, top 2, dense dispatch, QK-norm, GQA 12/4), width 1536, "
                               "6 layers, seq 1024, batch 4", file="tests/data/moe.py", cls="Moe", config="MoeConfig",
                               overrides=(("vocab_size", 32000), ("dim", 1536), ("n_layers", 6), ("n_heads", 12),
                                          ("n_kv_heads", 4), ("n_experts", 4), ("top_k", 2), ("expert_hidden", 2048),
                                          ("seq_len", 1024), ("batch", 4))),
}
ALL_MODELS = {**MODELS, **HOST_MODELS}
SETUPS = ("fully_shard", "plain", "fsdp2")
# The step model's mode for a measured fully_shard step at world size 1 (no collectives: every mode's plan is empty).
MODE = "ce_overlap-nccl"


def _tiny(spec: ModelSpec) -> ModelSpec:
    """The same model at the test file's default (small) config, the zoo's llama3-tiny: the harness on a CPU."""
    if spec.zoo:
        return dataclasses.replace(spec, zoo="llama3-tiny", layers=2, seq_len=64)
    return dataclasses.replace(spec, overrides=())


# The host-bound shape (--host-bound): the same model, widths and layers at batch 1 and HOST_SEQ tokens, so its kernels
# take microseconds and the host bounds the step: the run-ahead step is then the host's time to issue one (a median of
# many steps, unlike one enqueue on an idle GPU, which varies ~1.5x between processes: host-time-2026-12-01-b).
HOST_SEQ = 256


def _host_bound(spec: ModelSpec) -> ModelSpec:
    """`spec` at the host-bound shape (batch 1, HOST_SEQ tokens; images: batch 2)."""
    if spec.zoo:
        return dataclasses.replace(spec, seq_len=HOST_SEQ, batch=1)
    keys = {"batch": 2} if spec.inputs == "images" else {"batch": 1, "seq_len": HOST_SEQ}
    over = dict(spec.overrides)
    if "n_ctx" in over:
        over["n_ctx"] = HOST_SEQ
    over.update(keys)
    return dataclasses.replace(spec, overrides=tuple(over.items()))


def _what(name: str, host_bound: bool) -> str:
    """A row's description of its model and shape."""
    return ALL_MODELS[name].what + (f" (host-bound shape: batch 1, {HOST_SEQ} tokens)" if host_bound else "")


def _load_result(path: str, failed: dict):
    """The JSON a child process wrote to `path` (removed after), or `failed` where it wrote none."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return failed
    finally:
        os.remove(path)


def _write_rows(path: str | None, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"schema": SCHEMA, "rows": rows}, f, indent=1)


def spec_of(name: str, tiny: bool = False, host_bound: bool = False) -> ModelSpec:
    """ALL_MODELS[name], at the small config of _tiny or the host-bound shape of _host_bound."""
    spec = ALL_MODELS[name]
    return _tiny(spec) if tiny else _host_bound(spec) if host_bound else spec


def build(name: str, device: str, tiny: bool = False, host_bound: bool = False):
    """(model built under torch.device(`device`), batch maker `batch(step) -> inputs` on that device) of
    MODELS[name]; `tiny`, `host_bound`: at spec_of's shapes."""
    import torch

    spec = spec_of(name, tiny, host_bound)
    if spec.zoo:
        from ce_overlap.models.llama import LLAMA_CONFIGS, Llama

        cfg = dataclasses.replace(LLAMA_CONFIGS[spec.zoo], n_layers=spec.layers, seq_len=spec.seq_len)
        with torch.device(device):
            model = Llama(cfg)
        vocab, batch, seq = cfg.vocab_size, spec.batch, spec.seq_len
    else:
        from ce_overlap.models import load_file

        module = load_file(os.path.join(ROOT, spec.file))
        cfg = getattr(module, spec.config)(**dict(spec.overrides))
        with torch.device(device):
            model = getattr(module, spec.cls)(cfg)
        vocab, batch = getattr(cfg, "vocab_size", 0), cfg.batch
        seq = getattr(cfg, "seq_len", 0)

    def make_batch(step: int):
        g = torch.Generator(device="cpu").manual_seed(1000 + step)
        if spec.inputs == "images":
            images = torch.randn((batch, cfg.channels, cfg.image, cfg.image), generator=g)
            labels = torch.randint(0, cfg.classes, (batch,), generator=g)
            return images.to(device), labels.to(device)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return model, make_batch


def _block_container(model):
    """The model's largest ModuleList / ModuleDict (its transformer blocks), or None."""
    import torch.nn as nn

    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))]
    return max(lists, key=len) if lists else None


def blocks(model):
    """The model's transformer blocks: the children of its largest ModuleList / ModuleDict."""
    container = _block_container(model)
    return list(container.children()) if container is not None else []


def _init_weights(model) -> None:
    """Weights a step runs on (the values do not change the kernels): matrices N(0, 0.02), biases 0, norms 1."""
    import torch

    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)
            elif pname.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)


# ---------------------------------------------------------------------------------------------------------------------
# Measured (one model per process, on a GPU)

def training_step(name: str, setup: str, device: str, tiny: bool = False, host_bound: bool = False, world: int = 1,
                  own_code: bool = False):
    """(run_step(inputs) -> loss: one training step of (model, setup), fused AdamW, make_batch) in this process's
    process group. `own_code`: the model is compiled through a function of its own code object, so that two setups
    compiled in one process do not share the model class's forward, whose Dynamo cache would then check the other
    setup's guards first on every call (--paired)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import ce_overlap

    on_gpu = device == "cuda"
    torch.manual_seed(0)
    model, make_batch = build(name, device, tiny, host_bound)
    _init_weights(model)

    def compiled(options=None):
        if not own_code:
            return torch.compile(model, options=options)
        scope = {"model": model}
        exec(f"def step_{setup}(*inputs):\n    return model(*inputs)\n", scope)  # a code object of its own
        return torch.compile(scope[f"step_{setup}"], options=options)

    autocast = contextlib.nullcontext
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # the sharded setups' (plain: autocast below)
    if setup == "fully_shard":
        for block in blocks(model):
            ce_overlap.fully_shard(block, dist.group.WORLD, mp_policy=mp)
        ce_overlap.fully_shard(model, dist.group.WORLD, mp_policy=mp)
        step_fn = compiled(ce_overlap.inductor_options(ce="on" if world > 1 and on_gpu else "off"))
    elif setup == "fsdp2":  # FSDP2 as torchtitan runs it: each block compiled, then sharded; the root eager
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(dist.group.WORLD, device)
        container = _block_container(model)
        for key, block in list(container.named_children()):
            container.register_module(key, torch.compile(block))
        for block in container.children():
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        step_fn = model
    else:  # plain: the unsharded model, fp32 weights under bf16 autocast, compiled whole
        step_fn = compiled()
        autocast = lambda: torch.autocast(device, dtype=torch.bfloat16)  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_gpu)

    def run_step(inputs):
        with autocast():
            out = step_fn(*inputs)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return run_step, make_batch


def _new_store_path() -> str:
    """A fresh file for the ranks' rendezvous (torch's FileStore): no port to pick, so none that another process can
    take between its choice and the bind, as a free port handed to the children could under a busy test suite."""
    return os.path.join(tempfile.mkdtemp(prefix="ce_overlap_bench_"), "store")


def _init_group(device: str, world: int = 1, rank: int = 0, store: str = "") -> None:
    """This process as rank `rank` of `world` (measure_one says over what), meeting the others at `store` (a
    FileStore path, _new_store_path's; world 1 needs none: an in-process store)."""
    from lib import common as _common  # noqa: F401  (the NCCL / symm-mem environment before torch)
    import torch
    import torch.distributed as dist

    import ce_overlap  # noqa: F401  (registers the "ce_overlap" torch.distributed backend)

    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(0)
    backend = ("cuda:nccl,cpu:gloo" if world == 1 else "cpu:gloo,cuda:ce_overlap") if on_gpu else "gloo"
    if world == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)


def measure_one(name: str, steps: int, warmup: int, profile_steps: int, device: str = "cuda",
                tiny: bool = False, setup: str = "fully_shard", host_profile: bool = False, host_bound: bool = False,
                world: int = 1, rank: int = 0, store: str = "") -> dict:
    """One (model, setup) measured in this process, as rank `rank` of `world` (world > 1: every rank on GPU 0, over
    gloo for CPU tensors and ce_overlap's torch.distributed backend for CUDA ones, the pass with ce="on": every
    collective on the copy engines, as NCCL refuses two ranks on one GPU; on a CPU, gloo and the pass on NCCL's
    place)."""
    import gc

    import torch
    import torch.distributed as dist

    from lib.titan import GC_FREQ, step_loop_gc

    on_gpu = device == "cuda"
    _init_group(device, world, rank, store)
    run_step, make_batch = training_step(name, setup, device, tiny, host_bound, world)
    batches = [make_batch(i) for i in range(warmup + steps)]

    def mark():  # a step's end: a CUDA event (the host does not wait), or the host's clock on a CPU
        if on_gpu:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def between(a, b) -> float:
        return a.elapsed_time(b) if on_gpu else 1e3 * (b - a)

    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    ends, host_ms, losses = [], [], []
    t_compile = time.perf_counter()
    compile_s = cpu0 = 0.0
    with step_loop_gc("torchtitan"):
        sync()
        for i, inputs in enumerate(batches, 1):
            if i == warmup + 1:
                cpu0 = time.process_time()
            t0 = time.perf_counter()
            if i > 1 and i % GC_FREQ == 0:
                gc.collect(1)
            losses.append(run_step(inputs).detach())
            ends.append(mark())
            if i > warmup:
                host_ms.append(1e3 * (time.perf_counter() - t0))
            if i == 1:
                sync()
                compile_s = time.perf_counter() - t_compile
        # The process's CPU time per timed step: every thread's, since on CUDA the backward runs on autograd's device
        # thread while the issuing thread waits (that thread's own time missed it, up to 2026-12-02's section j).
        cpu_ms = 1e3 * (time.process_time() - cpu0) / steps
        sync()
    step_ms = [between(a, b) for a, b in zip(ends[warmup - 1:], ends[warmup:])]
    median = statistics.median(step_ms)
    kernels = None
    if profile_steps and on_gpu:
        from lib.kernel_profile import profile_kernels

        lead = max(1, math.ceil(1500.0 / max(median, 1e-3)))
        kernels = profile_kernels(lambda: run_step(batches[-1]), profile_steps, lead=lead)
    host = _host_profile(run_step, batches[-1], sync, barrier=dist.barrier if world > 1 else None) \
        if host_profile else None
    info = {"gpu": torch.cuda.get_device_name() if on_gpu else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda}
    peak = torch.cuda.max_memory_reserved() / 2**30 if on_gpu else 0.0
    dist.destroy_process_group()
    return {"model": name, "what": _what(name, host_bound), "setup": setup, "host": host, "ok": True,
            "host_bound": host_bound, "world": world, "rank": rank, "measured_ms": round(median, 3),
            "step_ms": [round(x, 3) for x in step_ms], "host_ms": round(statistics.median(host_ms), 3),
            "host_cpu_ms": round(cpu_ms, 3),
            "losses": [round(float(x), 4) for x in losses], "compile_s": round(compile_s, 1),
            "peak_mem_gib": round(peak, 2), "kernels": kernels, "info": info}


def measure_paired(name: str, setups: list[str], pairs: int, blocks_: int, block_steps: int, warmup: int,
                   device: str = "cuda", tiny: bool = False, host_bound: bool = False) -> list[dict]:
    """The setups of one model side by side in one process (world size 1), each compiled through a function of its
    own: the host's time to issue a step on an idle device (`enqueue_ms`), sampled `pairs` times with the setups
    taking turns (the first of each round alternating), and the run-ahead step over `blocks_` blocks of
    `block_steps` steps per setup, in turns too. Steps of one setup next to the other's in time, so that the host's
    speed, which drifts between processes and within one by more than the difference measured
    (host-time-2026-12-01-b), is the same for both; `enqueue_ratio`, `run_ahead_ratio`: the median over the rounds
    of each setup's time over plain's (or the first setup's). Rows as measure_one's: measured_ms the run-ahead step,
    host_ms the enqueue."""
    import gc

    import torch
    import torch.distributed as dist

    on_gpu = device == "cuda"
    _init_group(device)
    steps = {s: training_step(name, s, device, tiny, host_bound, own_code=True) for s in setups}
    batch = next(iter(steps.values()))[1](0)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    t0 = time.perf_counter()
    for run_step, _ in steps.values():
        for _ in range(warmup):
            run_step(batch)
    sync()
    compile_s = time.perf_counter() - t0
    enqueue = {s: [] for s in setups}
    run_ahead = {s: [] for s in setups}
    gc.collect()
    gc.disable()
    try:
        for k in range(pairs):
            for s in setups if k % 2 == 0 else setups[::-1]:
                sync()
                t0 = time.perf_counter()
                steps[s][0](batch)
                enqueue[s].append(1e3 * (time.perf_counter() - t0))
        for k in range(blocks_):
            for s in setups if k % 2 == 0 else setups[::-1]:
                sync()
                t0 = time.perf_counter()
                ev0 = torch.cuda.Event(enable_timing=True) if on_gpu else None
                if ev0 is not None:
                    ev0.record()
                for _ in range(block_steps):
                    steps[s][0](batch)
                if ev0 is not None:
                    ev1 = torch.cuda.Event(enable_timing=True)
                    ev1.record()
                    sync()
                    run_ahead[s].append(ev0.elapsed_time(ev1) / block_steps)
                else:
                    run_ahead[s].append(1e3 * (time.perf_counter() - t0) / block_steps)
    finally:
        gc.enable()
    dist.destroy_process_group()
    base = "plain" if "plain" in setups else setups[0]
    rows = []
    for s in setups:
        rows.append({"model": name, "setup": s, "ok": True, "paired": True, "host_bound": host_bound, "world": 1,
                     "what": _what(name, host_bound),
                     "host_ms": round(statistics.median(enqueue[s]), 3),
                     "measured_ms": round(statistics.median(run_ahead[s]), 3),
                     "enqueue_samples": [round(x, 3) for x in enqueue[s]],
                     "run_ahead_blocks": [round(x, 3) for x in run_ahead[s]],
                     "enqueue_ratio": round(statistics.median(a / b for a, b in zip(enqueue[s], enqueue[base])), 4),
                     "run_ahead_ratio": round(statistics.median(a / b for a, b in zip(run_ahead[s],
                                                                                      run_ahead[base])), 4),
                     "compile_s": round(compile_s, 1), "gpu": torch.cuda.get_device_name() if on_gpu else "cpu",
                     "torch": torch.__version__})
    return rows


def _host_profile(run_step, inputs, sync, steps: int = 10, top: int = 40, barrier=None) -> dict:
    """Where the host's time to issue one step goes: the Python time to enqueue a step that starts on an idle
    device (a sync before it, none inside: `enqueue_ms`, and the process's CPU time in it: `enqueue_cpu_ms`), the same
    step with a sync after (`synced_ms`), the time to enqueue a step behind one the device still runs
    (`enqueue_busy_ms`: two steps in flight, under the launch queue's depth), and cProfile over `steps` such steps:
    the `top` functions by own time and by cumulative time (ms per step), then the ops by their host time
    (`by_op`: _host_ops). `barrier`: every rank's, after each sync
    (with several ranks, every step starts on an idle device on all of them)."""
    import cProfile
    import pstats

    barrier = barrier or (lambda: None)
    enqueue, enqueue_cpu, synced, busy = [], [], [], []
    for _ in range(2 * steps):
        sync()
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        run_step(inputs)
        enqueue.append(1e3 * (time.perf_counter() - t0))
        enqueue_cpu.append(1e3 * (time.process_time() - c0))
        sync()
        synced.append(1e3 * (time.perf_counter() - t0))
        run_step(inputs)  # the device busy with this one while the next is issued
        t0 = time.perf_counter()
        run_step(inputs)
        busy.append(1e3 * (time.perf_counter() - t0))
    prof = cProfile.Profile()
    for _ in range(steps):
        sync()
        barrier()
        prof.enable()
        run_step(inputs)
        prof.disable()
    sync()
    stats = pstats.Stats(prof).stats
    by_op = _host_ops(run_step, inputs, sync, barrier, steps=min(steps, 3), top=top)

    def rows(key: int) -> list[dict]:
        ranked = sorted(stats.items(), key=lambda kv: -kv[1][key])[:top]
        return [{"function": f"{os.path.relpath(f[0]) if f[0].startswith('/') else f[0]}:{f[1]}({f[2]})",
                 "calls": v[1] / steps, "own_ms": round(1e3 * v[2] / steps, 3), "cumulative_ms":
                 round(1e3 * v[3] / steps, 3)} for f, v in ranked]

    return {"enqueue_ms": round(statistics.median(enqueue), 3), "synced_ms": round(statistics.median(synced), 3),
            "enqueue_cpu_ms": round(statistics.median(enqueue_cpu), 3),
            "enqueue_busy_ms": round(statistics.median(busy), 3),
            "by_own_time": rows(2), "by_cumulative_time": rows(3), "by_op": by_op}


def _host_ops(run_step, inputs, sync, barrier, steps: int, top: int) -> list[dict]:
    """The dispatched ops of `steps` steps as torch's profiler sees them on the host (its CPU side only): the `top`
    op names by self CPU time, per step. Names what cProfile cannot tell apart: every op of a namespace (the
    ce_overlap ops, the aten ops the wrapper calls) is one built-in to it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            sync()
            barrier()
            run_step(inputs)
        sync()
    ranked = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [{"op": e.key, "calls": e.count / steps, "self_ms": round(e.self_cpu_time_total / 1e3 / steps, 3),
             "total_ms": round(e.cpu_time_total / 1e3 / steps, 3)} for e in ranked]


def _child(name: str, setup: str, args, out: str, rank: int = 0, store: str = "") -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--kernel-profile", str(args.kernel_profile), "--device",
           args.device, "--out", out, "--setups", setup, "--world", str(args.world), "--rank", str(rank),
           "--store", store]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--host-bound"] if args.host_bound else []
    cmd += ["--host-profile"] if args.host_profile else []  # every rank: the same steps on all
    return subprocess.Popen(cmd)


def measure_world(name: str, setup: str, args) -> dict:
    """(model, setup) in fresh processes, one per rank of --world: rank 0's row, and with world > 1 every rank's
    step, host and CPU ms (`ranks`) and the slowest rank's host and CPU ms as the row's."""
    outs = []
    for _ in range(args.world):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            outs.append(f.name)
    store = _new_store_path()
    procs = [_child(name, setup, args, out, rank, store) for rank, out in enumerate(outs)]
    codes = [p.wait() for p in procs]
    shutil.rmtree(os.path.dirname(store), ignore_errors=True)
    rows = [_load_result(out, {"model": name, "setup": setup, "ok": False,
                               "error": f"rank {rank}'s process exited {codes[rank]} without a result"})
            for rank, out in enumerate(outs)]
    bad = [r for r in rows if not r.get("ok")]
    if bad:
        return bad[0]
    row = rows[0]
    if args.world > 1:
        row["ranks"] = [{**{k: r[k] for k in ("measured_ms", "host_ms", "host_cpu_ms")},
                         **({"enqueue_ms": r["host"]["enqueue_ms"]} if r.get("host") else {})} for r in rows]
        row["host_ms"] = max(r["host_ms"] for r in rows)
        row["host_cpu_ms"] = max(r["host_cpu_ms"] for r in rows)
    return row


def measure_paired_models(names: list[str], setups: list[str], args) -> list[dict]:
    """measure_paired per model, each in a fresh process; --out written after each."""
    rows = []
    for name in names:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--paired", str(args.paired), "--warmup",
               str(args.warmup), "--device", args.device, "--out", out, "--setups", ",".join(setups)]
        cmd += ["--tiny"] if args.tiny else []
        cmd += ["--host-bound"] if args.host_bound else []
        code = subprocess.run(cmd).returncode
        got = _load_result(out, [{"model": name, "ok": False, "error": f"its process exited {code} without a result"}])
        for r in got:
            print(f"# {name} ({r.get('setup')}, paired): " + (
                f"enqueue {r['host_ms']:.2f} ms ({r['enqueue_ratio']:.3f}x plain), run-ahead "
                f"{r['measured_ms']:.2f} ms ({r['run_ahead_ratio']:.3f}x)" if r.get("ok") else r["error"]),
                flush=True)
        rows.extend(got)
        _write_rows(args.out, rows)
    return rows


def measure(runs: list[tuple[str, str]], args) -> list[dict]:
    """Each (model, setup) of `runs` in fresh processes (no compiled code, memory or library state carried between
    them), --repeat times, the rounds one after another (a round is every run once: the setups' processes
    interleave); --out is written after each, so a run cut short keeps the ones it finished."""
    rows = []
    for round_ in range(args.repeat):
        for name, setup in runs:
            t0 = time.perf_counter()
            row = measure_world(name, setup, args)
            row["round"] = round_
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            host = row.get("host") or {}
            print(f"# {name} ({setup}{f', world {args.world}' if args.world > 1 else ''}): " + (
                f"{row['measured_ms']:.2f} ms per step, host {row['host_ms']:.2f} ms (cpu {row['host_cpu_ms']:.2f}), "
                f"compile {row['compile_s']} s"
                + (f", enqueue {host['enqueue_ms']:.2f} ms (cpu {host['enqueue_cpu_ms']:.2f}, behind a step "
                   f"{host['enqueue_busy_ms']:.2f}), synced {host['synced_ms']:.2f} ms" if host else "")
                if row.get("ok") else row["error"]), flush=True)
            rows.append(row)
            _write_rows(args.out, rows)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Predicted (no GPU)

def _measured_fully_shard(path: str) -> dict:
    """Per model, the measured fully_shard rows at world size 1 of a measured run's JSON, rounds taken together: the
    median step and host ms over the rounds, the first round's kernel profile."""
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r.get("ok") and r.get("setup", "fully_shard") == "fully_shard"
                and r.get("world", 1) == 1]
    out: dict = {}
    for r in rows:
        out.setdefault(r["model"], []).append(r)
    return {name: {**rs[0], "measured_ms": statistics.median(r["measured_ms"] for r in rs),
                   "host_ms": statistics.median(r["host_ms"] for r in rs),
                   "kernels": next((r["kernels"] for r in rs if r.get("kernels")), None)}
            for name, rs in out.items()}


def predict_one(name: str, profile: str, tiny: bool = False, ir_dir: str | None = None,
                host_bound: bool = False, world: int = 1) -> dict:
    """The cost model's step of MODELS[name] at world size `world` (captured on fake CUDA tensors; at world 1 mode
    MODE, else ce_overlap's plan), with its pieces (step_model's: the time per kernel class among them). `ir_dir`:
    the capture is read from DIR/NAME.ir.json where it is there, else written there (a later prediction with another
    profile need not capture again)."""
    import ce_overlap
    from ce_overlap.analyzer.step_model import gpu_step_ms, host_step_us, predicted_step_ms, step_model

    t0 = time.perf_counter()
    suffix = ("-tiny" if tiny else "-host" if host_bound else "") + (f"-w{world}" if world > 1 else "")
    path = os.path.join(ir_dir, f"{name}{suffix}.ir.json") if ir_dir else None
    if path and os.path.exists(path):
        ir = ce_overlap.Ir.load(path)
    else:
        model, make_batch = build(name, "meta", tiny, host_bound)
        ir = ce_overlap.capture(model, make_batch(0), world_size=world, device="cuda")
        if path:
            os.makedirs(ir_dir, exist_ok=True)
            ir.save(path)
    pieces = step_model(ir, profile, world)
    mode = MODE if world == 1 else "ce_overlap"
    host = host_step_us(pieces, mode)
    return {"model": name, "predicted_ms": round(predicted_step_ms(pieces, mode), 3),
            "gpu_ms": round(gpu_step_ms(pieces, mode), 3), "host_ms": None if host is None else round(host / 1e3, 3),
            "capture_device": ir.meta.get("capture_device"), "pieces": pieces,
            "predict_s": round(time.perf_counter() - t0, 1)}


def table(rows: list[dict]) -> str:
    """Measured rows: the step and the host's time to issue it (host ms); predicted rows: the predicted step, the
    larger of its GPU and host parts (pred gpu / host ms), against the measured step beside it."""
    head = (f"{'model':<16} {'measured ms':>11} {'predicted ms':>12} {'error':>7} {'host ms':>8} "
            f"{'pred gpu ms':>11} {'pred host ms':>12}  what")
    lines = [head, "-" * len(head)]

    def cell(x, width):
        return f"{x:{width}.2f}" if x is not None else " " * (width - 1) + "-"

    for r in rows:
        meas, pred = r.get("measured_ms"), r.get("predicted_ms")
        err = f"{100 * (pred / meas - 1):+6.1f}%" if meas and pred else "      -"
        name = r["model"] + (f"@{r['setup']}" if r.get("setup", "fully_shard") != "fully_shard" else "") \
            + (f"x{r['world']}" if r.get("world", 1) > 1 else "")
        lines.append(f"{name:<16} {cell(meas, 11)} {cell(pred, 12)} {err} {cell(r.get('host_ms'), 8)} "
                     f"{cell(r.get('pred_gpu_ms'), 11)} {cell(r.get('pred_host_ms'), 12)}  {r.get('what', '')}")
    return "\n".join(lines)


def class_table(name: str, classes: list[dict]) -> str:
    lines = [f"{name}: kernel time per class, ms per step"]
    for c in classes:
        meas = c["measured_ms"]
        err = f"{c['error_pct']:+6.1f}%" if c.get("error_pct") is not None else "      -"
        lines.append(f"  {c['class']:<58} pred {c['predicted_ms']:8.2f}  meas "
                     f"{meas if meas is not None else float('nan'):8.2f}  {err}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {list(MODELS)}")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--kernel-profile", type=int, default=3, metavar="STEPS", help="steps profiled by kernel class "
                   "(0: none)")
    p.add_argument("--predict", action="store_true", help="predict (no GPU) instead of measuring")
    p.add_argument("--measured", metavar="JSON", help="with --predict: a measured run's JSON to compare with")
    p.add_argument("--profile", default="h200-sxm", help="with --predict: the cost model's profile (a built-in name "
                   "or a file)")
    p.add_argument("--ir-dir", metavar="DIR", help="with --predict: keep each model's capture in DIR (NAME.ir.json) "
                   "and read it from there when it is there")
    p.add_argument("--out", metavar="JSON")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where to measure (cpu: the harness "
                   "only, for the tests)")
    p.add_argument("--tiny", action="store_true", help="each model at a small config (the tests)")
    p.add_argument("--setups", default="fully_shard", help=f"comma list of {list(SETUPS)}: each model under "
                   "ce_overlap.fully_shard, and/or plain (unsharded, fp32 weights under bf16 autocast)")
    p.add_argument("--host-profile", action="store_true", help="also the host's time to issue a step and cProfile's "
                   "functions over 10 steps (issue 56)")
    p.add_argument("--host-bound", action="store_true", help=f"each model at batch 1 and {HOST_SEQ} tokens: the host "
                   "bounds the step, whose run-ahead time is then the host's per step (issue 56)")
    p.add_argument("--world", type=int, default=1, help="ranks, every one on GPU 0 (> 1: fully_shard only, every "
                   "collective on the copy engines)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of every (model, setup), one after another")
    p.add_argument("--paired", type=int, default=0, metavar="PAIRS", help="the setups of each model side by side in "
                   "one process: PAIRS enqueue samples per setup and PAIRS / 4 run-ahead blocks, the setups in turns "
                   "(the host's time compared where its speed is the same for both)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child and args.paired:
        rows = measure_paired(args.child, args.setups.split(","), args.paired, max(2, args.paired // 4), 10,
                              args.warmup, args.device, args.tiny, args.host_bound)
        with open(args.out, "w") as f:
            json.dump(rows, f)
        return 0
    if args.child:
        row = measure_one(args.child, args.steps, args.warmup, args.kernel_profile, args.device, args.tiny,
                          args.setups, args.host_profile, args.host_bound, args.world, args.rank, args.store)
        with open(args.out, "w") as f:
            json.dump(row, f)
        return 0
    names = [n for n in args.models.split(",") if n]
    bad = [n for n in names if n not in ALL_MODELS]
    if bad:
        p.error(f"--models: unknown {bad}; known: {list(ALL_MODELS)}")
    setups = [s for s in args.setups.split(",") if s]
    if not setups or any(s not in SETUPS for s in setups):
        p.error(f"--setups: expected a comma list of {list(SETUPS)}, got {args.setups!r}")
    if args.world < 1 or args.repeat < 1 or (args.world > 1 and setups != ["fully_shard"]):
        p.error("--world and --repeat must be >= 1, and --world > 1 measures --setups fully_shard only")
    if args.world > 1 and args.kernel_profile:
        p.error("--world > 1 takes --kernel-profile 0 (the profile's steps differ between ranks)")
    if args.paired and (args.world > 1 or len(setups) < 2 or "fsdp2" in setups):
        p.error("--paired compares fully_shard and plain at --world 1")
    if args.warmup < 2 or args.steps < 1:
        p.error("--warmup must be >= 2 (the first step compiles) and --steps >= 1")
    if args.paired and not args.predict:
        rows = measure_paired_models(names, setups, args)
        payload = {"schema": SCHEMA, "rows": rows}
    elif not args.predict:
        rows = measure([(n, s) for n in names for s in setups], args)
        payload = {"schema": SCHEMA, "rows": rows}
    else:
        from step_prediction import compare_classes

        measured = _measured_fully_shard(args.measured) if args.measured else {}
        rows = []
        for name in names:
            pred = predict_one(name, args.profile, args.tiny, args.ir_dir, args.host_bound)
            meas = measured.get(name, {})
            classes = compare_classes(pred["pieces"], meas.get("kernels")) if meas.get("kernels") else []
            rows.append({"model": name, "what": meas.get("what", ALL_MODELS[name].what),
                         "predicted_ms": pred["predicted_ms"], "pred_gpu_ms": pred["gpu_ms"],
                         "pred_host_ms": pred["host_ms"], "measured_ms": meas.get("measured_ms"),
                         "host_ms": meas.get("host_ms"), "classes": classes, "profile": args.profile,
                         "counts": {g: {k: a.get(k) for k in ("kernels", "inputs", "collectives")}
                                    for g, a in pred["pieces"]["analyze"].items()}})
            if classes:
                print(class_table(name, classes), flush=True)
        payload = {"schema": SCHEMA, "profile": args.profile, "rows": rows}
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The cost model's side of flex_in_step.py: the same model and step captured on the CPU (fake CUDA, one rank, no
sharding) and priced with h200-sxm, its flex attention nodes by direction, with efficiency.flex_attention and as
before it (priced as GEMMs). From the repository root:

    python bench/results/flex-attention-2026-11-29/flex_in_step_model.py > .../flex-in-step-model.txt
"""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flex_in_step  # noqa: E402

import ce_overlap  # noqa: E402
from ce_overlap import profiles  # noqa: E402
from ce_overlap.ir import analyze  # noqa: E402

import torch  # noqa: E402


def flex_us(report: dict) -> dict:
    """Per graph: the priced time of its flex attention nodes (the analysis' timeline events)."""
    out: dict[str, float] = {}
    for e in report["timeline"]:
        if "flex_attention" in e["op"]:
            out[e["graph"]] = out.get(e["graph"], 0.0) + e["end_us"] - e["start_us"]
    return out


def main() -> None:
    with torch.device("meta"):
        model = flex_in_step.titan_llama.WithLoss(flex_in_step.CFG).to(torch.bfloat16)  # as flex_in_step.py runs it
    tokens = torch.zeros(1, flex_in_step.CFG.seq_len, dtype=torch.long)
    ir = ce_overlap.capture(model, (tokens, tokens), world_size=1, fsdp=False)
    doc = ir.to_dict()
    spec = json.loads(profiles.read_text("h200-sxm"))
    before = {**spec, "efficiency": {k: v for k, v in spec["efficiency"].items() if not k.startswith("flex")}}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "h200-flex-as-attention.json")
        with open(path, "w") as f:
            json.dump(before, f)
        now, as_attention = analyze(ir, "h200-sxm"), analyze(ir, path)
    for name, rep in (("h200-sxm (efficiency.flex_attention)", now), ("without it (attention's)", as_attention)):
        print(name, {g: round(us / 1e3, 3) for g, us in flex_us(rep).items()}, "ms per step")
    flops = {g["name"]: sum(n["flops"] for n in g["nodes"] if "flex_attention" in n["op"]) for g in doc["graphs"]}
    print("flex FLOPs (executed tiles):", {k: f"{v / 1e9:.1f} G" for k, v in flops.items()})


if __name__ == "__main__":
    main()

"""inductor_options composes with a post-grad pass the user configured already (as vLLM's PostGradPassManager does):
theirs runs first on each graph, then ce_overlap's, and the cache key covers both; nothing is replaced."""
from __future__ import annotations

import dataclasses
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import ce_overlap
from ce_overlap.inductor import pass_, rewrite
from ce_overlap.models.llama import LLAMA_CONFIGS


class CountingPass(CustomGraphPass):
    """A user's pass: counts the graphs it sees and the collectives in them (it runs before ce_overlap's)."""

    def __init__(self, version: str | None = "v1"):
        self.version = version
        self.seen: list[int] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.seen.append(sum(rewrite.is_functional_collective(n) for n in graph.nodes))

    def uuid(self):
        return None if self.version is None else f"counting-{self.version}"


def test_a_configured_pass_is_kept_first_and_keyed():
    user = CountingPass()
    with torch._inductor.config.patch(post_grad_custom_post_pass=user):
        opts = ce_overlap.inductor_options(ce="off")
        again = ce_overlap.inductor_options(ce="off")  # not composed twice, and an earlier ce_overlap pass replaced
        with torch._inductor.config.patch(post_grad_custom_post_pass=opts["post_grad_custom_post_pass"]):
            rebuilt = ce_overlap.inductor_options(ce="on")
    p = opts["post_grad_custom_post_pass"]
    assert isinstance(p, pass_.CeOverlapPass) and p.run_before == (user,)
    assert again["post_grad_custom_post_pass"].run_before == (user,)
    assert rebuilt["post_grad_custom_post_pass"].run_before == (user,)
    key = p.uuid()
    user.version = "v2"
    assert p.uuid() != key  # the user's pass changed: so does the composition's key
    user.version = None
    assert p.uuid() is None  # a pass Inductor cannot key: no caching at all
    assert ce_overlap.inductor_options(ce="off")["post_grad_custom_post_pass"].run_before == ()


def test_both_passes_run_on_every_graph_of_a_real_compile(gloo_world1, inductor_codegen):
    from test_pass_helpers import gathered_in_graph
    from ce_overlap.models.llama import Llama

    torch.manual_seed(0)
    cfg = dataclasses.replace(LLAMA_CONFIGS["llama3-tiny"], seq_len=16)
    model = gathered_in_graph(Llama(cfg))
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    user = CountingPass()
    with torch._inductor.config.patch(post_grad_custom_post_pass=user, fx_graph_cache=False):
        opts = ce_overlap.inductor_options(ce="off", bucket_cap_mb=4096)
        compiled = torch.compile(model, options=opts, fullgraph=True)
        compiled(tokens, tokens).backward()
    reports = opts["post_grad_custom_post_pass"].reports
    assert len(user.seen) == 2 and all(n > 0 for n in user.seen)  # forward and backward, before the rewrite
    assert sorted(r.graph for r in reports) == ["backward", "forward"] and all(r.changed for r in reports)

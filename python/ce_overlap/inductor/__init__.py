"""The torch.compile / Inductor pass and the capture that runs it (docs/pass.md, docs/ir.md): the post-grad FX graph ->
IR (to_ir.py) -> Plan (the C++ planner) -> checked and applied to the graph (plan_check.py, rewrite.py), each bucket on
the backend backend_choice.py gives it; pass_.py is the face (inductor_options, CeOverlapPass, the torch.compile
backend "ce_overlap"). With in_graph/ and csrc/runtime, the only code that knows torch.compile / FX internals."""

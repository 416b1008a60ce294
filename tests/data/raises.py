def build():
    raise RuntimeError("checkpoint not found: /nowhere/weights.pt")

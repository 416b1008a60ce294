"""The torch-facing layer: the only Python code that knows torch.compile / FX internals."""

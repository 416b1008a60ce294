"""ce_overlap: copy-engine collectives and overlap planning for torch.compile training graphs.

`import ce_overlap` needs no torch and no GPU; capture imports torch when called.
"""
from .errors import CeOverlapError
from .ir import Ir, analyze, capture

__version__ = "0.1.0"
__all__ = ["CeOverlapError", "Ir", "analyze", "capture", "__version__"]

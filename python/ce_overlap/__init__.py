"""ce_overlap: copy-engine collectives and overlap planning for torch.compile training graphs.

`import ce_overlap` needs no torch and no GPU; capture imports torch when called. The graph pass
(inductor_options, CeOverlapPass, the "ce_overlap" torch.compile backend) and in-graph FSDP (fully_shard) load on
first use; torch finds the backend through the package's `torch_dynamo_backends` entry point (register_backend()
where the package is not installed). The torch.distributed backend "ce_overlap" (ce_overlap.distributed) is
registered as soon as torch is imported.
"""
from ._lazy import __getattr__  # noqa: F401 (fully_shard, inductor_options, ...: loaded on first use)
from ._torch_hook import register_c10d_backend_when_torch_is_imported
from .config import PassConfig, get_default_config, set_default_config
from .errors import CeOverlapError
from .analyzer.model_capture import capture
from .ir import Ir, analyze

register_c10d_backend_when_torch_is_imported()  # the torch.distributed backend "ce_overlap" (ce_overlap.distributed)

__version__ = "0.1.0"
__all__ = ["CeOverlapError", "CeOverlapPass", "Ir", "PassConfig", "analyze", "capture", "fully_shard",
           "get_default_config", "inductor_options", "register_backend", "set_default_config", "__version__"]

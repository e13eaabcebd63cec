"""sparse_fx: sparse decode attention for Hugging Face decoders, as a torch.compile pass.

    model = sparse_fx.compile(model, plan="prism-g4")
    print(sparse_fx.explain(model))
"""

from .lowering import ops  # sparse_fx.ops: the ops for direct use (torch.ops.sparse_fx.*)
from .api import acceptance, attach_cache, compile, explain, measurements
from .explain import Report
from .measure import Measurements
from .plan import Plan
from .speculate import Acceptance
from .runtime.encoders import SignatureEncoders

__all__ = [
    "acceptance",
    "attach_cache",
    "calibrate",
    "compile",
    "explain",
    "measurements",
    "ops",
    "train_signatures",
    "Acceptance",
    "Measurements",
    "Plan",
    "Report",
    "SignatureEncoders",
]
__version__ = "0.1.0"

# The offline tools (sparse_fx.offline: training, calibration) load only when first asked for.
_OFFLINE = {"calibrate": "calibrate", "train_signatures": "train"}


def __getattr__(name: str):
    if name in _OFFLINE:
        import importlib

        return getattr(importlib.import_module(f".offline.{_OFFLINE[name]}", __name__), name)
    raise AttributeError(f"module 'sparse_fx' has no attribute {name!r}")

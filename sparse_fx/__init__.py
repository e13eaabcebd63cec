"""sparse_fx: sparse decode attention for Hugging Face decoders, as a torch.compile pass.

    model = sparse_fx.compile(model, plan="prism-g4")
    print(sparse_fx.explain(model))
"""

from . import ops
from .api import compile, explain
from .explain import Report
from .plan import Plan

__all__ = ["compile", "explain", "ops", "Plan", "Report"]
__version__ = "0.1.0"

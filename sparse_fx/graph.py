"""Emitting ops into an FX graph, or running them at once: one interface for both, so a method's
side-cache write is written once and serves the compiled decode graph and the eager prefill.

`GraphEmitter.call` appends a call to the graph (before a given node) and returns the node;
`tensor` turns a runtime tensor (a side cache, an encoder weight) into a static buffer of the
graph module that AOTAutograd lifts as such, so CUDA graphs keep working. `EagerEmitter` runs the
same calls on tensors.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .match import op_name


@torch.library.custom_op("sparse_fx::side_cache_input", mutates_args=("tensor",))
def side_cache_input(tensor: torch.Tensor, layer: int, name: str) -> None:
    """Marks a graph input as layer `layer`'s side cache `name`: the compiled forward calls it on each
    side cache it is given, so the tensors reach the decode graph as inputs (their length symbolic
    like the KV cache's), and the rewrite takes the marks out (`side_cache_inputs`). Declared as
    writing the tensor so that the mark is kept in the graph until then; it does nothing."""


def side_cache_inputs(graph: fx.Graph) -> dict[tuple[int, str], fx.Node]:
    """The graph inputs marked as side caches, by (layer, name); the marks erased."""
    found = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.sparse_fx.side_cache_input.default:
            tensor, layer, name = node.args
            found[(layer, name)] = tensor
            graph.erase_node(node)
    return found


class GraphEmitter:
    def __init__(self, gm: fx.GraphModule):
        self.gm, self.g = gm, gm.graph
        self.attrs: dict[str, fx.Node] = {}
        self.anchor: fx.Node | None = None  # new nodes go before this one

    def at(self, node: fx.Node) -> GraphEmitter:
        self.anchor = node
        return self

    def call(self, fn, *args) -> fx.Node:
        with self.g.inserting_before(self.anchor):
            return self.g.call_function(fn, tuple(args))

    def tensor(self, name: str, tensor) -> fx.Node:
        """A get_attr node for a runtime tensor: a buffer of the graph module with a Dynamo source,
        so AOTAutograd treats it as a static input (a placeholder of our own would break Dynamo's
        argument bookkeeping; dropping the source would make CUDA graphs skip "mutated inputs")."""
        name = f"sparse_fx_{name}"
        if name not in self.attrs:
            self.gm.register_buffer(name, tensor)
            if hasattr(self.gm, "_param_name_to_source"):
                from torch._dynamo.source import ConstantSource

                self.gm._param_name_to_source[name] = ConstantSource(name)
            first = next(n for n in self.g.nodes if n.op != "placeholder")
            with self.g.inserting_before(first):
                self.attrs[name] = self.g.get_attr(name)
        return self.attrs[name]

    def tensors(self, prefix: str, tensors: list) -> list:
        return [None if t is None else self.tensor(f"{prefix}{i}", t) for i, t in enumerate(tensors)]


class EagerEmitter:
    """The same interface, running each call now (the prefill's side-cache fill)."""

    def call(self, fn, *args):
        return fn(*args)

    def tensor(self, name: str, tensor):
        return tensor

    def tensors(self, prefix: str, tensors: list) -> list:
        return list(tensors)


REPEAT_OPS = ("reshape", "view", "expand", "getitem", "unsqueeze", "repeat_interleave", "contiguous")


def remove_dead(graph: fx.Graph, roots: list) -> None:
    """Erase the chains of view/repeat ops below `roots` that nothing reads any more (the
    repeat_kv a sparse attention no longer needs is never materialised)."""
    stack = list(roots)
    while stack:
        n = stack.pop()
        if isinstance(n, fx.Node) and not n.users and n.op in ("call_method", "call_function") and op_name(n) in REPEAT_OPS:
            inputs = list(n.all_input_nodes)
            graph.erase_node(n)
            stack += inputs

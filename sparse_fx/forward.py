"""`model.forward` after `sparse_fx.compile`.

Prefill (several new tokens) of a Hugging Face model runs its own attention, uncompiled: the time
to first token is the dense model's, for any prompt length, and then the side caches of the new
positions are written. (Another model's prefill runs compiled, writing them in the graph.) Decode
(one new token) runs the compiled, rewritten graph. The side caches follow
the KV cache they describe: a beam-search reordering is applied to them too, any other change to
a cache's rows or length makes them stale, and a decode step on a cache they do not describe
refills them first.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import warnings
import weakref

import torch

from .compiled import CompiledState, filled, static_layers

MAX_DECODE_GRAPHS = 32  # distinct (batch, cache length) decode graphs one model may compile
FOLLOWED = ("reorder_cache", "batch_select_indices", "batch_repeat_interleave", "crop", "reset")


class SparseForward:
    """Every call of the compiled model comes through here."""

    def __init__(self, model: torch.nn.Module, original, compiled, state: CompiledState, before: dict):
        functools.update_wrapper(self, original)  # generate() inspects forward's signature
        self.model, self.original, self.compiled, self.state = model, original, compiled, state
        self.before = before  # what sparse_fx.compile changed on the model, as it was (api.restore)
        from transformers import PreTrainedModel

        self.hugging_face = isinstance(model, PreTrainedModel)

    def __call__(self, *args, **kwargs):
        if self.model.training:
            raise RuntimeError("sparse_fx: the model is in training mode; sparse attention is for inference: call model.eval()")
        ids = kwargs.get("input_ids", args[0] if args else None)
        ids = kwargs.get("inputs_embeds") if ids is None else ids
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and ids.shape[1] == 0:
            raise ValueError(f"sparse_fx: the prompt is empty (input of shape {tuple(ids.shape)}); give the model at "
                             "least one token")
        cache = kwargs.get("past_key_values")
        layers = static_layers(cache)
        if layers is not None:
            follow(cache, self.state)
        elif self.hugging_face and kwargs.get("use_cache", True) is not False:
            self._warn("cache", "sparse_fx: this call has no static KV cache (e.g. a DynamicCache), so nothing runs "
                       "sparse; use generate(..., cache_implementation='static') or pass a StaticCache")
        if self.hugging_face and isinstance(ids, torch.Tensor) and ids.dim() >= 2 and ids.shape[1] > 1:
            return self._prefill(ids, layers, cache, args, kwargs)
        if layers is not None and not self.state.owns(cache):
            self.state.fill(cache)  # it describes another cache (or one changed under it)
        initialise_static_cache(self.model, self.state.info, ids, cache)
        out = self._decode(args, kwargs)
        if layers is not None and not self.state.owns(cache):
            self.state.fill(cache)  # a cache the decode graph itself initialised
        self._check_decode()
        return out

    def prefill(self, **kwargs):
        """New tokens through the model's own dense attention, uncompiled, however few (lossless
        mode's prompt: its first token must be the dense model's), then their side caches."""
        cache = kwargs["past_key_values"]
        follow(cache, self.state)
        return self._prefill(kwargs["input_ids"], static_layers(cache), cache, (), kwargs)

    def verify(self, **kwargs):
        """Several new tokens through the compiled graph: lossless mode's verify step (dense attention,
        causal among the new tokens; the side caches of their positions written in the graph)."""
        cache = kwargs["past_key_values"]
        follow(cache, self.state)
        if not self.state.owns(cache):
            self.state.fill(cache)
        return self._decode((), kwargs)

    def _prefill(self, ids, layers, cache, args, kwargs):
        first = next((x for x in layers or () if not getattr(x, "is_sliding", False)), None)
        lo = filled(first) if first is not None else 0
        out = self.original(*args, **kwargs)
        if layers is not None:
            self.state.fill(cache, lo, lo + ids.shape[1])
        return out

    def _decode(self, args, kwargs):
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        cache = kwargs.get("past_key_values")
        side = {}
        if static_layers(cache) is not None:
            symbolic_length(cache, kwargs.get("attention_mask"))
            side = self.state.graph_side_caches(cache)
        try:
            with config.patch(**{limit: MAX_DECODE_GRAPHS}):
                return self.compiled(*args, sparse_fx_side_caches=side, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            shapes = sorted({(r.shape.batch, r.shape.max_len) for r in self.state.reports if r.decode and r.shape is not None})
            raise RuntimeError(
                f"sparse_fx: {len(shapes)} decode graphs compiled for (batch, cache length) {shapes}, the most one model "
                f"keeps ({MAX_DECODE_GRAPHS}); allocate one StaticCache as long as the longest request needs "
                "(generate(..., cache_implementation='static') sizes it to the longest call so far) "
                "or generation_config.max_cache_len") from None

    def _check_decode(self) -> None:
        report = self.state.reports[-1] if self.state.reports else None
        short = next((r.reason for r in report.rows if r.short), None) if report is not None else None
        if short and report.decode:
            self._warn("short", f"sparse_fx: this decode step keeps dense attention: {short}; "
                       "see sparse_fx.explain(model)")
        elif (report is not None and report.decode and self.state.method.rewrites
                and not any(r.action == "sparse" for r in report.rows)):
            reasons = sorted({r.reason for r in report.rows}) or ["no attention found in the graph"]
            self._warn("dense", f"sparse_fx: no layer runs sparse in this decode step ({'; '.join(reasons)}); "
                       "see sparse_fx.explain(model)")
        for key, message in self.state.method.notices(self.state.context).items():
            self._warn(key, message)

    def _warn(self, key: str, message: str) -> None:
        if key not in self.state.warned:
            self.state.warned.add(key)
            warnings.warn(message, stacklevel=_caller_level())


def _caller_level() -> int:
    """warnings.warn's stacklevel that names the user's line: the first frame above the caller
    outside sparse_fx, torch and transformers (model(...) or generate(...), however deep)."""
    import transformers

    from . import lowering, runtime

    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, transformers, lowering, runtime)) + (
        os.path.dirname(__file__) + os.sep,)
    frame, level = sys._getframe(2), 2  # level 1 is our caller, the warnings.warn call site
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def follow(cache, state: CompiledState) -> None:
    """Make `cache`'s own mutators keep `state`'s side caches honest (once per cache and state):
    a beam reordering is applied to them, other changes of rows or length disown them.

    The cache becomes an instance of a subclass of its class whose mutators also tell the
    followers (weak references, in the instance's dict): no reference cycle keeps a dropped
    cache's gigabytes alive, and a deep copy or a pickle is a cache of its own."""
    followers = cache.__dict__.setdefault("_sparse_fx_followers", [])
    if any(ref() is state for ref in followers):
        return
    if not getattr(type(cache), "_sparse_fx_followed", False):
        cache.__class__ = _followed_class(type(cache))
    followers.append(weakref.ref(state))


def _followed_class(cls: type) -> type:
    name = f"Followed{cls.__name__}"
    sub = globals().get(name)
    if sub is None or sub.__bases__ != (cls,):
        methods = {m: _notifying(getattr(cls, m), m) for m in FOLLOWED if hasattr(cls, m)}
        sub = type(name, (cls,), {**methods, "__getstate__": _without_followers, "_sparse_fx_followed": True,
                                  "__module__": __name__, "__qualname__": name})
        globals()[name] = sub  # importable by name: a followed cache pickles
    return sub


def _without_followers(self) -> dict:
    """Copies and pickles carry the cache, not who follows it (a model follows a cache it is given)."""
    return {k: v for k, v in self.__dict__.items() if k != "_sparse_fx_followers"}


def _notifying(base, name: str):
    @functools.wraps(base)
    def method(self, *args, **kwargs):
        out = base(self, *args, **kwargs)
        for follower in self.__dict__.get("_sparse_fx_followers", []):
            state = follower()
            if state is None:
                continue
            if name == "reorder_cache":
                state.side_caches.reorder(self, args[0] if args else kwargs["beam_idx"])
            else:
                state.side_caches.disown(self)
        return out

    return method


def symbolic_length(cache, mask) -> None:
    """Make the static cache's length symbolic in the decode graph: one graph serves every length.
    Its keys and values vary in length (dim 2), a 4-D mask over the cache in its last dim, and a
    layer that builds the mask itself takes the length from its keys, not from the Python int
    `max_cache_len` (which the graph would be specialised on). Called every decode step: a layer's
    tensors are marked once (the marks stay on them), the new step's mask each time."""
    length = None
    for layer in static_layers(cache):
        if getattr(layer, "is_sliding", False):
            continue  # (a sliding window's ring buffer has its window's length, whatever the cache's)
        length = max(length or 0, layer.max_cache_len)
        keys = getattr(layer, "keys", None)
        if not getattr(layer, "is_initialized", False) or getattr(keys, "_sparse_fx_symbolic", False):
            continue
        torch._dynamo.maybe_mark_dynamic(keys, 2)
        torch._dynamo.maybe_mark_dynamic(layer.values, 2)
        keys._sparse_fx_symbolic = True
        if _builds_static_masks(type(layer)):
            layer.__class__ = _symbolic_layer_class(type(layer))
    for t in mask.values() if isinstance(mask, dict) else [mask]:
        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[-1] == length:
            torch._dynamo.maybe_mark_dynamic(t, 3)


def _builds_static_masks(cls: type) -> bool:
    """Whether a cache layer class sizes its masks as Hugging Face's StaticLayer does, (max_cache_len,
    0), and is not yet our subclass (other layer kinds keep their own mask sizes)."""
    from transformers.cache_utils import StaticLayer

    return (issubclass(cls, StaticLayer) and getattr(cls, "get_mask_sizes", None) is StaticLayer.get_mask_sizes
            and not getattr(cls, "_sparse_fx_symbolic", False))


def _symbolic_layer_class(cls: type) -> type:
    name = f"Symbolic{cls.__name__}"
    sub = globals().get(name)
    if sub is None or sub.__bases__ != (cls,):

        def get_mask_sizes(self, *args, **kwargs):
            return self.keys.shape[-2], 0  # = (max_cache_len, 0), read from the tensor: no guard on the int

        sub = type(name, (cls,), {"get_mask_sizes": get_mask_sizes, "_sparse_fx_symbolic": True,
                                  "__module__": __name__, "__qualname__": name})
        globals()[name] = sub  # importable by name: a cache with such layers pickles
    return sub


def initialise_static_cache(model: torch.nn.Module, info, ids, cache) -> None:
    """Allocate a fresh StaticCache before the compiled call, as `generate` does for compiled steps.

    Left to allocate lazily, it would do so inside the compiled graph, where Hugging Face cannot
    mark its tensors as static addresses; CUDA graphs then skip the step ("mutated inputs") and the
    next launch fails on the unmarked tensors. Only on CUDA, where CUDA graphs run. Sized as
    Hugging Face's own early initialisation (`_get_static_cache_init_shape`: per rank under tensor
    parallelism, and not at all when layers sit on several devices).
    """
    layers = static_layers(cache)
    if not layers or not hasattr(cache, "early_initialization") or not isinstance(ids, torch.Tensor):
        return
    if all(getattr(layer, "is_initialized", True) or not getattr(layer, "supports_early_init", False) for layer in layers):
        return
    param = next(model.parameters(), None)
    if param is None or not param.is_cuda or info.mla:
        return  # (MLA: keys and values differ in size; Hugging Face does not initialise these early either)
    shape = getattr(model, "_get_static_cache_init_shape", None)
    shape = shape() if shape is not None else (info.kv_heads // info.shard.size, info.head_dim)
    if shape is None:
        return  # layers on several devices, heads that do not split over the ranks: lazily, in the graph
    dtype = getattr(model, "dtype", param.dtype)  # what generate() initialises with (a first parameter may be fp32)
    cache.early_initialization(ids.shape[0], *shape, dtype, param.device)


def cache_bucket(n: int) -> int:
    """A static cache length rounded up to 1/16 of an octave (at least 256 tokens): at most 6.25%
    more memory, and few enough distinct lengths that decode graphs stay bounded."""
    step = max(256, 2 ** (max(int(n), 1).bit_length() - 5))
    return math.ceil(n / step) * step


def bucket_static_caches(model: torch.nn.Module) -> None:
    """Round the length of every static cache `generate` allocates up to `cache_bucket`."""
    original = getattr(model, "_prepare_static_cache", None)
    if original is None or getattr(original, "_sparse_fx_bucketed", False):
        return

    @functools.wraps(original)
    def prepare(*args, **kwargs):
        if "max_cache_len" in kwargs:
            kwargs["max_cache_len"] = cache_bucket(kwargs["max_cache_len"])
        return original(*args, **kwargs)

    prepare._sparse_fx_bucketed = True
    model._prepare_static_cache = prepare

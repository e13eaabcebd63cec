"""`sparse_fx.compile`: hand a Hugging Face decoder to torch.compile with our rewriting backend."""

from __future__ import annotations

import functools

import torch

from .explain import Report
from .lowering import ops
from .measure import Measurements
from .plan import Plan
from .rewrite import rewrite
from .runtime.encoders import apply_head_mlp
from .runtime.state import Encoders, KVShape
from .state import GraphReport, ModelInfo, SparseState, side_cache_kind

BACKENDS = ("inductor", "eager")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile(  # noqa: A001 - the one-call API mirrors torch.compile
    model: torch.nn.Module,
    plan: str | Plan = "prism-g4",
    *,
    encoders=None,
    backend: str | None = None,
    mode: str | None = None,
    strict: bool = False,
    measure: bool = False,
    _search: bool = False,
    **plan_options,
) -> torch.nn.Module:
    """Make `model`'s decode attention sparse; returns the same model, its forward compiled.

    plan: a name (dense, oracle, hash, prism-g<G>, static-g<G>), a `Plan` or a plan JSON file;
    plan_options override its fields (budget, sink, local, rho, int2_group, bits, ...).
    encoders: trained signature encoders (object or path) for the hash plan; LSH without them.
    backend: "inductor" (default) compiles the rewritten graph; "eager" runs it as is (debugging,
    and fast CPU tests). mode: Inductor mode; default "reduce-overhead" (CUDA graphs) on CUDA.
    strict: raise instead of leaving any attention the plan wants sparse dense.
    measure: record every sparse layer's selection against dense attention (recall, attention
    mass, output error; read them with `sparse_fx.measurements(model)`); implies backend "eager".

    Works with a StaticCache (`generate(..., cache_implementation="static")` or your own
    `StaticCache`): prefill stays dense and fills the side caches, decode steps run sparse.
    `sparse_fx.explain(model)` shows every attention and what became of it.
    """
    if backend is None:
        backend = "eager" if measure else "inductor"
    if measure and backend != "eager":
        raise ValueError("sparse_fx: measure=True records in Python between graph ops: use backend='eager'")
    if backend not in BACKENDS:
        raise ValueError(f"sparse_fx: unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if mode is not None and mode not in MODES:
        raise ValueError(f"sparse_fx: unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"sparse_fx: expected a torch.nn.Module, got {type(model).__name__}")
    if model.training:
        raise ValueError("sparse_fx: the model is in training mode; sparse attention is for inference: call model.eval() first")
    if encoders is not None and "bits" not in plan_options and hasattr(encoders, "bits"):
        plan_options["bits"] = encoders.bits
    plan = Plan.parse(plan, **plan_options)
    if encoders is not None and plan.method != "hash":
        raise ValueError(f"sparse_fx: encoders only apply to the hash plan, not {plan.name!r}")
    encoders = encoders if encoders is not None else plan.encoders
    info = ModelInfo.of(model)
    info.check_plan(plan)
    trained = _load_encoders(encoders, model, plan) if encoders is not None else None
    state = SparseState(
        plan=plan,
        info=info,
        encoders=Encoders(plan.bits, plan.seed, trained),
        backend=backend,
        mode=mode,
        strict=strict,
        measurements=Measurements() if measure else None,
        search=_search,
    )
    previous = model.__dict__.get("forward")
    original = previous.original if isinstance(previous, SparseForward) else model.forward
    compiled = torch.compile(_own_frame(original), backend=_backend(state), fullgraph=True)
    model.forward = SparseForward(model, original, compiled, state)
    if getattr(model, "generation_config", None) is not None:
        # We are the one compile: Hugging Face's generate() must not wrap this forward again.
        model.generation_config.disable_compile = True
    return model


def explain(model: torch.nn.Module) -> Report:
    """Every SDPA node of the model's compiled graphs: layer, call form, role, decision, budget,
    side-cache bytes. Before the first decode step it traces one on a tiny StaticCache."""
    state = sparse_state(model)
    decode = [r for r in state.reports if r.kind == "decode"]
    prefill = [r for r in state.reports if r.kind == "prefill"]
    if decode:
        return Report(state.plan, state.info, decode[-1], prefill[-1] if prefill else None, state.side_caches.nbytes())
    return Report(state.plan, state.info, _trace_decode(model, state), None, 0, traced=True)


def measurements(model: torch.nn.Module) -> Measurements:
    """What the sparse layers selected, against dense attention (needs compile(..., measure=True))."""
    state = sparse_state(model)
    if state.measurements is None:
        raise ValueError("sparse_fx: compile the model with measure=True to record measurements")
    return state.measurements


def attach_cache(model: torch.nn.Module, cache) -> None:
    """Decode sparsely from a KV cache filled elsewhere (a dense prefill, a prefix cache).

    Writes the side caches the plan needs for the filled positions of `cache` (a Hugging Face
    StaticCache), exactly as a prefill through the compiled model would have.
    """
    state = sparse_state(model)
    with torch.no_grad():
        for layer, role in enumerate(state.roles):
            kind = side_cache_kind(state.plan.method, role)
            if kind is None:
                continue
            keys = cache.layers[layer].keys
            n = int(cache.layers[layer].get_seq_length())
            pos = torch.arange(n, device=keys.device)
            kv = KVShape.of(keys)
            if kind == "signature":
                enc = state.encoders.layer(layer, state.info.q_heads, kv.kv_heads, kv.head_dim, kv.device)
                logits = apply_head_mlp(keys[:, :, :n], *enc.key.params())
                ops.signature_write(state.side_caches.signature(layer, kv, state.plan.bits), logits, pos, True)
            else:
                ops.int2_write(*state.side_caches.int2(layer, kv, state.plan.int2_group), keys[:, :, :n], pos, True)


def sparse_state(model: torch.nn.Module) -> SparseState:
    forward = model.__dict__.get("forward")
    if not isinstance(forward, SparseForward):
        raise ValueError("sparse_fx: this model was not compiled with sparse_fx.compile(model, plan=...)")
    return forward.state


class SparseForward:
    """`model.forward` after `sparse_fx.compile`: every call goes through the compiled graphs."""

    def __init__(self, model: torch.nn.Module, original, compiled, state: SparseState):
        functools.update_wrapper(self, original)  # generate() inspects forward's signature
        self.model, self.original, self.compiled, self.state = model, original, compiled, state

    def __call__(self, *args, **kwargs):
        if self.model.training:
            raise RuntimeError("sparse_fx: the model is in training mode; sparse attention is for inference: call model.eval()")
        ids = _call_ids(args, kwargs)
        _mark_prefill_dynamic(ids, kwargs)
        _initialise_static_cache(self.model, ids, kwargs.get("past_key_values"))
        return self.compiled(*args, **kwargs)


def _call_ids(args, kwargs) -> torch.Tensor | None:
    """The call's token ids (or input embeddings), positional or by keyword."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    return kwargs.get("inputs_embeds") if ids is None else ids


def _initialise_static_cache(model: torch.nn.Module, ids, cache) -> None:
    """Allocate a fresh StaticCache before the compiled call, as `generate` does for compiled prefills.

    Left to allocate lazily, it would do so inside our compiled prefill, where Hugging Face cannot
    mark its tensors as static addresses; CUDA graphs then skip the prefill ("mutated inputs") and
    the decode graph's launch fails on the unmarked cache tensors. Only on CUDA, where CUDA graphs
    run: on CPU, compiling several model families in one process with early-allocated caches
    gave a GPT-NeoX prefill symbolic head shapes that our backend cannot handle (not understood yet).
    """
    layers = getattr(cache, "layers", None)
    if not layers or not hasattr(cache, "early_initialization") or not isinstance(ids, torch.Tensor):
        return
    if all(getattr(layer, "is_initialized", True) or not getattr(layer, "supports_early_init", False) for layer in layers):
        return
    param = next(model.parameters())
    if not param.is_cuda:
        return
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if getattr(text, "qk_head_dim", None) is not None:
        return  # MLA: keys and values differ in size; Hugging Face does not initialise these early either
    from .train import fingerprint

    shape = fingerprint(model)
    cache.early_initialization(ids.shape[0], shape["kv_heads"], shape["head_dim"], param.dtype, param.device)


def _mark_prefill_dynamic(ids, kwargs) -> None:
    """One prefill graph for every prompt length: a multi-token call's sequence dims are dynamic."""
    if not (isinstance(ids, torch.Tensor) and ids.dim() >= 2 and ids.shape[1] > 1):
        return
    for t in (ids, kwargs.get("attention_mask"), kwargs.get("position_ids")):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 1)


def _backend(state: SparseState):
    def sparse_fx_backend(gm: torch.fx.GraphModule, example_inputs):
        rewrite(gm, state)
        if state.backend == "eager":
            return gm.forward
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        mode = state.mode or ("reduce-overhead" if _on_cuda(example_inputs) else "default")
        import torch._inductor.config as inductor_config

        patches = dict(list_mode_options(mode))
        if hasattr(inductor_config, "use_static_cuda_launcher"):
            # torch 2.11's static launcher crashed (SIGSEGV) launching a kernel of our graphs while
            # CUDA graph trees recorded it; Triton's own launcher does not
            patches["use_static_cuda_launcher"] = False
        return compile_fx(gm, example_inputs, config_patches=patches)

    return sparse_fx_backend


def _own_frame(fn):
    """`fn` behind a trampoline with a code object of its own.

    Dynamo keeps its compiled graphs, and counts recompiles against its limit, per code object.
    Hugging Face forwards share one decorator code object across all models, so without this
    every compile of every model in the process would share one cache and one recompile budget.
    """

    def forward(*args, **kwargs):
        return fn(*args, **kwargs)

    forward.__code__ = forward.__code__.replace()
    return functools.wraps(fn)(forward)


def _on_cuda(example_inputs) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)


def _trace_decode(model: torch.nn.Module, state: SparseState) -> GraphReport:
    """Trace one decode step on a throwaway StaticCache and state (rewritten graph run eagerly)."""
    from transformers import StaticCache

    probe = SparseState(plan=state.plan, info=state.info, encoders=state.encoders, backend="eager")
    length = state.plan.window + state.plan.pool + 2
    cache = StaticCache(config=model.config, max_cache_len=length)
    ids = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        torch.compile(_own_frame(model.forward.original), backend=_backend(probe), fullgraph=True)(ids, past_key_values=cache)
    return probe.reports[-1]


def _load_encoders(encoders, model, plan: Plan):
    """Trained encoders (object or directory), checked against the model and the plan."""
    from .runtime.encoders import SignatureEncoders
    from .train import fingerprint

    if not isinstance(encoders, SignatureEncoders):
        encoders = SignatureEncoders.load(encoders)
    encoders.check(fingerprint(model))
    if encoders.bits != plan.bits:
        raise ValueError(f"sparse_fx: the encoders make {encoders.bits}-bit signatures but the plan asks for bits={plan.bits}")
    if encoders.metadata.get("train_config", {}).get("key_sharing", "kv") != "kv":
        raise ValueError("sparse_fx: these encoders sign keys per query head; the runtime serves KV-head signatures (key_sharing='kv')")
    return encoders

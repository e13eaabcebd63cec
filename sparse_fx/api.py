"""`sparse_fx.compile` and friends: the one-call front end."""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import methods, role_tables
from .backend import sparse_backend
from .compiled import CompiledState
from .explain import GraphReport, Report, Row
from .forward import SparseForward, bucket_static_caches
from .graph import side_cache_input
from .measure import Measurements
from .model_info import ModelInfo, attention_implementation, set_attention, use_sdpa
from .plan import Plan
from .speculate import Acceptance, LosslessGenerate, Speculation
from .speculate import install as install_speculation
from .runtime.encoders import Encoders, SignatureEncoders

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
    speculate: int | str | None = None,
    speculate_batch: str = "rows",
    _search: bool = False,
    **plan_options,
) -> torch.nn.Module:
    """Make `model`'s decode attention sparse; returns the same model, its forward compiled.

    plan: a name (dense, oracle, hash, prism-g<G>[-hash], static-g<G>[-hash]), a `Plan` or a plan
    JSON file; plan_options override its fields (budget, sink, local, rho, int2_group, proposal,
    bits, min_context, ...). On CUDA a decode graph whose static cache is shorter than where the
    plan was measured to pay keeps dense attention (min_context="auto"; 0 forces sparse).
    encoders: trained signature encoders (object or directory) for plans that score with signatures
    (hash, prism-g<G>-hash); LSH without them.
    backend: "inductor" (default) compiles the rewritten graph; "eager" runs it as is (debugging,
    and fast CPU tests). mode: Inductor mode; default "reduce-overhead" (CUDA graphs) on CUDA.
    strict: raise instead of leaving any attention the plan wants sparse dense (a cache shorter
    than min_context is no miss: the plan wants dense attention there).
    measure: record every sparse layer's selection against dense attention (recall, attention
    mass, output error; read them with `sparse_fx.measurements(model)`); implies backend "eager".
    speculate: lossless mode (`sparse_fx/speculate.py`): generate() drafts this many tokens (an int,
    or "auto" to choose from the measured acceptance) with the plan and verifies them with dense
    attention, emitting the dense model's tokens; `sparse_fx.acceptance(model)` reads how many drafts
    were accepted. speculate_batch: "rows" (each row keeps what it accepted) or "min" (the batch
    advances by the fewest accepted).

    Prefill runs the model's own attention (dense, uncompiled); decode steps on a StaticCache
    (`generate(..., cache_implementation="static")` or your own) run the rewritten graph. A model
    loaded with another attention implementation is switched to SDPA. `sparse_fx.explain(model)`
    shows every layer's attention and what became of it.
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
    speculation = Speculation(speculate, speculate_batch) if speculate is not None else None
    if speculate is None and speculate_batch != "rows":
        raise ValueError("sparse_fx: speculate_batch applies to lossless mode only: give speculate=<draft length> too")
    spec, plan = plan, Plan.parse(plan, **plan_options)
    method = methods.get(plan.method)
    if _search:
        method = method.for_search()
    if encoders is not None and not method.uses_encoders(plan):
        raise ValueError(f"sparse_fx: encoders only apply to plans that score with signatures (hash, "
                         f"prism with proposal='hash'), not {plan.name!r}")
    if encoders is not None and not isinstance(encoders, SignatureEncoders):
        encoders = SignatureEncoders.load(encoders)
    signatures = method.uses_encoders(plan)
    if encoders is not None and "bits" not in plan_options and encoders.bits != plan.options.bits:
        plan = Plan.parse(spec, **plan_options, bits=encoders.bits)  # the encoders' signature width
    encoders = encoders if encoders is not None else plan.options.encoders if signatures else None
    info = ModelInfo.of(model)
    plan = role_tables.resolve(plan, model, info)
    method.check(info, plan)
    trained = _load_encoders(encoders, model, info, plan) if encoders is not None else None
    previous = model.__dict__.get("forward")
    before = previous.before if isinstance(previous, SparseForward) else {
        "forward": previous, "_prepare_static_cache": model.__dict__.get("_prepare_static_cache"),
        "disable_compile": getattr(getattr(model, "generation_config", None), "disable_compile", None),
        "attention": attention_implementation(model)}
    switched = use_sdpa(model)
    note = f"attention: switched from attn_implementation={switched!r} to 'sdpa' (the call the pass rewrites)" if switched else ""
    bits = plan.options.bits if signatures else None
    state = CompiledState(plan=plan, info=info, method=method, encoders=Encoders(bits, plan.seed, trained),
                          backend=backend, mode=mode, strict=strict,
                          measurements=Measurements() if measure else None, attention_note=note,
                          speculation=speculation)
    original = previous.original if isinstance(previous, SparseForward) else model.forward
    compiled = torch.compile(_own_frame(original), backend=sparse_backend(state), fullgraph=True, dynamic=False)
    model.forward = SparseForward(model, original, compiled, state, before)
    if getattr(model, "generation_config", None) is not None:
        # We are the one compile: Hugging Face's generate() must not wrap this forward again.
        model.generation_config.disable_compile = True
    bucket_static_caches(model)
    if isinstance(model.__dict__.get("generate"), LosslessGenerate):
        del model.generate  # a previous compile's lossless mode
    if speculation is not None:
        install_speculation(model, speculation)
    return model


def explain(model: torch.nn.Module) -> Report:
    """Every layer's attention in the model's latest decode graph: call form, role, decision,
    budget, side-cache bytes, and why a layer stays dense. Before the first decode step it traces
    one on a tiny throwaway StaticCache."""
    state = sparse_state(model)
    decodes = [r for r in state.reports if r.decode]
    traced = not decodes
    if traced and state.info.shard.size > 1:
        raise ValueError("sparse_fx: explain() before the first decode step traces one through the model, which under "
                         "tensor parallelism every rank must run together; call it after a decode step (e.g. generate)")
    report = _trace_decode(model, state) if traced else decodes[-1]
    rows = list(report.rows)
    seen = {r.layer for r in rows}
    for i, role in enumerate(state.roles):
        if i not in seen:
            rows.append(Row(layer=i, call_form="-", role=role).dense(
                "no scaled_dot_product_attention call found for this layer in the traced graph"))
    rows.sort(key=lambda r: r.layer)
    prefills = [r for r in state.reports if not r.decode]
    own = "prefill (several tokens): the model's own dense attention, uncompiled; then the side caches are written"
    if state.speculation is not None:
        notes = [own, f"verify (lossless mode, gamma + 1 tokens): dense attention, {len(prefills)} compiled graph(s) "
                      "write the side caches"]
    else:
        notes = [f"prefill (several tokens): dense, {len(prefills)} compiled graph(s) write the side caches" if prefills
                 else own]
    if state.attention_note:
        notes.append(state.attention_note)
    if state.plan.note:
        notes.append(state.plan.note)
    if state.speculation is not None:
        forward = model.__dict__.get("generate")
        seen = forward.acceptance if isinstance(forward, LosslessGenerate) and forward.acceptance.rounds else None
        notes.append(state.speculation.describe() + (f"; measured: {seen}" if seen else ""))
    rule = _min_context_note(state, next(model.parameters()).device)
    if rule:
        notes.append(rule)
    shard = state.info.shard.describe(state.info.kv_heads)
    if shard:
        notes.append(f"tensor parallel: this report is {shard}; side caches and selections are this rank's heads only")
    return Report(plan=state.plan, method=state.method.describe(state.context), description=state.plan.description,
                  model_type=state.info.model_type, num_layers=state.info.num_layers, rows=rows,
                  side_cache_bytes=0 if traced else state.side_caches.nbytes(), notes=notes, traced=traced,
                  shard=state.info.shard)


def measurements(model: torch.nn.Module) -> Measurements:
    """What the sparse layers selected, against dense attention (needs compile(..., measure=True))."""
    state = sparse_state(model)
    if state.measurements is None:
        raise ValueError("sparse_fx: compile the model with measure=True to record measurements")
    return state.measurements


def acceptance(model: torch.nn.Module) -> Acceptance:
    """Lossless mode's counts since compile: drafts proposed and accepted, tokens per round, rounds
    at each draft length, seconds drafting and verifying (`.reset()` starts them again)."""
    sparse_state(model)
    generate = model.__dict__.get("generate")
    if not isinstance(generate, LosslessGenerate):
        raise ValueError("sparse_fx: compile the model with speculate=<draft length> for lossless mode")
    return generate.acceptance


def attach_cache(model: torch.nn.Module, cache) -> None:
    """Decode sparsely from a KV cache filled elsewhere (a dense prefill, a prefix cache).

    Writes the side caches the plan needs for every filled position of `cache` (a Hugging Face
    StaticCache), exactly as a prefill through the compiled model would have.
    """
    sparse_state(model).fill(cache)


def restore(model: torch.nn.Module) -> None:
    """Undo sparse_fx.compile: the model's forward, generate() settings and attention
    implementation as they were before (calibrate leaves the model as it found it)."""
    forward = model.__dict__.get("forward")
    if not isinstance(forward, SparseForward):
        return
    before = forward.before
    if isinstance(model.__dict__.get("generate"), LosslessGenerate):
        del model.generate
    for name in ("forward", "_prepare_static_cache"):
        if before[name] is None:
            model.__dict__.pop(name, None)
        else:
            setattr(model, name, before[name])
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.disable_compile = before["disable_compile"]
    if before["attention"] not in (None, attention_implementation(model)):
        set_attention(model, before["attention"])


def sparse_state(model: torch.nn.Module) -> CompiledState:
    forward = model.__dict__.get("forward")
    if not isinstance(forward, SparseForward):
        raise ValueError("sparse_fx: this model was not compiled with sparse_fx.compile(model, plan=...)")
    return forward.state


def _own_frame(fn):
    """`fn` behind a trampoline with a code object of its own.

    Dynamo keeps its compiled graphs, and counts recompiles against its limit, per code object.
    Hugging Face forwards share one decorator code object across all models, so without this
    every compile of every model in the process would share one cache and one recompile budget.
    Side caches come as `sparse_fx_side_caches` ({(layer, name): tensor}), marked as graph inputs.
    """

    def forward(*args, sparse_fx_side_caches=None, **kwargs):
        for (layer, name), tensor in (sparse_fx_side_caches or {}).items():
            side_cache_input(tensor, layer, name)
        return fn(*args, **kwargs)

    forward.__code__ = forward.__code__.replace()
    return functools.wraps(fn)(forward)


def _trace_decode(model: torch.nn.Module, state: CompiledState) -> GraphReport:
    """Trace one decode step on a throwaway StaticCache and state (rewritten graph run eagerly)."""
    from transformers import StaticCache

    # the tiny cache is shorter than any min_context: trace what a long enough cache runs
    probe = CompiledState(plan=dataclasses.replace(state.plan, min_context=0), info=state.info, method=state.method,
                          encoders=state.encoders, backend="eager")
    length = state.method.cache_to_trace(state.plan)
    cache = StaticCache(config=model.config, max_cache_len=length)
    ids = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        torch.compile(_own_frame(model.forward.original), backend=sparse_backend(probe), fullgraph=True,
                      dynamic=False)(ids, past_key_values=cache)
    return probe.reports[-1]


def _min_context_note(state: CompiledState, device: torch.device) -> str:
    """explain's line on which static cache lengths keep dense attention ("" when none do)."""
    plan = state.plan
    if plan.min_context != "auto":
        return (f"min_context {plan.min_context}: a decode step on a shorter static cache keeps dense attention"
                if plan.min_context else "")
    table = state.method.break_even(plan) if device.type == "cuda" else {}
    if not table:
        return ""
    points = ", ".join(f"{n} tokens at {rows}+ KV rows" for rows, n in sorted(table.items()))
    heads = state.info.kv_heads
    rows = f"batch x {heads // state.info.shard.size} KV heads here" if heads else "batch x KV heads"
    return (f"min_context='auto': a decode step keeps dense attention on a static cache shorter than where {plan.name} "
            f"was measured to pay on an H200 ({points}; KV rows = {rows}, fewer rows take the first point); "
            "min_context=0 forces sparse")


def _load_encoders(encoders, model, info: ModelInfo, plan: Plan) -> SignatureEncoders:
    """Trained encoders (object or directory), checked against the model and the plan."""
    if not isinstance(encoders, SignatureEncoders):
        encoders = SignatureEncoders.load(encoders)
    encoders.check(info.fingerprint(model))
    if encoders.bits != plan.options.bits:
        raise ValueError(f"sparse_fx: the encoders make {encoders.bits}-bit signatures but the plan asks for "
                         f"bits={plan.options.bits}")
    if encoders.metadata.get("train_config", {}).get("key_sharing", "kv") != "kv":
        raise ValueError("sparse_fx: these encoders sign keys per query head; the runtime serves KV-head signatures (key_sharing='kv')")
    return encoders

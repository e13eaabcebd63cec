"""Lossless mode: the plan's sparse model drafts, the dense model verifies (speculative decoding).

`sparse_fx.compile(model, plan, speculate=4)` makes `model.generate(...)` decode in rounds. A round
drafts gamma tokens one at a time through the compiled sparse decode graph, then runs the dense model
once over the last emitted token and the gamma drafts (one compiled graph of gamma + 1 queries, dense
attention, causal among them) and keeps the drafts up to the first one the dense model would not
have produced, plus the dense model's own token there. Greedy output is the dense model's argmax at
every position; sampled output has the dense model's distribution (rejection sampling of the
drafts). Every logits processor and warper of `generate` (temperature, top-k/p, min_new_tokens,
repetition penalty, ...) is applied to draft and verifier alike with each position's own history.

One cache: drafts write their K/V and side-cache rows at the next gamma slots of the same static
cache; the verify step rewrites all gamma + 1 of them densely (the side caches in its graph). Rows of a
batch accept different numbers of drafts. With `speculate_batch="rows"` (default) each row keeps all
it accepted: the next round starts after the longest row's tokens, and a row that kept fewer has
holes there that its attention mask hides for good (its position ids count its own tokens only).
The cache then needs up to min(batch, gamma + 1) x max_new_tokens slots beyond the prompt (the
memory overhead of the mode, with gamma + 1 rows of logits). `speculate_batch="min"`: the batch
advances by the fewest drafts any row accepted, without holes (max_new_tokens + gamma + 1 slots).
Models with sliding-window or chunked layers are refused: their ring-buffer caches cannot take back
a rejected draft.

The host reads a round's outcome (accepted counts, to emit tokens and check stops) once, at its end.
The next round's first draft depends only on device state (the verifier's token, positions, the
cache slot), so it is launched before that read whenever a next round is needed unless rows stop
early (some live row has more than gamma + 1 tokens left) and no logits processor reads the
history: the GPU drafts while the host books the round instead of idling through it. A row that
stops at EOS then leaves one draft step computed for nothing, and "auto" chooses that round's gamma
before seeing the last round's count.

gamma="auto" chooses gamma in `AUTO_GAMMAS` before each round to maximise expected tokens per second:
tokens per row and round E = (1 - a^(g+1)) / (1 - a) for a per-draft acceptance a (estimated over
the last `WINDOW` rounds as accepted / (accepted + rejections), prior 0.75), over time g * t_draft +
t_verify, both measured (before any measurement t_draft = t_verify / 2).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .compiled import filled

AUTO_GAMMAS = (1, 2, 4, 8)
MAX_GAMMA = 16
WINDOW = 16  # rounds the adaptive choice looks back on
BATCH_POLICIES = ("rows", "min")
# generate() options lossless mode refuses, with why (all other options behave as in generate())
REFUSED = {
    "num_beams": "beam search", "num_return_sequences": "several sequences per prompt",
    "output_scores": "returning scores", "output_logits": "returning logits",
    "output_attentions": "returning attentions", "output_hidden_states": "returning hidden states",
    "assistant_model": "another draft model", "prompt_lookup_num_tokens": "prompt lookup drafts",
    "streamer": "streaming", "custom_generate": "another decoding method",
}
# warpers that depend on the scores alone: one batched call serves every row and position
_STATELESS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
              "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper",
              "InfNanRemoveLogitsProcessor")


@dataclass(frozen=True)
class Speculation:
    """Lossless mode's settings: draft length (an int, or "auto") and the batch policy."""

    gamma: int | str = 4
    batch: str = "rows"

    def __post_init__(self) -> None:
        g = self.gamma
        if g != "auto" and (isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= MAX_GAMMA):
            raise ValueError(f"sparse_fx: speculate={g!r}: give the draft length, an int in 1..{MAX_GAMMA}, or 'auto' "
                             f"(chosen among {AUTO_GAMMAS} from the measured acceptance)")
        if self.batch not in BATCH_POLICIES:
            raise ValueError(f"sparse_fx: speculate_batch={self.batch!r}; valid: 'rows' (each row keeps what it accepted) "
                             "or 'min' (the batch advances by the fewest accepted)")

    @property
    def largest(self) -> int:
        return max(AUTO_GAMMAS) if self.gamma == "auto" else self.gamma

    def describe(self) -> str:
        gamma = f"gamma chosen among {AUTO_GAMMAS} from the measured acceptance" if self.gamma == "auto" else f"gamma {self.gamma}"
        batch = "each row keeps what it accepted" if self.batch == "rows" else "the batch advances by the fewest accepted"
        return (f"lossless (speculate): the plan drafts, dense attention verifies; generate() emits the dense model's "
                f"tokens ({gamma}; {batch})")


@dataclass
class Acceptance:
    """What lossless mode's rounds did since compile (or `reset`), counted per batch row."""

    rounds: int = 0
    drafted: int = 0  # drafts proposed to rows still generating
    accepted: int = 0  # of those, the ones the dense model agreed with
    emitted: int = 0  # tokens emitted (accepted drafts plus the verifier's own token)
    row_rounds: int = 0  # (round, row still generating) pairs
    uneven: int = 0  # rounds whose live rows accepted different numbers of drafts
    full: int = 0  # (round, live row) pairs that accepted every draft
    seconds: float = 0.0  # wall clock of the rounds (each ends in a device-to-host read)
    gammas: dict[int, int] = field(default_factory=dict)  # rounds run at each gamma
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Share of drafted tokens the dense model accepted."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def per_draft(self) -> float:
        """The per-draft acceptance a of the geometric model (each draft accepted with probability a
        until the first rejection): accepted / (accepted + rejections)."""
        rejections = self.row_rounds - self.full
        return self.accepted / (self.accepted + rejections) if self.accepted + rejections else float("nan")

    @property
    def tokens_per_round(self) -> float:
        """Tokens a row emits per round (per dense verification)."""
        return self.emitted / self.row_rounds if self.row_rounds else float("nan")

    def reset(self) -> None:
        self.__init__()

    def __str__(self) -> str:
        g = ", ".join(f"{k}: {v}" for k, v in sorted(self.gammas.items()))
        return (f"acceptance {self.rate:.3f} ({self.accepted}/{self.drafted} drafts), {self.tokens_per_round:.2f} tokens "
                f"per row and round over {self.rounds} rounds (rounds by gamma: {g})")


class GammaChooser:
    """The adaptive draft length (module docstring)."""

    def __init__(self, speculation: Speculation):
        self.fixed = None if speculation.gamma == "auto" else speculation.gamma
        self.history: deque[tuple[int, int]] = deque(maxlen=WINDOW)  # (accepted, rejections) per round
        self.draft_time: float | None = None  # seconds per draft step
        self.verify_time: dict[int, float] = {}

    def next(self) -> int:
        if self.fixed is not None:
            return self.fixed
        a = self.acceptance()
        t_verify = self.verify_time or {4: 1.0}
        t_draft = self.draft_time if self.draft_time is not None else 0.5 * sum(t_verify.values()) / len(t_verify)

        def rate(g):
            tokens = g + 1 if a >= 1 else (1 - a ** (g + 1)) / (1 - a)
            near = min(t_verify, key=lambda k: abs(k - g))  # verify cost taken as the nearest measured gamma's
            return tokens / (g * t_draft + t_verify.get(g, t_verify[near]))

        return max(AUTO_GAMMAS, key=rate)

    def acceptance(self) -> float:
        accepted = 3 + sum(a for a, _ in self.history)
        return accepted / (accepted + 1 + sum(r for _, r in self.history))

    def observe(self, gamma: int, accepted: int, rejections: int, draft_s: float | None, verify_s: float | None) -> None:
        self.history.append((accepted, rejections))
        if draft_s is not None:
            step = draft_s / gamma
            self.draft_time = step if self.draft_time is None else 0.8 * self.draft_time + 0.2 * step
        if verify_s is not None:
            old = self.verify_time.get(gamma)
            self.verify_time[gamma] = verify_s if old is None else 0.8 * old + 0.2 * verify_s


def install(model: torch.nn.Module, speculation: Speculation) -> None:
    """Make `model.generate` decode losslessly (undone by `sparse_fx.api.restore`)."""
    from .model_info import ModelInfo

    info = ModelInfo.of(model)
    if info.local:
        raise ValueError(f"sparse_fx: speculate: layers {sorted(info.local)} are local attention (sliding window or "
                         "chunked), whose ring-buffer caches cannot take back a rejected draft; lossless mode needs "
                         "models whose layers all attend to the whole cache")
    if info.shard.size > 1:
        raise ValueError("sparse_fx: speculate under tensor parallelism is not supported: every rank would draw its "
                         "own acceptance decisions")
    if not callable(getattr(type(model), "generate", None)):
        raise ValueError(f"sparse_fx: speculate needs a model with generate() (a Hugging Face causal LM), not "
                         f"{type(model).__name__}")
    model.generate = LosslessGenerate(model, speculation)


class LosslessGenerate:
    """`model.generate` in lossless mode: Hugging Face's generate() with our decoding method."""

    def __init__(self, model: torch.nn.Module, speculation: Speculation):
        functools.update_wrapper(self, type(model).generate)
        self.model, self.speculation = model, speculation
        self.acceptance = Acceptance()
        self.chooser = GammaChooser(speculation)

    def __call__(self, inputs=None, generation_config=None, **kwargs):
        model = self.model
        gen, _ = model._prepare_generation_config(generation_config, **dict(kwargs))
        for name, what in REFUSED.items():
            value = kwargs.get(name, getattr(gen, name, None))
            if value is not None and value is not False and not (type(value) is int and value <= 1):
                raise ValueError(f"sparse_fx: lossless mode (speculate) does not support {what} ({name}={value!r}); "
                                 "compile without speculate for it")
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError("sparse_fx: lossless mode takes input_ids [batch, prompt length] (inputs_embeds: no)")
        if ids.shape[1] == 0:
            raise ValueError(f"sparse_fx: the prompt is empty (input of shape {tuple(ids.shape)}); give the model at "
                             "least one token")
        batch, prompt = ids.shape
        new = gen.max_new_tokens if gen.max_new_tokens is not None else max((gen.max_length or 20) - prompt, 1)
        kwargs.pop("input_ids", None)
        kwargs.pop("cache_implementation", None)
        gamma = self.speculation.largest
        rows = min(batch, gamma + 1) if self.speculation.batch == "rows" else 1
        need = prompt + rows * new + gamma + 1  # (module docstring: the holes of rows that accepted fewer)
        cache = kwargs.pop("past_key_values", None)
        if cache is None:
            from transformers import StaticCache

            from .forward import cache_bucket

            cache = StaticCache(config=model.config, max_cache_len=cache_bucket(need))
        else:
            _check_callers_cache(cache, need)
        return type(model).generate(model, ids, generation_config, past_key_values=cache,
                                    custom_generate=functools.partial(decode, speculation=self), **kwargs)


def _check_callers_cache(cache, need: int) -> None:
    """A cache the caller passes must be a static cache whose filled slots are the prompt's first
    tokens, in order (one a lossless call left holes in is refused), with room for the call."""
    from .compiled import static_layers

    layers = static_layers(cache)
    if layers is None:
        raise ValueError(f"sparse_fx: lossless mode needs a static cache, not {type(cache).__name__}; pass none (it "
                         "allocates one) or a transformers.StaticCache")
    if getattr(cache, "_sparse_fx_holes", False):
        raise ValueError("sparse_fx: this cache comes from a lossless call whose rows accepted different numbers of drafts "
                         "(speculate_batch='rows'): its slots are not the tokens in order; start from the prompt, or use "
                         "speculate_batch='min' for caches you continue from")
    if layers[0].max_cache_len < need:
        raise ValueError(f"sparse_fx: the cache holds {layers[0].max_cache_len} slots; this lossless call may need {need} "
                         "(prompt + max_new_tokens x rows that may keep holes + draft length + 1)")


def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, speculation: LosslessGenerate,
           synced_gpus=False, streamer=None, **model_kwargs):
    """Hugging Face's decoding-method interface (`custom_generate`): the rounds described above."""
    return _Rounds(model, speculation, input_ids, logits_processor, stopping_criteria, generation_config,
                   model_kwargs).run()


class _Rounds:
    def __init__(self, model, owner: LosslessGenerate, ids, processors, stopping, gen, kwargs):
        from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

        self.model, self.owner, self.gen = model, owner, gen
        self.policy = owner.speculation.batch
        self.cache = kwargs["past_key_values"]
        self.processors = processors
        self.stateless = all(type(p).__name__ in _STATELESS for p in processors)
        self.other_stops = [c for c in stopping if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]
        self.stopping = stopping
        self.eos = gen._eos_token_tensor
        self.eos_ids = set(self.eos.reshape(-1).tolist()) if self.eos is not None else set()
        self.pad = gen._pad_token_tensor
        self.sample = bool(gen.do_sample)
        self.ids = ids
        self.batch, self.prompt = ids.shape
        self.max_length = gen.max_length
        mask = kwargs.get("attention_mask")
        self.mask2d = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
        self.kwargs = {k: v for k, v in kwargs.items() if k not in ("attention_mask", "position_ids", "past_key_values",
                                                                   "use_cache", "logits_to_keep")}
        self.return_dict = gen.return_dict_in_generate
        self.device = ids.device

    # ------------------------------------------------------------------ the model calls
    def _set_length(self, n: int | torch.Tensor) -> None:
        """Every layer's filled length: a host int, or a device scalar (copied without a host read)."""
        for layer in self.cache.layers:
            if isinstance(n, torch.Tensor):
                layer.cumulative_length.copy_(n)
            else:
                layer.cumulative_length.fill_(n)

    def _mask(self, q: int) -> object:
        """The 4D masks of q new tokens at the cache's current length (as generate makes them for a
        static cache): causal by slot, and only the slots `self.valid` marks for each row."""
        from transformers.masking_utils import create_masks_for_generate

        make = getattr(self.model, "create_masks_for_generate", create_masks_for_generate)
        return make(config=self.model.config, inputs_embeds=torch.empty((self.batch, q, 0), dtype=self.model.dtype,
                                                                         device=self.device),
                    attention_mask=self.valid, past_key_values=self.cache, position_ids=None)

    def _call(self, tokens: torch.Tensor, positions: torch.Tensor, verify: bool) -> torch.Tensor:
        inputs = dict(input_ids=tokens, position_ids=positions, attention_mask=self._mask(tokens.shape[1]),
                      past_key_values=self.cache, use_cache=True, **self.kwargs)
        forward = self.model.forward
        if self.device.type == "cuda":
            # Two graphs alternate (draft, verify): tell CUDA graph trees that no output of an earlier
            # replay is alive (the logits are copied out below), so each replays from the tree's root
            # instead of being recorded anew after the other
            torch.compiler.cudagraph_mark_step_begin()
        out = forward.verify(**inputs) if verify else forward(**inputs)
        return out.logits.to(torch.float32, copy=True)

    # ------------------------------------------------------------------ scores
    def _scores(self, logits: torch.Tensor, history: list[list[int]], start: int) -> torch.Tensor:
        """The processed scores of logits [B, T, V]: position t of row b follows the prompt, the row's
        emitted tokens and the round's drafts self.tokens[b, 1 : start + t + 1]."""
        if not len(self.processors):
            return logits
        B, T, V = logits.shape
        if self.stateless:
            flat = logits.reshape(B * T, V)
            return self.processors(torch.zeros(B * T, 1, dtype=torch.long, device=self.device), flat).reshape(B, T, V)
        out = torch.empty_like(logits)
        for b in range(B):
            emitted = torch.tensor(history[b], dtype=torch.long, device=self.device)
            for t in range(T):
                seq = torch.cat([self.ids[b], emitted, self.tokens[b, 1 : start + t + 1]])[None]
                out[b, t] = self.processors(seq, logits[b, t][None])[0]
        return out

    def _choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A token per row from scores [B, V]: argmax, or a sample with its distribution."""
        if not self.sample:
            return scores.argmax(-1), None
        probs = torch.softmax(scores, -1)
        return torch.multinomial(probs, 1)[:, 0], probs

    # ------------------------------------------------------------------ the loop
    def run(self):
        B, P, dev = self.batch, self.prompt, self.device
        L = self.cache.layers[0].max_cache_len
        self.cols = torch.arange(L, device=dev)
        self.valid = torch.zeros(B, L, dtype=torch.bool, device=dev)
        self.valid[:, :P] = self.mask2d
        positions = (self.mask2d.long().cumsum(-1) - 1).clamp(min=0)
        held = filled(self.cache.layers[0])  # a caller's cache may hold the prompt's first tokens
        if held >= P:
            raise ValueError(f"sparse_fx: the cache already holds {held} tokens, the whole prompt of {P}: nothing to prefill")
        out = self.model.forward.prefill(input_ids=self.ids[:, held:], attention_mask=self.mask2d.long(), position_ids=positions[:, held:],
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1, **self.kwargs)
        history: list[list[int]] = [[] for _ in range(B)]  # emitted tokens per row
        self.tokens = torch.zeros(B, 0, dtype=torch.long, device=dev)
        last, _ = self._choose(self._scores(out.logits[:, -1:].float(), history, 0)[:, 0])
        pos = self.mask2d.long().sum(-1)  # each row's position of `last`
        done = self._emit(history, [[t] for t in last.tolist()], [1] * B, [False] * B)
        slot, uneven = P, self.owner.acceptance.uneven
        slot_t = torch.tensor(P, device=dev)  # `slot` on the device, which the next round's launch reads
        start = time.perf_counter()
        begun = None  # a round whose first draft was launched before the last round's read
        while not all(done):
            if begun is None:
                g = min(self.owner.chooser.next(), L - slot - 1)
                if g < 1:
                    raise RuntimeError(f"sparse_fx: lossless mode ran out of cache slots ({L}); report this")
                begun = self._begin(g, slot_t, last, pos, history)
            g, drafts, qs, timer, compiles, tok = begun
            for i in range(1, g):
                tok = self._draft(tok, pos + i, history, i, drafts, qs)
            timer.mark()
            self._set_length(slot_t)
            logits = self._call(self.tokens, pos[:, None] + torch.arange(g + 1, device=dev), verify=True)
            n, fix = self._accept(self._scores(logits, history, 0), torch.stack(drafts, 1), qs)
            timer.mark()
            live = self._to_device([not x for x in done])
            keep = torch.where(live, n, g).amin().expand(B) if self.policy == "min" else n
            d = self.tokens[:, 1:]
            nxt = torch.where(keep < n, d.gather(1, keep.clamp(max=g - 1)[:, None])[:, 0], fix)
            new = torch.cat([d, d[:, :1]], 1).scatter(1, keep[:, None], nxt[:, None])  # the kept drafts, then nxt
            # a row's slots after its kept tokens are holes its mask hides from now on
            self.valid = torch.where(self._round_slots(slot_t, g), self.cols - slot_t <= keep[:, None], self.valid)
            pos = pos + keep + 1
            last = nxt
            slot_t = slot_t + torch.where(live, keep, -1).amax() + 1
            read = self._to_host(torch.cat([n[:, None], keep[:, None], new], 1))  # the round's outcome
            # The next round's first draft reads only device state: launch it before this round's
            # device-to-host read, so the GPU drafts while the host books this round (module docstring)
            begun = None
            if self.stateless and self._continues(history, done, g):
                g_next = min(self.owner.chooser.next(), L - (slot + g + 1) - 1)  # slot + g + 1 >= the next slot
                if g_next >= 1:
                    begun = self._begin(g_next, slot_t, last, pos, history)
            outcome = read()
            accepted, kept = [r[0] for r in outcome], [r[1] for r in outcome]
            rows = [b for b in range(B) if not done[b]]
            self._count(g, [accepted[b] for b in rows], [kept[b] for b in rows], timer,
                        compiled=len(self.model.forward.state.reports) != compiles)
            done = self._emit(history, [r[2:] for r in outcome], [k + 1 for k in kept], done, counted=True)
            slot += max(kept[b] for b in rows) + 1
        self.owner.acceptance.seconds += time.perf_counter() - start
        self._set_length(slot)
        if self.owner.acceptance.uneven > uneven and self.policy == "rows":
            self.cache._sparse_fx_holes = True
        return self._result(history)

    def _begin(self, g: int, slot_t: torch.Tensor, last: torch.Tensor, pos: torch.Tensor, history):
        """Open a round of g drafts at cache slot slot_t (a device scalar) and launch its first draft:
        (g, drafts, their distributions, the round's timer, the compile count before it, the draft)."""
        compiles = len(self.model.forward.state.reports)
        self.valid = self.valid | self._round_slots(slot_t, g)
        self._set_length(slot_t)
        timer = _Timer(self.device)
        self.tokens = last[:, None]
        drafts, qs = [], []
        tok = self._draft(last, pos, history, 0, drafts, qs)
        return g, drafts, qs, timer, compiles, tok

    def _round_slots(self, slot_t: torch.Tensor, g: int) -> torch.Tensor:
        """[L] bool: the g + 1 cache slots a round at slot slot_t (a device scalar) writes."""
        return (self.cols >= slot_t) & (self.cols <= slot_t + g)

    def _draft(self, tok: torch.Tensor, positions: torch.Tensor, history, i: int, drafts: list, qs: list) -> torch.Tensor:
        """The round's draft i: one step of the sparse graph after token tok [B] (self.tokens' last)."""
        logits = self._call(tok[:, None], positions[:, None], verify=False)[:, -1:]
        tok, q = self._choose(self._scores(logits, history, i)[:, 0])
        drafts.append(tok)
        qs.append(q)
        self.tokens = torch.cat([self.tokens, tok[:, None]], 1)
        return tok

    def _to_device(self, values: list) -> torch.Tensor:
        """A small host list on the device, without waiting for the work queued there (pinned memory)."""
        cuda = self.device.type == "cuda"
        return torch.tensor(values, pin_memory=cuda).to(self.device, non_blocking=cuda)

    def _to_host(self, t: torch.Tensor):
        """Start copying t to the host; returns a function that waits for that copy only (not for work
        queued after it) and gives its rows as lists."""
        if self.device.type != "cuda":
            return t.tolist
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def read() -> list:
            copied.synchronize()
            return host.tolist()

        return read

    def _continues(self, history, done: list[bool], g: int) -> bool:
        """Whether a round after the current one is certain unless a row stops early (EOS or another
        criterion): some live row has more than the current round's g + 1 tokens left to emit."""
        return any(self.max_length - self.prompt - len(history[b]) > g + 1
                   for b in range(self.batch) if not done[b])

    def _count(self, g: int, accepted: list[int], kept: list[int], timer: _Timer, compiled: bool) -> None:
        """Record a round (live rows only) in the acceptance counts and the adaptive gamma's history: per
        row under "rows", the batch's advance under "min"."""
        a = self.owner.acceptance
        a.rounds += 1
        a.row_rounds += len(accepted)
        a.drafted += g * len(accepted)
        a.accepted += sum(accepted)
        a.uneven += len(set(accepted)) > 1
        a.full += sum(1 for n in accepted if n == g)
        a.gammas[g] = a.gammas.get(g, 0) + 1
        draft_s, verify_s = timer.seconds()
        a.draft_seconds += draft_s
        a.verify_seconds += verify_s
        advance = accepted if self.policy == "rows" else kept[:1]
        self.owner.chooser.observe(g, sum(advance), sum(1 for k in advance if k < g),
                                   None if compiled else draft_s, None if compiled else verify_s)

    def _accept(self, scores: torch.Tensor, d: torch.Tensor, qs: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted drafts [B], the verifier's token after them [B]) from verify scores [B, g+1, V]."""
        B, T, V = scores.shape
        g = T - 1
        if not self.sample:
            target = scores.argmax(-1)  # [B, g+1]
            ok = (d == target[:, :g]).long().cumprod(1)
            n = ok.sum(1)
            return n, target.gather(1, n[:, None])[:, 0]
        p = torch.softmax(scores, -1)  # [B, g+1, V]
        q = torch.stack(qs, 1)  # [B, g, V]
        pd = p[:, :g].gather(2, d[..., None])[..., 0]
        qd = q.gather(2, d[..., None])[..., 0]
        u = torch.rand(B, g, device=self.device)
        ok = (u * qd <= pd).long().cumprod(1)  # accept with probability min(1, p/q)
        n = ok.sum(1)
        rest = p.gather(1, n[:, None, None].expand(B, 1, V))[:, 0]
        q_at = torch.cat([q, torch.zeros_like(q[:, :1])], 1).gather(1, n[:, None, None].expand(B, 1, V))[:, 0]
        residual = (rest - q_at).clamp(min=0)
        total = residual.sum(-1, keepdim=True)
        residual = torch.where(total > 0, residual / total.clamp(min=1e-30), rest)  # p == q there: sample p
        return n, torch.multinomial(residual, 1)[:, 0]

    def _emit(self, history: list[list[int]], new: list[list[int]], counts: list[int], done: list[bool],
              counted: bool = False) -> list[bool]:
        """Append each live row's first counts[b] tokens of new[b], stopping it at EOS, at max_length
        or at another stopping criterion (a round's tokens are counted as emitted); the rows' done
        flags after. Host lists only: no device read here."""
        after = list(done)
        for b in range(self.batch):
            if done[b]:
                continue
            take = []
            for t in new[b][: counts[b]]:
                take.append(t)
                if (t in self.eos_ids or self.prompt + len(history[b]) + len(take) >= self.max_length
                        or self._stops(b, history[b] + take)):
                    after[b] = True
                    break
            history[b].extend(take)
            self.owner.acceptance.emitted += len(take) if counted else 0
        return after

    def _stops(self, b: int, emitted: list[int]) -> bool:
        if not self.other_stops:
            return False
        seq = torch.cat([self.ids[b], torch.tensor(emitted, dtype=torch.long, device=self.device)])[None]
        scores = torch.zeros(1, 1, device=self.device)
        return any(bool(c(seq, scores).any()) for c in self.other_stops)

    def _result(self, history: list[list[int]]):
        pad = int(self.pad) if self.pad is not None else (int(self.eos.reshape(-1)[0]) if self.eos is not None else 0)
        width = max(len(h) for h in history)
        new = torch.tensor([h + [pad] * (width - len(h)) for h in history], dtype=torch.long).reshape(self.batch, width)
        sequences = torch.cat([self.ids, new.to(self.device)], 1)
        if self.return_dict:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=sequences, past_key_values=self.cache)
        return sequences


class _Timer:
    """Seconds of the draft and verify phases: CUDA events (no synchronisation of their own: read after
    the round's device-to-host read), or wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = [self._now()]

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self) -> None:
        self.marks.append(self._now())

    def seconds(self) -> tuple[float, float]:
        a, b, c = self.marks
        if self.cuda:
            return a.elapsed_time(b) / 1e3, b.elapsed_time(c) / 1e3
        return b - a, c - b


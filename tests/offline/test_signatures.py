"""Learned signature encoders: training lowers the loss, files round-trip, fingerprints guard, CLI."""

import copy
import subprocess
import sys

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from transformers import StaticCache

import sparse_fx
from support import TRAIN_SMALL, tiny_model
from sparse_fx.model_info import ModelInfo
from sparse_fx.offline.train import TrainConfig, capture_windows, train_on_windows



@pytest.fixture(scope="module")
def trained():
    model = tiny_model("llama", layers=2)
    ids = torch.randint(1, 128, (3, 400), generator=torch.Generator().manual_seed(0))
    enc = sparse_fx.train_signatures(model, ids, progress=False, **TRAIN_SMALL)
    return model, enc


def test_training_lowers_the_loss_and_is_deterministic(trained):
    model, enc = trained
    loss = enc.metadata["loss_history"]
    assert loss[-1] < 0.8 * loss[0], loss
    again = sparse_fx.train_signatures(model, torch.randint(1, 128, (3, 400), generator=torch.Generator().manual_seed(0)),
                                       progress=False, **TRAIN_SMALL)
    assert all(torch.equal(a, b) for a, b in zip(enc.layer(1).key.weights, again.layer(1).key.weights))


def test_trained_encoders_beat_random_ones_on_their_own_objective():
    model = tiny_model("llama", layers=2)
    ids = torch.randint(1, 128, (3, 400), generator=torch.Generator().manual_seed(1))
    cfg = TrainConfig(**TRAIN_SMALL)
    data = capture_windows(model, ids, cfg, progress=False)
    _, history = train_on_windows(data, TrainConfig(**{**TRAIN_SMALL, "steps": 1, "lr": 0.0}), progress=False)
    _, trained_history = train_on_windows(data, cfg, progress=False)
    assert trained_history[-1] < history[0]


@pytest.mark.parametrize("sharing,labels", [("kv", "kv"), ("kv", "query"), ("query", "query")])
def test_sampled_loss_is_the_weighted_bce_of_the_served_score(sharing, labels):
    """The softplus form of the loss equals torch's weighted BCE over the sampled (query, key) pairs
    of each selection unit, for all keys and a subsample: the logit is temp * the sum of tanh-code
    dots over the unit's query heads + bias (with "kv" labels a KV head sums its query heads, the
    served score's order; with "query" labels each query head is a unit), targets are the unit's labels, positives weigh alpha + beta * n,
    other candidates 1, and keys the plan keeps (first `sink`, last `local`) or after the query 0."""
    from sparse_fx.offline.train import Window, _loss, _mlp

    gen = torch.Generator().manual_seed(5)
    layers, hq, hkv, T, S, D, top, sink, local = 2, 4, 2, 40, 6, 8, 5, 3, 4
    G, units, key_heads = hq // hkv, (hkv if labels == "kv" else hq), (hkv if sharing == "kv" else hq)
    positions = torch.sort(torch.randint(sink + local + top + 2, T, (S,), generator=gen)).values
    queries = torch.randn(layers, hq, S, D, generator=gen)
    keys = torch.randn(layers, hkv, T, D, generator=gen).half()
    positives = torch.stack([torch.stack([torch.stack([sink + torch.randperm(int(p) - local - sink + 1, generator=gen)[:top]
                                                    for p in positions]) for _ in range(units)]) for _ in range(layers)])
    w = Window(keys, queries, positives, positives.int(), positions)
    cfg = TrainConfig(bits=32, hidden=16, context=T * 10, top=top, alpha=1.5, beta=0.25, sink=sink, local=local,
                      key_sharing=sharing, labels=labels)
    q_enc, k_enc = _mlp(layers * hq, D, 16, 32, gen), _mlp(layers * key_heads, D, 16, 32, gen)
    temp, bias = torch.rand(layers * units, 1, 1, generator=gen) + 0.1, torch.randn(layers * units, 1, 1, generator=gen)
    qi = torch.tensor([4, 0, 2])
    for kj in (torch.arange(T), torch.sort(torch.randperm(T, generator=gen)[:17]).values):
        got = _loss(w, qi, kj, q_enc, k_enc, temp, bias, cfg, G=G)
        qb = torch.tanh(q_enc(queries[:, :, qi].reshape(1, -1, 3, D).double()))[0].reshape(layers, hq, 3, 32)
        k_in = keys[:, :, kj].double().repeat_interleave(G if sharing == "query" else 1, 1)
        kb = torch.tanh(k_enc(k_in.reshape(1, -1, len(kj), D)))[0].reshape(layers, key_heads, len(kj), 32)
        x = torch.zeros(layers, units, 3, len(kj), dtype=torch.float64)
        for layer in range(layers):
            for h in range(hq):
                u = h // G if labels == "kv" else h
                x[layer, u] += qb[layer, h] @ kb[layer, h // G if sharing == "kv" else h].T
        x = x.reshape(layers * units, 3, -1) * temp.double() + bias.double()
        target = (kj[None, None, :, None] == positives[:, :, qi].reshape(layers * units, 3, 1, top)).any(-1).double()
        p = positions[qi][None, :, None]
        candidate = (kj[None, None, :] >= sink) & (kj[None, None, :] <= p - local)
        weight = candidate * torch.where(target > 0, 1.5 + 0.25 * (p + 1).double(), 1.0)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(x, target, weight=weight, reduction="sum")
        torch.testing.assert_close(got.double(), bce / weight.sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("labels", ["kv", "query"])
def test_labels_are_the_top_candidates_by_attention_mass(labels):
    """Against fp64 attention recomputed from the captured queries and keys: a KV head's labels are
    its top keys by attention mass summed over its query heads (a query head's by its own, with
    "query" labels), among the keys the plan does not keep anyway, distinct and visible."""
    model = tiny_model("llama", layers=2)
    ids = torch.randint(1, 128, (1, 400), generator=torch.Generator().manual_seed(3))
    cfg = TrainConfig(**{**TRAIN_SMALL, "sink": 5, "local": 7, "labels": labels})
    [w] = capture_windows(model, ids, cfg, progress=False)
    layers, hq, S, D = w.queries.shape
    G = hq // w.keys.shape[1]
    logits = (w.queries.double() @ w.keys.double().repeat_interleave(G, 1).transpose(-1, -2)) * D**-0.5
    key = torch.arange(ids.shape[1])
    mass = torch.softmax(logits.masked_fill(key > w.positions[:, None], float("-inf")), -1)
    if labels == "kv":
        mass = mass.reshape(layers, -1, G, S, ids.shape[1]).sum(2)
    candidate = (key >= 5) & (key <= w.positions[:, None] - 7)  # [S, T]
    lab = w.labels.long()
    assert lab.shape == (*mass.shape[:3], cfg.top)
    assert candidate.expand_as(mass).gather(-1, lab).all()
    assert (lab.sort(-1).values.diff(dim=-1) > 0).all()
    chosen = torch.zeros_like(mass, dtype=torch.bool).scatter_(-1, lab, True)
    weakest_label = mass.gather(-1, lab).min(-1).values
    strongest_other = mass.masked_fill(chosen | ~candidate, -1.0).max(-1).values
    assert (weakest_label >= strongest_other - 1e-3 * mass.amax(-1)).all()  # keys were captured in fp16


@pytest.mark.parametrize("fixed", [(0, 0), (3, 4)])
def test_selection_recall_counts_the_true_top_k_inside_the_budget(fixed):
    """Against a loop over queries: a query at position p keeps floor((p+1)/s) keys by score, plus
    the first `sink` and last `local` keys when `fixed` is given; recall@k is the share of its true
    top-k among them, averaged over layers, query heads and queries."""
    from sparse_fx.offline.train import Window, selection_recall

    gen = torch.Generator().manual_seed(7)
    layers, hq, hkv, T, S, D, k = 2, 4, 2, 48, 5, 8, 6
    positions = torch.sort(torch.randint(20, T, (S,), generator=gen)).values
    queries, keys = torch.randn(layers, hq, S, D, generator=gen), torch.randn(layers, hkv, T, D, generator=gen)
    logits = (queries @ keys.repeat_interleave(2, 1).transpose(-1, -2)).masked_fill(torch.arange(T) > positions[:, None], -1e9)
    ranked = torch.topk(logits, k, -1).indices.int()
    w = Window(keys.half(), queries, ranked, ranked, positions)  # labels: unused by recall
    noise = torch.randn(layers, hkv, S, T, generator=gen)  # a score with no tie and no relation to attention

    def score(layer, q, kk, pos):
        return noise[layer]

    sink, local = fixed
    for s in (4, 8):
        expect = []
        for layer in range(layers):
            for h in range(hq):
                for i, p in enumerate(positions.tolist()):
                    kept = {j for j in range(p + 1) if j < sink or j > p - local}
                    rest = sorted((j for j in range(p + 1) if j not in kept), key=lambda j: -noise[layer, h // 2, i, j].item())
                    chosen = kept | set(rest[: (p + 1) // s])
                    expect.append(sum(int(j) in chosen for j in w.ranked[layer, h, i, :k]) / k)
        got = selection_recall([w], score, fractions=(1 / s,), k=k, fixed=fixed)[1 / s]
        assert got == pytest.approx(sum(expect) / len(expect), abs=1e-6)  # float32 means


def test_save_load_round_trip_and_compile_from_path(trained, tmp_path):
    model, enc = trained
    enc.save(tmp_path / "enc")
    back = sparse_fx.SignatureEncoders.load(tmp_path / "enc")
    assert back.fingerprint == enc.fingerprint == ModelInfo.of(model).fingerprint(model) and back.bits == 32
    for a, b in zip(enc.layers, back.layers):
        for x, y in zip(a.query.params() + a.key.params(), b.query.params() + b.key.params()):
            assert torch.equal(x, y)
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(2))
    outs = []
    for source in (enc, str(tmp_path / "enc")):
        m = sparse_fx.compile(copy.deepcopy(model), "hash", encoders=source, backend="eager", budget=4, sink=2, local=2)
        cache = StaticCache(config=m.config, max_cache_len=32)
        with torch.no_grad():
            m(ids[:, :20], past_key_values=cache)
            outs.append(torch.cat([m(ids[:, t : t + 1], past_key_values=cache).logits for t in range(20, 30)]))
    torch.testing.assert_close(outs[0], outs[1])
    lsh = sparse_fx.compile(copy.deepcopy(model), "hash", backend="eager", budget=4, sink=2, local=2)
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        lsh(ids[:, :20], past_key_values=cache)
        lsh_out = torch.cat([lsh(ids[:, t : t + 1], past_key_values=cache).logits for t in range(20, 30)])
    assert (lsh_out - outs[0]).abs().max() > 1e-4, "trained encoders must change the selection"


def test_fingerprint_and_bits_mismatch_are_clear_errors(trained, tmp_path):
    _, enc = trained
    other = tiny_model("llama", layers=3)
    with pytest.raises(ValueError, match="trained for another model.*num_layers: trained 2, model 3"):
        sparse_fx.compile(other, "hash", encoders=enc)
    with pytest.raises(ValueError, match="make 32-bit signatures but the plan asks for bits=64"):
        sparse_fx.compile(tiny_model("llama", layers=2), "hash", encoders=enc, bits=64)
    with pytest.raises(ValueError, match="holds no signature encoders"):
        sparse_fx.compile(tiny_model("llama", layers=2), "hash", encoders=tmp_path)


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "sparse_fx", "train-signatures", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--out" in out.stdout and "--context" in out.stdout


@pytest.mark.model
def test_cli_trains_and_saves_smollm2_encoders(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "sparse_fx", "train-signatures", "--model", "smollm2", "--out", str(tmp_path / "e"),
         "--context", "512", "--windows", "1", "--steps", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    enc = sparse_fx.SignatureEncoders.load(tmp_path / "e")
    assert enc.fingerprint["num_layers"] == 30 and enc.metadata["data"]["windows"] == 1


@given(B=st.integers(1, 4), H=st.integers(1, 5), T=st.integers(1, 6), widths=st.lists(st.integers(1, 24), min_size=2, max_size=4),
       bias=st.booleans(), seed=st.integers(0, 2**16))
@example(B=2, H=2, T=2, widths=[2, 2], bias=False, seed=0)  # x's own reshape has a weight-copy's shape
def test_head_mlp_equals_each_rows_layers_in_fp64_and_copies_no_weight_per_batch_row(B, H, T, widths, bias, seed):
    """apply_head_mlp runs head h's layers on every (batch, token) row; no tensor it makes is a weight
    repeated over the batch (torch.matmul's broadcast of w[None] once cloned them all)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sparse_fx.runtime.encoders import apply_head_mlp

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, widths[0], generator=g)
    params = []
    for i, o in zip(widths, widths[1:]):
        params += [torch.randn(H, i, o, generator=g), torch.randn(H, o, generator=g) if bias else None]
    made = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            made.extend((func, t.detach().clone()) for t in (out if isinstance(out, (tuple, list)) else [out])
                        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs)  # allocations
            return out

    with Shapes():
        got = apply_head_mlp(x, *params)
    assert got.shape == (B, H, T, widths[-1]) and got.dtype == torch.float32
    if B > 1:  # a weight copied per batch row, by content (a shape can match the input's own reshape)
        copies = [(func, tuple(t.shape)) for func, t in made for w in params[::2] if t.numel() == B * w.numel()
                  and torch.equal(t.reshape(B, *w.shape), w.expand(B, *w.shape))]
        assert not copies, copies
    want = torch.empty(B, H, T, widths[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            y = x[b, h].double()
            for j in range(len(params) // 2):
                w, bb = params[2 * j], params[2 * j + 1]
                y = y @ w[h].double() + (bb[h].double() if bb is not None else 0)
                if j < len(params) // 2 - 1:
                    y = torch.nn.functional.silu(y)
            want[b, h] = y
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)

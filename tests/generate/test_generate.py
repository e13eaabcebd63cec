"""generate() as people call it: many prompt lengths, beam search, left padding, ties, other
attention implementations, and bad arguments. Each case once gave silently wrong answers or
stopped working; these tests keep them right."""

import json
import random
import warnings

import pytest
import torch
from transformers import StaticCache

import sparse_fx
from support import SMALL, assert_side_caches_match_the_keys, generate, options_for, tiny_model
from sparse_fx.api import sparse_state

PLANS = ["oracle", "hash", "prism-g2", "prism-g2-hash", "prism-g2-int2refine", "static-g2"]




def test_fifty_calls_with_random_prompt_lengths_all_succeed_on_few_graphs():
    """Prompt lengths 1..4000 and random max_new_tokens: every call works, and the decode graphs
    stay few (prefill is not compiled; static caches grow in 1/16-octave buckets)."""
    model = sparse_fx.compile(tiny_model("llama", layers=2, max_position_embeddings=8192), "hash",
                              backend="eager", **options_for("hash", **SMALL))
    rng = random.Random(0)
    for _ in range(50):
        n, new = rng.randint(1, 4000), rng.randint(1, 6)
        ids = torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(n))
        out = generate(model, ids, new)
        assert out.shape == (1, n + new)
    graphs = len(sparse_state(model).reports)
    print(f"\n50 generate() calls, prompt lengths 1..4000: {graphs} decode graph(s) compiled")
    assert 1 <= graphs <= 8


@pytest.mark.parametrize("plan", ["hash", "prism-g2", "prism-g2-hash", "prism-g2-int2refine"])
def test_beam_search_keeps_side_caches_in_step_with_the_reordered_keys(plan):
    model = sparse_fx.compile(tiny_model("llama", layers=4), plan, backend="eager", **options_for(plan, **SMALL))
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False, num_beams=2, cache_implementation="static",
                             return_dict_in_generate=True)
    cache = out.past_key_values
    n = int(cache.layers[0].cumulative_length)
    assert n >= 55
    assert_side_caches_match_the_keys(model, cache, n)


@pytest.mark.parametrize("plan", PLANS)
def test_each_row_of_a_left_padded_batch_decodes_as_its_prompt_alone(plan):
    model = sparse_fx.compile(tiny_model("llama", layers=4, pad_token_id=0), plan, backend="eager", **options_for(plan, **SMALL))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 128, (n,), generator=g) for n in (37, 21)]
    pad = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(pad - len(p), dtype=torch.long), p]) for p in prompts])
    attn = (ids != 0).long()
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=attn, max_new_tokens=12, do_sample=False,
                               cache_implementation="static", pad_token_id=0, return_dict_in_generate=True,
                               output_logits=True)
        for row, p in enumerate(prompts):
            alone = model.generate(p[None], max_new_tokens=12, do_sample=False, cache_implementation="static",
                                   pad_token_id=0, return_dict_in_generate=True, output_logits=True)
            assert torch.equal(batch.sequences[row, pad:], alone.sequences[0, len(p):]), f"row {row}"
            for a, b in zip(batch.logits, alone.logits):
                torch.testing.assert_close(a[row], b[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("plan", PLANS)
def test_continuing_from_a_returned_cache_equals_one_call(plan):
    """A chat's next turn passes the last call's cache back: the side caches must carry on from it,
    so 5 + 7 tokens in two calls are the 12 tokens of one call, and every slot matches its keys."""
    model = sparse_fx.compile(tiny_model("llama", layers=4), plan, backend="eager", **options_for(plan, **SMALL))
    ids = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(3))
    first = generate(model, ids, 5, return_dict_in_generate=True)
    with torch.no_grad():
        second = model.generate(first.sequences, max_new_tokens=7, min_new_tokens=7, do_sample=False,
                                past_key_values=first.past_key_values, return_dict_in_generate=True)
    whole = generate(sparse_fx.compile(tiny_model("llama", layers=4), plan, backend="eager", **options_for(plan, **SMALL)), ids, 12)
    assert torch.equal(second.sequences, whole)
    cache = second.past_key_values
    assert_side_caches_match_the_keys(model, cache, int(cache.layers[0].cumulative_length))


@pytest.mark.parametrize("plan", PLANS)
def test_first_tokens_do_not_depend_on_max_new_tokens(plan):
    """Ties at the top-k cut are broken by candidate position, whatever the cache length."""
    model = sparse_fx.compile(tiny_model("llama", layers=4), plan, backend="eager", **options_for(plan, **SMALL))
    # A 490-token prompt: 20 and 21 new tokens decode on a cache of 512 slots (generate() rounds the
    # length up, `cache_bucket`), 30 on one of 768. (A 300-token prompt needed 280 new tokens to
    # reach 768 slots: 250 decode steps more per plan.)
    ids = torch.randint(1, 128, (1, 490), generator=torch.Generator().manual_seed(3))
    outs = [generate(model, ids, n, return_dict_in_generate=True) for n in (20, 21, 30)]
    assert [o.past_key_values.layers[0].keys.shape[2] for o in outs] == [512, 512, 768]
    runs = [o.sequences[0, 490:] for o in outs]
    assert torch.equal(runs[0], runs[1][:20]) and torch.equal(runs[0], runs[2][:20])


@pytest.mark.parametrize("implementation", ["eager", "flex_attention"])
def test_other_attention_implementations_are_switched_to_sdpa(implementation):
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(4))
    dense = tiny_model("llama", layers=2)
    want = generate(dense, ids, 8)
    model = tiny_model("llama", layers=2)
    model.set_attn_implementation(implementation)
    sparse_fx.compile(model, "oracle", backend="eager", budget=64, sink=2, local=3)
    assert torch.equal(generate(model, ids, 8), want)
    report = sparse_fx.explain(model)
    assert report.sparse_layers == [0, 1] and f"switched from attn_implementation='{implementation}'" in str(report)


def test_strict_raises_when_a_layer_stays_dense_and_a_dynamic_cache_warns_once():
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    model = sparse_fx.compile(tiny_model("llama", layers=2), "hash", backend="eager", strict=True)
    with pytest.raises(RuntimeError, match="strict.*no KV-cache write"):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, do_sample=False)  # DynamicCache: nothing is sparse
    model = sparse_fx.compile(tiny_model("llama", layers=2), "oracle", backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, do_sample=False)
            model.generate(ids, max_new_tokens=3, do_sample=False)
    messages = [str(w.message) for w in caught if "sparse_fx" in str(w.message)]
    assert len([m for m in messages if "no static KV cache" in m]) == 1, messages
    assert {w.filename for w in caught if "sparse_fx" in str(w.message)} == {__file__}  # the user's line


def test_untrained_hash_says_so_once_and_in_explain():
    model = sparse_fx.compile(tiny_model("llama", layers=2), "hash", backend="eager")
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with torch.no_grad():  # model.generate called here: the user's line is in this file
                model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
    notice = [w for w in caught if "untrained random signatures" in str(w.message)]
    assert len(notice) == 1 and notice[0].filename == __file__  # through generate(): still the caller's line
    assert "LSH, untrained" in str(sparse_fx.explain(model))


def _encoders(model, tmp_path, seed=0, bits=32):
    from sparse_fx.offline.train import TrainConfig

    ids = torch.randint(1, 128, (2, 320), generator=torch.Generator().manual_seed(seed))
    enc = sparse_fx.train_signatures(model, ids, bits=bits, steps=2, queries=16, batch_queries=8, batch_keys=32,
                                     context=320, progress=False, sink=TrainConfig.sink // 8, local=TrainConfig.local // 8)
    enc.save(tmp_path)
    return enc


def test_encoders_of_another_model_with_the_same_shapes_are_refused(tmp_path):
    model = tiny_model("llama", layers=2)
    _encoders(model, tmp_path)
    sparse_fx.compile(tiny_model("llama", layers=2), "hash", encoders=tmp_path, backend="eager")  # same weights
    sparse_fx.compile(tiny_model("llama", layers=2).to(torch.bfloat16), "hash", encoders=tmp_path, backend="eager")
    other = tiny_model("llama", layers=2, seed=1)
    with pytest.raises(ValueError, match="trained for another model.*weights"):
        sparse_fx.compile(other, "hash", encoders=tmp_path, backend="eager")
    learned = sparse_fx.compile(tiny_model("llama", layers=2), "hash", encoders=tmp_path, backend="eager")
    assert "learned 32-bit signatures" in str(sparse_fx.explain(learned))


def test_an_encoder_directory_sets_the_signature_width(tmp_path):
    _encoders(tiny_model("llama", layers=2), tmp_path, bits=64)
    model = sparse_fx.compile(tiny_model("llama", layers=2), "hash", encoders=tmp_path, backend="eager")
    assert sparse_state(model).plan.options.bits == 64
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(7))
    assert generate(model, ids, 3).shape == (1, 15)


def test_bad_encoder_files_name_the_file(tmp_path):
    model = tiny_model("llama", layers=2)
    _encoders(model, tmp_path)
    (tmp_path / "encoders.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"encoders.json.*is not valid JSON"):
        sparse_fx.compile(model, "hash", encoders=tmp_path, backend="eager")
    (tmp_path / "encoders.json").write_text(json.dumps({"format": "sparse_fx.signatures/1"}))
    with pytest.raises(ValueError, match="is not a sparse_fx.signatures/1 file"):
        sparse_fx.compile(model, "hash", encoders=tmp_path, backend="eager")
    with pytest.raises(ValueError, match="is not a directory"):
        sparse_fx.compile(model, "hash", encoders=tmp_path / "encoders.json", backend="eager")
    with pytest.raises(ValueError, match="holds no signature encoders"):
        sparse_fx.compile(model, "hash", encoders=tmp_path / "..", backend="eager")


def _lsh_encoders(model, path):
    """Saved encoders for `model` (random projections, no training): a valid directory to corrupt."""
    from sparse_fx.model_info import ModelInfo
    from sparse_fx.runtime.encoders import lsh_layer

    info = ModelInfo.of(model)
    layers = [lsh_layer(info.q_heads, info.kv_heads, info.head_dim, 32, seed=i) for i in range(info.num_layers)]
    sparse_fx.SignatureEncoders(layers, 32, info.fingerprint(model), {"train_config": {}}).save(path)


def _rewrite_tensors(path, change):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "encoders.safetensors"))
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "encoders.safetensors"))


BAD_TENSORS = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "garbage": lambda p: p.write_bytes(b"\x89 not a safetensors file" * 10),
    "empty": lambda p: p.write_bytes(b""),
}
BAD_LAYOUTS = {  # (change to the tensors, the tensor the error names)
    "missing": (lambda t: t.pop("1.k.w0"), "1.k.w0"),
    "wrong input width": (lambda t: t.update({"0.q.w0": t["0.q.w0"][:, :8]}), "0.q.w0"),
    "wrong heads": (lambda t: t.update({"1.k.w0": t["1.k.w0"][:1]}), "1.k.w0"),
    "wrong bits": (lambda t: t.update({"0.k.w0": t["0.k.w0"][..., :16]}), "0.k.w0"),
    "integer weights": (lambda t: t.update({"0.q.w0": t["0.q.w0"].int()}), "0.q.w0"),
    "bias of another width": (lambda t: t.update({"0.q.b0": torch.zeros(4, 7)}), "0.q.b0"),
}
BAD_JSON = {  # (field, value)
    "bits as a string": ("bits", "32"),
    "bits not a multiple of 32": ("bits", 33),
    "bits a bool": ("bits", True),
    "fingerprint a list": ("fingerprint", []),
    "metadata a list": ("metadata", []),
    "train_config a list": ("metadata", {"train_config": []}),
}


@pytest.mark.parametrize("case", sorted(BAD_TENSORS) + sorted(BAD_LAYOUTS) + sorted(BAD_JSON))
def test_every_malformed_encoders_file_is_a_value_error_naming_file_and_field(case, tmp_path):
    model = tiny_model("llama", layers=2)
    _lsh_encoders(model, tmp_path)
    sparse_fx.compile(model, "hash", encoders=tmp_path, backend="eager")  # the untouched files load
    if case in BAD_TENSORS:
        BAD_TENSORS[case](tmp_path / "encoders.safetensors")
        file, field = "encoders.safetensors", "safetensors"
    elif case in BAD_LAYOUTS:
        change, field = BAD_LAYOUTS[case]
        _rewrite_tensors(tmp_path, change)
        file = "encoders.safetensors"
    else:
        key, value = BAD_JSON[case]
        meta = json.loads((tmp_path / "encoders.json").read_text())
        (tmp_path / "encoders.json").write_text(json.dumps(meta | {key: value}))
        file, field = "encoders.json", "train_config" if case == "train_config a list" else key
    with pytest.raises(ValueError) as e:
        sparse_fx.compile(tiny_model("llama", layers=2), "hash", encoders=tmp_path, backend="eager")
    assert str(tmp_path / file) in str(e.value) and field in str(e.value), str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("plan", ["oracle", "hash", "prism-g2"])
def test_a_budget_covering_the_whole_cache_decodes_exactly_the_dense_tokens_in_every_dtype(plan, dtype):
    """Nothing to select: the graph keeps dense attention (and no side caches), so even where bf16 or
    fp16 rounding leaves ties between the top logits, the tokens are the dense model's."""
    model = tiny_model("llama", layers=2).to(dtype)
    # seeds whose prompts a sparse graph at this budget decoded differently from dense, in 2 (bf16)
    # and 1 (fp16) of 6 rows, each plan
    seed = {torch.float16: 5}.get(dtype, 2)
    ids = torch.randint(1, 128, (6, 300), generator=torch.Generator().manual_seed(seed))
    dense = generate(model, ids, 32)  # a static cache of 512 tokens (cache_bucket(332))
    sparse_fx.compile(model, plan, backend="eager", strict=True, **options_for(plan, budget=512 - 5, sink=2, local=3, int2_group=8))
    assert torch.equal(generate(model, ids, 32), dense)
    report = sparse_fx.explain(model)
    assert report.sparse_layers == [] and report.side_cache_bytes == 0
    assert all(r.short and "cover the whole static cache of 512 tokens" in r.reason for r in report), str(report)


@pytest.mark.parametrize("plan", ["oracle", "hash", "prism-g2"])
def test_cost_follows_the_cache_not_the_budget(plan):
    """A budget far past the cache decodes densely (no selection arrays of its size); a Prism pool
    past the cache's candidates is capped to them, fixed in the graph; a budget no int32 position
    can hold is refused at compile."""
    ids = torch.randint(1, 128, (1, 58), generator=torch.Generator().manual_seed(6))
    huge = sparse_fx.compile(tiny_model("llama", layers=2), plan, backend="eager", **options_for(plan, budget=2**20, int2_group=8))
    assert torch.equal(generate(huge, ids, 8), generate(tiny_model("llama", layers=2), ids, 8))
    assert "cover the whole static cache of 256 tokens" in sparse_fx.explain(huge).rows[0].reason
    if plan.startswith("prism"):  # 256 - 5 = 251 candidates; rho 4 x 100 would be 400
        capped = sparse_fx.compile(tiny_model("llama", layers=2), plan, backend="eager", budget=100, sink=2,
                                   local=3, rho=4.0, int2_group=8, min_context=0)
        exact = sparse_fx.compile(tiny_model("llama", layers=2), plan, backend="eager", budget=100, sink=2,
                                  local=3, rho=2.51, int2_group=8, min_context=0)
        assert torch.equal(generate(capped, ids, 8), generate(exact, ids, 8))
        assert [r.budget for r in sparse_fx.explain(capped)] == ["2+3+100, pool 251", "2+3+100, from L0"]
    with pytest.raises(ValueError, match="budget 1000000000000 .* exceed the int32 cache positions"):
        sparse_fx.compile(tiny_model("llama", layers=2), plan, budget=10**12)


def test_an_empty_prompt_is_a_value_error_saying_so():
    model = sparse_fx.compile(tiny_model("llama", layers=2), "hash")
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match="the prompt is empty"):
        model(empty)
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(model, empty, 3)


def test_dense_layers_beyond_the_model_are_refused():
    with pytest.raises(ValueError, match=r"dense_layers holds layers \[7\] but the model has 2 layers \(valid: 0..1\)"):
        sparse_fx.compile(tiny_model("llama", layers=2), "hash", dense_layers=[7], backend="eager")


def _prefilled(batch: int, seed: int):
    """A small hash model, 20 prompt tokens per row and the StaticCache they filled."""
    model = sparse_fx.compile(tiny_model("llama", layers=2), "hash", backend="eager", **options_for("hash", **SMALL))
    ids = torch.randint(1, 128, (batch, 20), generator=torch.Generator().manual_seed(seed))
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return model, ids, cache


def test_a_static_cache_passed_by_the_caller_follows_reorder_cache():
    model, ids, cache = _prefilled(3, 7)
    with torch.no_grad():
        model(ids[:, -1:], past_key_values=cache)
        cache.reorder_cache(torch.tensor([2, 0, 0]))
    assert_side_caches_match_the_keys(model, cache, 21)


def test_a_dropped_cache_frees_its_memory_without_the_garbage_collector():
    """Following a cache's mutators must not tie it in a reference cycle: at long contexts a cache
    is gigabytes, and each generate() makes a new one."""
    import gc
    import weakref

    _, _, cache = _prefilled(1, 9)
    keys = weakref.ref(cache.layers[0].keys)
    gc.disable()
    try:
        del cache
        assert keys() is None
    finally:
        gc.enable()


def test_a_followed_cache_deep_copies_and_pickles_as_itself():
    """Hugging Face reuses a prompt's cache by deep copy: the copy's mutators act on the copy."""
    import copy
    import pickle

    model, ids, cache = _prefilled(2, 8)
    clone = copy.deepcopy(cache)
    before = cache.layers[0].keys.clone()
    clone.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layers[0].keys, before) and torch.equal(clone.layers[0].keys, before[[1, 0]])
    with torch.no_grad():
        model(ids[:, -1:], past_key_values=clone)  # decoding on the copy refills from it
    assert_side_caches_match_the_keys(model, clone, 21)
    back = pickle.loads(pickle.dumps(cache))
    assert torch.equal(back.layers[0].keys, before)

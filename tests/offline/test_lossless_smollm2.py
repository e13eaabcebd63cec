"""Lossless mode on the real model: SmolLM2's own greedy tokens in fp32, where the plans alone
change them (a 512-token held-out text, budgets of 1/16 of it)."""

import copy

import pytest
import torch

import sparse_fx
from sparse_fx.offline.data import token_windows

OPTIONS = dict(budget=32, sink=16, local=16)


@pytest.mark.parametrize("plan", ["prism-g4", pytest.param("hash", marks=pytest.mark.slow)])
def test_lossless_mode_emits_smollm2s_dense_greedy_tokens(smollm2, plan):
    model, tok = smollm2
    ids = token_windows(tok, "heldout", count=1, length=512, seed=3)
    steps = 20

    def greedy(m):
        with torch.no_grad():
            return m.generate(ids, max_new_tokens=steps, do_sample=False, cache_implementation="static",
                              pad_token_id=tok.eos_token_id)[0, ids.shape[1]:]

    dense = greedy(model)
    lossy = greedy(sparse_fx.compile(copy.deepcopy(model), plan, backend="eager", **OPTIONS))
    lossless = sparse_fx.compile(copy.deepcopy(model), plan, backend="eager", speculate=4, **OPTIONS)
    assert not torch.equal(lossy, dense), f"{plan} at budget 32 already gives the dense tokens: raise the sparsity"
    assert torch.equal(greedy(lossless), dense)
    seen = sparse_fx.acceptance(lossless)
    print(f"\n{plan}: {seen}")
    assert seen.accepted < seen.drafted

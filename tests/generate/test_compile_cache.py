"""A restarted process takes the compiled decode graph from torch's caches whole: Inductor's FX graph
cache and AOTAutograd's cache both hit (AOTAutograd's refused our graphs until the functions the
rewrite calls were marked cacheable), and the tokens are the first process's. The restart here
starts from empty cache folders and loads the first process's portable artifacts
(`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`), as another machine would."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from support import SMALL, options_for, tiny_model
from torch._dynamo.utils import counters
import sparse_fx
if {load!r}:
    torch.compiler.load_cache_artifacts(open({load!r}, "rb").read())
m = sparse_fx.compile(tiny_model("llama", layers=2), {plan!r}, min_context=0, **options_for({plan!r}, **SMALL))
ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    out = m.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static")
if {save!r}:
    open({save!r}, "wb").write(torch.compiler.save_cache_artifacts()[0])
print(json.dumps(dict(tokens=out[:, -3:].tolist(), inductor=dict(counters["inductor"]), aot=dict(counters["aot_autograd"]))))
"""


def _run(plan: str, cache: Path, save: str = "", load: str = "") -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
    env.pop("TRITON_INTERPRET", None)
    code = SCRIPT.format(tests=str(Path(__file__).parents[1]), plan=plan, save=save, load=load)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("plan", ["hash", pytest.param("prism-g2", marks=pytest.mark.slow)])
def test_a_restarted_process_compiles_nothing_and_decodes_the_same_tokens(plan, tmp_path):
    artifacts = str(tmp_path / "artifacts.bin")
    cold = _run(plan, tmp_path / "first", save=artifacts)
    assert cold["inductor"].get("fxgraph_cache_miss") == 1 and cold["aot"].get("autograd_cache_saved") == 1, cold
    warm = _run(plan, tmp_path / "second", load=artifacts)
    assert warm["inductor"].get("fxgraph_cache_hit") == 1 and not warm["inductor"].get("fxgraph_cache_miss"), warm
    assert warm["aot"].get("autograd_cache_hit") == 1 and not warm["aot"].get("autograd_cache_bypass"), warm
    assert warm["tokens"] == cold["tokens"]

"""bench/ as a toolkit and as the docs use it: scripts share one library (bench/benchlib/) and
import no other script, no script shadows an importable module, every command and path the README
and docs/ show is there, and bench/results holds only what something cites.

A script's own folder is sys.path[0] when it runs, so a bench file named like an importable module
replaces that module for everything the script imports: transformers probes for a top-level
`kernels` package, and a bench/kernels.py once took its place and parsed our command line as its
own. Each check runs in a fresh interpreter, as a user's command would.
"""

import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import ROOT


BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
LIBRARY = BENCH / "benchlib"  # the one module (a package) the scripts share
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # what users read
# `python bench/<script>.py ...` and `python -m sparse_fx <command> ...`, also broken over a line.
COMMAND = re.compile(r"\bpython3?\s+(bench/\w+\.py|-m\s+sparse_fx(?:\s+[a-z][\w-]*)?)")


def scripts() -> list[Path]:
    return sorted(BENCH.glob("*.py"))


def test_no_bench_file_is_named_like_an_importable_module(tmp_path):
    stems = sorted([p.stem for p in scripts()] + [p.parent.name for p in BENCH.glob("*/__init__.py")])
    find = "import importlib.util, json, sys; print(json.dumps({s: getattr(importlib.util.find_spec(s), 'origin', None) for s in sys.argv[1:]}))"
    out = subprocess.run([sys.executable, "-c", find, *stems], cwd=tmp_path, capture_output=True, text=True, check=True)
    taken = {stem: origin for stem, origin in json.loads(out.stdout).items() if origin is not None}
    assert not taken, f"bench files that would shadow these modules when a bench script runs (rename them): {taken}"


def doc_commands(paths=DOCS) -> list[list[str]]:
    """Each distinct script or CLI command of README.md and docs/*.md, as argv (python from this interpreter)."""
    found = dict.fromkeys(" ".join(m.group(1).split()) for p in paths for m in COMMAND.finditer(p.read_text()))
    return [[sys.executable, *command.split()] for command in found]


def bench_scripts() -> list[list[str]]:
    return [[sys.executable, str(p.relative_to(ROOT))] for p in scripts() if "__main__" in p.read_text()]


def test_readme_and_docs_show_bench_and_cli_commands():
    """The README shows the command line (`python -m sparse_fx ...`); with docs/ (the bench commands
    that reproduce each number are in docs/results.md) it shows both kinds, and every bench script
    it names exists."""
    readme = {" ".join(argv[1:]) for argv in doc_commands([ROOT / "README.md"])}
    shown = {" ".join(argv[1:]) for argv in doc_commands()}
    assert any(c.startswith("-m sparse_fx ") for c in readme), readme
    assert any(c.startswith("bench/") for c in shown) and any(c.startswith("-m sparse_fx ") for c in shown), shown
    missing = [c for c in shown if c.startswith("bench/") and not (ROOT / c).exists()]
    assert not missing, f"README or docs/ name bench scripts that do not exist: {missing}"


def test_every_command_answers_help():
    """Every command of the README and docs/ and every bench script parses `--help` and exits 0, in
    seconds: they parse arguments before heavy work, and nothing they import reads our command line."""
    commands = {tuple(argv) for argv in doc_commands() + bench_scripts()}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def run(argv):
        return subprocess.run([*argv, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(zip(commands, pool.map(run, commands)))
    failed = {" ".join(argv[1:]): (r.returncode, r.stderr[-600:]) for argv, r in results.items()
              if r.returncode != 0 or "usage:" not in r.stdout}
    assert not failed, failed


def imported_modules(path: Path) -> set[str]:
    """The top-level names of the modules `path` imports anywhere (in functions too), with
    importlib.import_module("...") and __import__("...") of a literal name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value.split(".")[0])
    return found


def test_no_bench_script_imports_another_script():
    """What scripts share lives in the library, bench/benchlib/: a script imports it and never another
    script, and the library imports no script."""
    names = {p.stem for p in scripts()}
    found = {str(p.relative_to(ROOT)): sorted(imported_modules(p) & (names - {p.stem}))
             for p in [*scripts(), *sorted(LIBRARY.rglob("*.py"))]}
    found = {path: imported for path, imported in found.items() if imported}
    assert not found, f"bench files that import bench scripts (move what they share into bench/benchlib/): {found}"
    assert {p.stem for p in scripts()} >= {"teacher_agreement", "quality_sweep", "decode_speed", "kernel_step"}
    assert not (BENCH / "benchlib.py").exists() and (LIBRARY / "__init__.py").is_file()


# Where result files are cited: what users and the notebook read, and the code and tests that read a result.
CITING_DOCS = [*DOCS, BENCH / "NOTES.md"]
CITING_CODE = ("sparse_fx/**/*.py", "sparse_fx/**/*.json", "lowering/**/*.py", "runtime/**/*.py", "tests/**/*.py")
# a glob of result files as the docs write one: `kernels-2026-12-04-1307.*`, `decode-2026-11-30-*.json`
RESULT_GLOB = re.compile(r"(?<![\w*./-])[\w./-]*[\w-](?:\.\*|-\*)[\w.*-]*")


def uncited_results() -> list[str]:
    """The files under bench/results that nothing cites. A file is cited by its name or path anywhere
    in CITING_DOCS or CITING_CODE, by a glob in the docs that matches its name, or by its stem (its
    name without extensions) alone in code quotes or at a path's end in the docs
    (`kernels-2026-12-01-0154`, `results/kernels-2026-12-01-0154`: all of that run's files)."""
    docs = "\n".join(p.read_text() for p in CITING_DOCS)
    code = "\n".join(p.read_text() for pattern in CITING_CODE for p in sorted(ROOT.glob(pattern)))
    globs = {m.group(0).rsplit("/", 1)[-1] for m in RESULT_GLOB.finditer(docs)}
    uncited = []
    for path in sorted(p for p in RESULTS.rglob("*") if p.is_file()):
        name, stem = path.name, path.name.split(".")[0]
        if not (re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", docs + code)
                or any(fnmatch.fnmatchcase(name, g) for g in globs)
                or re.search(rf"[`/]{re.escape(stem)}`", docs)):
            uncited.append(str(path.relative_to(ROOT)))
    return uncited


def test_every_result_file_is_cited():
    """bench/results holds only what README.md, docs/, bench/NOTES.md, the code or the tests cite;
    git history keeps the rest."""
    uncited = uncited_results()
    assert not uncited, (f"{len(uncited)} file(s) under bench/results that nothing cites: cite each in docs/results.md "
                         f"or bench/NOTES.md (by name, path, glob or stem), or `git rm` it: {uncited}")


# A path in this repository as the README and docs/ write one, with {a,b} alternatives, <name>
# placeholders and * globs (`sparse_fx/methods/{oracle,hash,prism}.py`, `tests/ops/test_op_<op>.py`).
REPO_PATH = re.compile(r"(?<![\w./-])(?:bench|tests|sparse_fx|lowering|runtime|docs)/[\w./*<>-]*(?:\{[\w.,-]*\}[\w./*<>-]*)?")


def paths_named(text: str) -> set[str]:
    """The repository paths `text` names, braces expanded. Sections of sources (a heading that begins
    "Sources", as in docs/serving.md) name other repositories' files and are left out."""
    text = re.sub(r"^#+ Sources\b.*?(?=^#+ |\Z)", "", text, flags=re.M | re.S)
    paths = set()
    for m in REPO_PATH.finditer(text):
        path = m.group(0).rstrip(".,:;")
        brace = re.search(r"\{([^}]*)\}", path)
        paths |= {path[: brace.start()] + a + path[brace.end():] for a in brace.group(1).split(",")} if brace else {path}
    return paths


def test_every_path_the_readme_and_docs_name_exists():
    """Every file or folder that README.md and docs/*.md name under bench/, tests/, sparse_fx/,
    lowering/, runtime/ or docs/ exists; a glob or a <placeholder> matches at least one file."""
    missing = {}
    for doc in DOCS:
        for path in sorted(paths_named(doc.read_text())):
            pattern = re.sub(r"<[^>]*>", "*", path)
            if not (any(ROOT.glob(pattern)) if "*" in pattern else (ROOT / path).exists()):
                missing.setdefault(str(doc.relative_to(ROOT)), []).append(path)
    assert not missing, f"paths named in the docs that do not exist: {missing}"
    assert "sparse_fx/methods/hash.py" in paths_named("`sparse_fx/methods/{oracle,hash}.py`, `vllm/config.py`.")


def test_gpu_session_lists_its_stages_and_the_docs_name_them():
    """bench/gpu_session.sh without a stage prints its table of stages (and makes no output folder);
    docs/results.md names the same stages."""
    r = subprocess.run(["bash", "bench/gpu_session.sh"], cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "OUT"},
                       capture_output=True, text=True, timeout=60)
    listed = re.findall(r"^  ([\w-]+) +~\d+ min: ", r.stdout, flags=re.M)
    assert r.returncode == 2 and "Usage" in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert len(listed) == len(set(listed)) >= 8, r.stdout
    named = re.search(r"bench/gpu_session\.sh <stage>` runs the standard stages \(([^)]*)\)", (ROOT / "docs/results.md").read_text())
    assert named, "docs/results.md no longer names the stages of bench/gpu_session.sh"
    assert sorted(re.findall(r"`([\w-]+)`", named.group(1))) == sorted(listed)


# The slow commands below are a process each (decode_tp two), nearly all of it one busy core (the
# Triton interpreter, Dynamo, Inductor, matplotlib): run one after another they left CI's second
# core idle for about 100 s. `_started` starts those of the tests this session runs, two at a time,
# when the first of them asks; each test (`ran`) waits for its own command and checks what it
# printed and wrote, as it did when it ran the command itself. Each command gets an empty folder `out`.
def kernel_step(out):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "bench/kernel_step.py", "--smoke"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def kernel_tuning(out):
    base = out / "base"
    shutil.copytree(ROOT / "lowering", base / "oldlowering", ignore=shutil.ignore_patterns("__pycache__"))
    (base / "oldlowering" / "__init__.py").write_text("")  # kernels only: the ops are registered once
    return subprocess.run([sys.executable, "bench/kernel_tuning.py", "--smoke", "--baseline", str(base), "--out", str(out)],
                          cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)


def compile_time(out):
    return subprocess.run([sys.executable, "bench/compile_time.py", "--plans", "hash", "--layers", "1", "--small",
                           "--restart", "--profile", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=400)


def trace_as_gpu(out):
    return subprocess.run([sys.executable, "bench/trace_as_gpu.py", "--plans", "dense", "hash", "--layers", "2", "--repeat",
                           "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)


def bandwidth(out):
    code = ("import torch, benchlib; x = torch.randn(70001); y = torch.full_like(x, float('nan')); part = torch.empty(5); "
            "benchlib.stream(x, part, y, block=1024); assert torch.equal(y, x); "
            "torch.testing.assert_close(part.sum(), x.sum(), rtol=1e-5, atol=1e-3); "
            "benchlib.stream(x, part, block=1024); torch.testing.assert_close(part.sum(), x.sum(), rtol=1e-5, atol=1e-3); print('ok')")
    return subprocess.run([sys.executable, "-c", code], cwd=BENCH, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=120)


def decode_tp(out):
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "bench/decode_tp.py", "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def workload(out):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "bench/workload.py", "--smoke", "--methods", "hf-static,hash", "--batches", "1",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def prism_pools(out):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "bench/prism_pools.py", "--context", "1024", "--depths", "10", "--keys", "1",
                           "--sparsity", "8", "--rho", "2,8", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


AGREEMENT_RUNS = [ROOT / "bench/results/agreement-gpu-adaptive.json", ROOT / "bench/results/agreement-gpu-adaptive-oracle.json"]


def agreement_merge(out):
    merged = subprocess.run([sys.executable, "bench/teacher_agreement.py", "--merge", *map(str, AGREEMENT_RUNS), "--tag", "m",
                             "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    kept = subprocess.run([sys.executable, "bench/teacher_agreement.py", "--merge", *map(str, AGREEMENT_RUNS), "--plans",
                           "prism-g4,oracle-mass0.95", "--tag", "k", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    return merged, kept


SLOW = {  # test -> its command, in the order the tests run
    "test_kernel_step_smoke_runs_every_plans_step_through_the_kernels": kernel_step,
    "test_kernel_tuning_smoke_runs_every_sweep_and_check": kernel_tuning,
    "test_compile_time_measures_a_cold_compile_in_a_fresh_process": compile_time,
    "test_trace_as_gpu_traces_the_kernels_launches_and_analyses_each_kernel_once": trace_as_gpu,
    "test_the_bandwidth_reference_kernel_reads_and_copies_everything": bandwidth,
    "test_decode_tp_smoke_runs_dense_and_every_plan_on_two_ranks": decode_tp,
    "test_prism_pools_runs_and_a_pool_of_every_candidate_keeps_all_mass": prism_pools,
    "test_workload_streams_requests_through_generate_and_times_every_method": workload,
    "test_teacher_agreement_merges_runs_cell_by_cell": agreement_merge,
}


@pytest.fixture(scope="module")
def _started(request, tmp_path_factory):
    selected = {item.originalname for item in request.session.items if getattr(item, "module", None) is request.module}
    pool = ThreadPoolExecutor(max_workers=2)
    started = {}
    for name, command in SLOW.items():
        if name in selected:
            out = tmp_path_factory.mktemp(command.__name__)
            started[name] = (pool.submit(command, out), out)
    yield started
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def ran(request, _started):
    """(what this test's command returned, the folder it wrote to)"""
    future, out = _started[request.node.originalname]
    return future.result(), out


def test_kernel_step_smoke_runs_every_plans_step_through_the_kernels(ran):
    """The kernel benches' shared inputs (bench/benchlib/layers.py) and both plans' steps, on tiny
    shapes under the Triton interpreter: the GPU run is the same code at full size."""
    r, _ = ran
    assert r.returncode == 0 and "smoke ok" in r.stdout, r.stderr[-2000:]


def test_kernel_tuning_smoke_runs_every_sweep_and_check(ran):
    """bench/kernel_tuning.py --smoke: its checks (kernels equal the reference) and one configuration
    of every sweep, against an older lowering package too, on CPU tensors under the interpreter."""
    r, out = ran
    assert r.returncode == 0, r.stderr[-3000:]
    checks = [line for line in r.stdout.splitlines() if line.startswith("check ")]
    assert len(checks) >= 12 and not any("MISMATCH" in c or "WRONG" in c for c in checks), checks
    best = json.loads(next(out.glob("kernel-tuning-*.json")).read_text())["best"][0]
    assert {"mass_select_1.0", "mass_select_0.95", "select_nested_row", "select_nested_passes", "attention",
            "mass_select_old", "select_nested_old", "int2_scores", "int2_pool"} <= set(best)


def test_compile_time_measures_a_cold_compile_in_a_fresh_process(ran):
    """bench/compile_time.py --restart on a narrow one-layer model on the CPU: the cold worker runs in
    a child process with empty caches, and its row carries the phases and Inductor's counts; the two
    restarts (same caches; empty caches and the portable artifacts) take the graph from the cache."""
    r, out = ran
    assert r.returncode == 0, r.stderr[-3000:]
    row, same, portable = json.loads(next(out.glob("compile-*.json")).read_text())["rows"]
    assert "error" not in row, row
    assert row["plan"] == "hash" and row["compile_s"] > 0 and row["scheduler_nodes"] >= row["fused_nodes"] > 0
    assert isinstance(row["kernel_analyses"], dict), row  # the memo's runs and hits (empty where no kernel compiles)
    assert {"bytecode_tracing", "Scheduler.__init__"} <= set(row["phases_s"]), row["phases_s"]
    assert row["caches"].get("inductor_fxgraph_cache_miss") == 1, row["caches"]
    for warm in (same, portable):
        assert warm["caches"].get("inductor_fxgraph_cache_hit") == 1 and warm["scheduler_nodes"] == 0, warm
        assert not warm["caches"].get("inductor_fxgraph_cache_miss"), warm["caches"]
    assert [w["start"] for w in (row, same, portable)] == ["cold", "warm (same caches)", "warm (portable artifacts)"]
    # --profile: each process's first call, raw stats and a summary that names the compile's entry
    assert all(w["profiled"] for w in (row, same, portable))
    for start in ("cold", "restart", "portable"):
        assert (out / f"profile-hash-{start}-1layers.prof").stat().st_size > 0
        assert "_compile" in (out / f"profile-hash-{start}-1layers.prof.txt").read_text()


def test_trace_as_gpu_traces_the_kernels_launches_and_analyses_each_kernel_once(ran):
    """bench/trace_as_gpu.py: AOTAutograd of a two-layer decode graph as a GPU compile traces it, on
    the CPU. The sparse graph holds our kernels' launches (the Triton path, not the references), and
    torch's analysis of a kernel runs once, not at every launch of every layer (the memo, whose
    misses once cost a 16-layer prism-g4 graph 20 s here)."""
    r, out = ran
    assert r.returncode == 0, r.stderr[-3000:]
    dense, sparse = json.loads(next(out.glob("aot-trace-*.json")).read_text())["rows"]
    assert dense["plan"] == "dense" and dense["kernel_launches"] == dense["analyses_asked"] == 0, dense
    assert sparse["plan"] == "hash" and sparse["memo"] and sparse["aot_s"] > 0, sparse
    assert sparse["kernel_launches"] >= 2 * 3 and sparse["aot_nodes"] > dense["aot_nodes"], sparse
    # asked once a launch when collecting metadata and once when capturing; run for one layer's at most
    assert sparse["analyses_asked"] == 2 * sparse["kernel_launches"], sparse
    assert 0 < sparse["analyses_run"] <= sparse["kernel_launches"] // 2, sparse


def test_the_bandwidth_reference_kernel_reads_and_copies_everything(ran):
    """benchlib.stream, which the rooflines' copy and read ceilings time, on CPU tensors under the
    interpreter: a length that is no multiple of the grid's stride, every element copied and summed."""
    r, _ = ran
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_decode_tp_smoke_runs_dense_and_every_plan_on_two_ranks(ran):
    """bench/decode_tp.py on two CPU processes (gloo, a tiny model, eager backend): loading the
    sharded checkpoint, per-rank caches and the sparse plans, as the GPU run does at full size."""
    r, _ = ran
    assert r.returncode == 0 and "smoke ok" in r.stdout, r.stdout[-1000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["method"] for row in rows] == ["dense", "hash", "prism-g4"]
    assert all(row["shard"] == "Shard(rank=0, size=2)" for row in rows[1:])


def test_prism_pools_runs_and_a_pool_of_every_candidate_keeps_all_mass(ran):
    """bench/prism_pools.py on the real model at 1K: shares lie in (0, 1], and a pool as large as the
    candidates (rho 8 x budget 128 >= 768) with exact proposal scores keeps every layer's own choice."""
    r, out = ran
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((out / "prism-pools-1024.json").read_text())["rows"]
    assert len(rows) == 6 and all(0 < x["mass_vs_oracle"] <= 1 + 1e-9 and 0 < x["needle_mass_kept"] <= 1 + 1e-9 for x in rows)
    covering = next(x for x in rows if x["proposal"] == "exact" and x["rho"] == 8)
    assert all(abs(v - 1) < 1e-6 for v in covering["per_layer"]), covering["per_layer"]
    narrow = next(x for x in rows if x["proposal"] == "int2" and x["rho"] == 2)
    assert narrow["mass_vs_oracle"] < covering["mass_vs_oracle"]


def test_workload_streams_requests_through_generate_and_times_every_method(ran):
    """bench/workload.py --smoke: a stream of growing prompts through generate() on a tiny Llama (CPU,
    eager backend): every request timed, the sparse plan's decode graph compiled once for the stream,
    generate()'s time per token beside the loop's step."""
    r, out = ran
    assert r.returncode == 0 and "smoke ok" in r.stdout, r.stderr[-3000:]
    report = json.loads(next(out.glob("workload*.json")).read_text())
    rows = {row["method"]: row for row in report["rows"]}
    assert set(rows) == {"hf-static", "hash"} and all(len(row["requests"]) == 3 for row in rows.values())
    assert rows["hash"]["compiles"] == 1, rows["hash"]["requests"]
    assert [p["method"] for p in report["per_token"]] == ["hash"] and report["per_token"][0]["loop_step_ms"] > 0


def test_teacher_agreement_merges_runs_cell_by_cell(ran):
    """--merge of two committed runs (the same cells, different plans): each cell holds both runs'
    plans, a plan both measured keeps the first run's row, the markdown names both commands, and the
    adaptive plans get the agreement-against-tokens figure; --plans keeps only those rows."""
    (r, r_kept), out = ran
    runs = AGREEMENT_RUNS
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = (json.loads(p.read_text()) for p in runs)
    merged = json.loads((out / "agreement-m.json").read_text())
    cells = {(c["context"], c["sparsity"]): c for c in merged["runs"]}
    assert set(cells) == {(c["context"], c["sparsity"]) for c in a["runs"] + b["runs"]}
    for run in a["runs"] + b["runs"]:
        assert set(run["plans"]) <= set(cells[run["context"], run["sparsity"]]["plans"])
    first = {(c["context"], c["sparsity"]): c for c in a["runs"]}
    for key, cell in cells.items():
        if key in first:
            assert cell["plans"]["oracle"] == first[key]["plans"]["oracle"]
    md = (out / "agreement-m.md").read_text()
    assert all(m["command"] in md for m in (a["meta"], b["meta"])) and "oracle-mass0.95" in md
    assert (out / "agreement-m-tradeoff.png").stat().st_size > 10_000
    assert r_kept.returncode == 0, r_kept.stderr[-2000:]
    kept = json.loads((out / "agreement-k.json").read_text())["runs"]
    assert {name for c in kept for name in c["plans"]} == {"prism-g4", "oracle-mass0.95"}
    assert {name for c in kept for name in c.get("passkey", {})} == {"dense", "prism-g4"}  # the first run's too
    # rows keep their share of the oracle's agreement when the oracle row itself is not kept
    assert all(0.9 < c["plans"]["prism-g4"]["agreement_of_oracle"] < 1.01 for c in kept)


def test_results_of_another_run_are_never_overwritten(tmp_path):
    """Two kernel_step runs in the same minute once shared a stamp and the second erased the
    first; a checkpoint or re-render of the same run (the same header) still rewrites its own files."""
    code = ("import json, sys, benchlib; out = sys.argv[1]; "
            "a = {'meta': {'date': '1'}, 'rows': [1]}; b = {'meta': {'date': '2'}, 'rows': [2]}; "
            "names = [benchlib.save(out, 'k', d, markdown='x', keep_others=True)[0].name for d in (a, b, a, b, {**b, 'rows': [3]})]; "
            "open(out + '/odd.json', 'w').write('[1, 2]'); "
            "names += [benchlib.save(out, 'odd', a, keep_others=True)[0].name, benchlib.save(out, 'k', b)[0].name]; "
            "print(json.dumps(names))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=BENCH, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    # kept: another run's files; rewritten: the same run's; a file that is no results is another run's;
    # without keep_others (a stem the user named), the stem is rewritten
    assert json.loads(r.stdout) == ["k.json", "k-2.json", "k.json", "k-2.json", "k-2.json", "odd-2.json", "k.json"]
    assert json.loads((tmp_path / "k.json").read_text())["rows"] == [2]
    assert json.loads((tmp_path / "k-2.json").read_text())["rows"] == [3]
    assert json.loads((tmp_path / "odd.json").read_text()) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k-2.json", "k-2.md", "k.json", "k.md", "odd-2.json", "odd.json"]


def test_dense_is_timed_under_every_sdpa_backend_that_takes_the_shape(monkeypatch):
    """The kernel benches' dense baseline is the fastest SDPA backend: one that cannot take the shape
    (cuDNN without a GPU) is skipped, each one that can is timed, and their attention agrees."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.syspath_prepend(str(BENCH))
    from benchlib.layers import DENSE_BACKENDS, Layers

    st = Layers(2, 96, 2, torch.device("cpu"), 4, 2, 32)
    timed = []
    times = st.dense_times(lambda fn: (timed.append(fn()), 3.0)[1])
    assert times == {"flash": 1.5}, times  # CPU SDPA has flash; cuDNN and memory-efficient need CUDA
    assert "CUDNN_ATTENTION" in DENSE_BACKENDS and st.dense_times(lambda fn: 1.0, cpu=True) == {"math": 0.5}
    with sdpa_kernel([SDPBackend.MATH]):
        math = st.dense()
    for a, b in zip(timed[0], math):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_kernel_times_keep_whole_names_and_add_up_one_kernels_events():
    """Two kernels sharing a 60-character prefix stay apart; one kernel's events are summed."""
    sys.path.insert(0, str(BENCH))
    import benchlib

    prefix = "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0_layer_norm"[:60]
    Event = SimpleNamespace
    events = [Event(key=prefix + "_a", device_time_total=30.0, count=6),
              Event(key=prefix + "_b", device_time_total=60.0, count=3),
              Event(key="_sparse_attn_kernel(int, float)", device_time_total=9.0, count=3),
              Event(key="_sparse_attn_kernel(long, float)", device_time_total=3.0, count=3),
              Event(key="cudaLaunchKernel", device_time_total=0.0, count=12)]
    assert benchlib.per_kernel(events, reps=3) == {prefix + "_a": (10.0, 2), prefix + "_b": (20.0, 1),
                                                   "_sparse_attn_kernel": (4.0, 2)}


def test_decode_timing_warms_up_until_two_windows_agree_and_takes_the_median_of_the_timed_ones(monkeypatch):
    """time_decode on a CPU stand-in whose steps take 3 ms through its first window, then 1 ms (a
    transient after a compile): the settling windows run until two in a row agree, and the step is the
    median of the windows timed after them; a step time that never settles stops at MAX_SETTLE."""
    import torch

    sys.path.insert(0, str(BENCH))
    from benchlib import llama

    steps, warm_calls = 10, 3  # warm_calls: the first call and two more before the windows
    clock = {"t": 0.0, "steps": 0}
    monkeypatch.setattr(llama.time, "perf_counter", lambda: clock["t"])

    def run(cost):
        clock.update(t=0.0, steps=0)

        def forward(ids, past_key_values=None, use_cache=True):
            clock["steps"] += 1
            clock["t"] += cost((clock["steps"] - warm_calls - 1) // steps)  # by window; warm calls: -1
            return SimpleNamespace(logits=torch.zeros(1, 1, 4))

        cache = SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(1))])
        return llama.time_decode(forward, cache, 1, steps, warm_calls, windows=3)

    timed = run(lambda window: 3e-3 if window < 1 else 1e-3)
    assert [round(w * 1e3, 6) for w in timed.settling] == [3.0, 1.0, 1.0], timed.settling
    assert timed.step == pytest.approx(1e-3) and len(timed.windows) == 3 and timed.first == pytest.approx(3e-3)
    assert timed.windows_ms() == dict(windows_step_ms=[w * 1e3 for w in timed.windows],
                                      settling_step_ms=[w * 1e3 for w in timed.settling])
    timed = run(lambda window: 1e-3 * (1 + window % 2))  # 1, 2, 1, 2 ms ...
    assert len(timed.settling) == llama.MAX_SETTLE and len(timed.windows) == 3


def test_the_workload_bench_forces_transformers_deferred_stop_check_and_puts_it_back():
    """bench/workload.py's A/B of generate()'s per-step stop read: inside the context transformers'
    DeferredStopCheck accepts a CUDA device (as it does `mps`), keeping its other conditions (a cache
    that is returned must be croppable); outside, it is transformers' own again."""
    import torch
    from transformers.generation.utils import DeferredStopCheck

    sys.path.insert(0, str(BENCH))
    import workload

    cuda, cropless = torch.device("cuda"), SimpleNamespace(is_croppable=False)
    own = DeferredStopCheck.__dict__["is_supported"]
    assert not DeferredStopCheck.is_supported(cuda, None, False, False)
    with workload.deferred_stop_check() as available:
        assert available
        assert DeferredStopCheck.is_supported(cuda, None, False, False)
        assert not DeferredStopCheck.is_supported(cuda, cropless, True, False)
        assert not DeferredStopCheck.is_supported(cuda, None, False, True)  # an assistant model: never
    assert DeferredStopCheck.__dict__["is_supported"] is own and not DeferredStopCheck.is_supported(cuda, None, False, False)

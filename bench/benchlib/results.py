"""A bench result on disk: `--out DIR`, the header every JSON carries, one writer, and the plots.

Nothing heavy is imported at module level, so that a script's `--help` stays fast; torch and
matplotlib are imported when a header or a plot is made.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
RESULTS = BENCH / "results"
# Results written before the header existed kept these at the top level; `load` moves them into "meta".
LEGACY_HEADER_KEYS = ("command", "date", "gpu", "device", "machine", "torch", "triton", "transformers", "python", "versions")


def _out_dir(text: str) -> Path:
    path = Path(text)
    path.mkdir(parents=True, exist_ok=True)
    return path


def add_out(parser: argparse.ArgumentParser, render: bool = False) -> None:
    """`--out DIR`: the folder the results go to (created), bench/results unless given; with
    `render`, also `--render`: redraw a script's tables and plots from its saved JSON (`load`)."""
    parser.add_argument("--out", type=_out_dir, default=str(RESULTS), metavar="DIR",
                        help="folder for the results, created if missing (default: bench/results)")
    if render:
        parser.add_argument("--render", action="store_true", help="only rewrite the .md and .png from the saved .json in --out")


# ------------------------------------------------------------------------------------ header
def header(args: argparse.Namespace, argv: list[str] | None = None) -> dict:
    """Where a result comes from: the command as run (repo-relative script path, so that it runs again
    from the repository root), every option after parsing, the date, the GPU ("cpu" when the run asked
    for the CPU or has no GPU), versions, and the git commit ("+dirty" when tracked files differ).
    `argv` is the script's argv when a `main(argv)` is called from Python (argv[0]: the script)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else None
    if script is not None and script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    return {
        "command": shlex.join(["python", *argv]),
        "args": {k: v if isinstance(v, (bool, int, float, type(None), list)) else str(v) for k, v in vars(args).items()},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "gpu": _gpu(getattr(args, "device", None)),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "versions": {"python": platform.python_version(), **{d: _version(d) for d in ("torch", "triton", "transformers")}},
        "commit": _commit(),
        "source": source_hash(),
    }


def where(meta: dict) -> str:
    """The device a result was measured on, for a line of Markdown: the GPU's name, or the CPU."""
    gpu = meta.get("gpu")
    return gpu if gpu and gpu != "cpu" else str(meta.get("machine", "cpu"))


def _gpu(device) -> str:
    import torch

    if str(device) == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def set_kernel_constant(knob: str) -> None:
    """`module.NAME=INT` sets a launch constant of sparse_fx.lowering.kernels.<module> (read at
    launch, so the next launches use it); an unknown module or name is an error naming it."""
    lhs, sep, value = knob.partition("=")
    module, dot, name = lhs.partition(".")
    if not (sep and dot and value.lstrip("-").isdigit()):
        raise SystemExit(f"--set {knob!r}: expected module.NAME=INT, e.g. select.WIDE_CAP=16")
    mod = importlib.import_module(f"sparse_fx.lowering.kernels.{module}")
    old = getattr(mod, name, None)
    if not isinstance(old, (bool, int)) or not name.isupper():
        raise SystemExit(f"--set {knob!r}: sparse_fx.lowering.kernels.{module} has no integer constant {name}")
    setattr(mod, name, type(old)(int(value)))


def source_hash(root: Path = ROOT) -> str:
    """sha1 (12 hex digits) of the package's and the benches' Python sources, by path: names the
    tree measured where the commit cannot (a GPU machine's copy of the working tree carries the
    .git of the session's start, so its HEAD is not what ran); computed again on a clean checkout
    of a commit, it says whether that commit is what ran."""
    import hashlib

    h = hashlib.sha1()
    for f in sorted(p for d in ("sparse_fx", "lowering", "runtime", "bench") for p in (root / d).rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def _commit() -> str | None:
    """Short hash of the checkout's HEAD, "+dirty" when a tracked file differs; None without git.
    SPARSE_FX_COMMIT overrides it, for a copy of the tree whose `.git` is not its own (a device
    machine's copy can carry a stale one)."""
    if os.environ.get("SPARSE_FX_COMMIT"):
        return os.environ["SPARSE_FX_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True, timeout=10).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------ writing
def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def axes(ax, xlabel: str, ylabel: str | None = None, title: str | None = None) -> None:
    """A bench plot's panel: context or sparsity on a log2 x axis, labelled."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)


def tradeoff(path, panels: dict, adaptive) -> Path:
    """Agreement against the mean tokens chosen per step, one panel per context: `panels` maps a
    context to {plan: [(tokens, agreement), ...]}; a fixed-budget plan is drawn as a curve over its
    sparsities, an adaptive one (`adaptive(plan)`: -mass<p>) as points."""
    plt = pyplot()
    fig, axs = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False, sharey=True)
    for ax, (n, series) in zip(axs[0], sorted(panels.items())):
        for plan, pts in series.items():
            ada = adaptive(plan)
            ax.plot(*zip(*sorted(pts)), marker="*" if ada else "o", ms=10 if ada else 5, ls="none" if ada else "-", label=plan)
        axes(ax, "tokens chosen per step and KV head (mean)", title=f"context {n}")
        ax.grid(alpha=0.3)
    axs[0][0].set_ylabel("next-token agreement with dense")
    axs[0][-1].legend(fontsize=7)
    out = savefig(fig, path)
    plt.close(fig)
    return out


def savefig(fig, path, dpi: int = 110) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return Path(path)


def _portable(text: str) -> str:
    """Paths in results: repo-relative inside the checkout, `~` for the home folder."""
    return text.replace(str(ROOT) + os.sep, "").replace(str(Path.home()), "~")


def _meta_of(source) -> dict | None:
    """The header of a saved results file (a path) or of results in memory, as written."""
    try:
        data = load(source.parent, source.stem) if isinstance(source, Path) else source
        return json.loads(_portable(json.dumps(data.get("meta"), default=str)))
    except (ValueError, AttributeError, TypeError, OSError):  # not a results file: never the same run
        return None


def save(out_dir, stem: str, data: dict, markdown: str | None = None, plot=None, keep_others: bool = False) -> list[Path]:
    """Write <stem>.json (which must carry its header as "meta"), <stem>.md when `markdown` is
    given, and <stem>.png through `plot(path)`; a plot that writes several figures returns their
    paths instead. Returns the paths written. A failing plot is reported, not raised: the numbers
    are already on disk. `keep_others` (for stems a script stamps itself, which two runs can share):
    another run's results of the same stem are kept and this run's go to <stem>-2, -3, ...; the same
    run (equal "meta": a checkpoint, a re-render) rewrites its own."""
    if "meta" not in data:
        raise ValueError("benchlib.save: data has no 'meta' header (benchlib.header(args))")
    out = _out_dir(str(out_dir))
    base, n, this_run = stem, 1, _meta_of(data)
    while keep_others and (out / f"{stem}.json").exists() and _meta_of(out / f"{stem}.json") != this_run:
        n += 1
        stem = f"{base}-{n}"
    paths = [out / f"{stem}.json"]
    paths[0].write_text(_portable(json.dumps(data, indent=1, default=str)) + "\n")
    if markdown is not None:
        paths.append(out / f"{stem}.md")
        paths[-1].write_text(_portable(markdown))
    if plot is not None:
        plt = pyplot()
        try:
            drawn = plot(out / f"{stem}.png")
            paths += [Path(p) for p in drawn] if drawn else [out / f"{stem}.png"]
        except Exception as e:  # noqa: BLE001
            print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            plt.close("all")
    return paths


def load(out_dir, stem: str) -> dict:
    """A results JSON for re-rendering; one written before the header existed gets its provenance
    keys moved into "meta"."""
    data = json.loads((Path(out_dir) / f"{stem}.json").read_text())
    if "meta" not in data:
        data = {"meta": {k: data.pop(k) for k in LEGACY_HEADER_KEYS if k in data}, **data}
    return data

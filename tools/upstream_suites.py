"""Run flax's and optax's own tests with our layers and transforms swapped in.

Each suite copies one upstream test file into a temporary directory, replaces
the upstream class or transform by ours (the mapping of docs/migration.md and
docs/clipping.md, only where the semantics are meant to match), runs pytest on
the tests that reach a swapped name and prints passed / failed / skipped.

Two variants per BatchNorm suite: `swap` replaces the class only; `commit`
also commits the window where the upstream test reads the running statistics,
since our layers move them once per window, at the commit (the documented
difference the `swap` variant trips over).

The upstream files are not part of this repository. flax's tests do not ship
in its wheel: pass a clone or a bare mirror of github.com/google/flax with
`--flax-repo` and the tag with `--flax-ref` (v0.12.7 is the newest tag
before 0.12.8; its normalization tests are unchanged up to the main branch
at the time of writing). optax's clipping test ships with the installed
optax and is read from there.

    PYTHONPATH=$PWD python tools/upstream_suites.py --flax-repo /path/to/flax

Exit status 0 whatever the counts: this reports, the tests of our own pin
every difference (see `tests/test_batchnorm.py`, `tests/test_clipping.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_OURS = (
    "from gradaccum_jax.flax import (AccumBatchNorm, NNXAccumBatchNorm,"
    " commit_batch_stats, commit_nnx_batch_stats)\nimport gradaccum_jax as ga\n"
)


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    origin: str  # "flax:<path>" (read from --flax-repo at --flax-ref) or "optax:<path>"
    patches: tuple[tuple[str, str], ...]  # (old, new); each must occur
    select: str  # pytest -k expression: the tests that reach a swapped name


_LINEN_SWAP = (("nn.BatchNorm(", "AccumBatchNorm("),)
_LINEN_COMMIT = (
    ("ema = vars_out['batch_stats']", "ema = commit_batch_stats(vars_out['batch_stats'])"),
)
_NNX_SWAP = (("nnx.BatchNorm(", "NNXAccumBatchNorm("),)
_NNX_COMMIT = (
    (
        "    nnx_out = nnx_model(x, mask=mask)\n",
        "    nnx_out = nnx_model(x, mask=mask)\n    commit_nnx_batch_stats(nnx_model)\n",
    ),
)
_OPTAX_SWAP = (
    ("_clipping.clip(", "ga.clip_value("),
    ("_clipping.clip_by_global_norm(", "ga.clip_norm("),
    ("_clipping.adaptive_grad_clip(", "ga.adaptive_grad_clip("),
)

SUITES = (
    Suite(
        "flax linen BatchNorm, swap",
        "flax:tests/linen/linen_test.py",
        _LINEN_SWAP,
        "NormalizationTest and batch_norm",
    ),
    Suite(
        "flax linen BatchNorm, commit",
        "flax:tests/linen/linen_test.py",
        _LINEN_SWAP + _LINEN_COMMIT,
        "NormalizationTest and batch_norm",
    ),
    Suite(
        "flax nnx BatchNorm vs linen, swap",
        "flax:tests/nnx/nn/normalization_test.py",
        _NNX_SWAP,
        "batchnorm or spectralnorm",
    ),
    Suite(
        "flax nnx BatchNorm vs linen, commit",
        "flax:tests/nnx/nn/normalization_test.py",
        _NNX_SWAP + _NNX_COMMIT,
        "batchnorm or spectralnorm",
    ),
    Suite(
        "optax clipping",
        "optax:transforms/_clipping_test.py",
        _OPTAX_SWAP,
        "(test_clip and not block_rms) or test_adaptive_grad_clip",
    ),
)


def _read(origin: str, flax_repo: Path | None, flax_ref: str) -> str:
    package, path = origin.split(":", 1)
    if package == "optax":
        import optax

        return (Path(optax.__file__).parent / path).read_text()
    if flax_repo is None:
        raise SystemExit(
            "flax's tests do not ship in its wheel; pass --flax-repo PATH, a clone or "
            "mirror of github.com/google/flax (e.g. git clone --bare "
            "https://github.com/google/flax)."
        )
    return subprocess.run(
        ["git", "--git-dir", str(flax_repo), "show", f"{flax_ref}:{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def _patch(text: str, suite: Suite) -> str:
    for old, new in suite.patches:
        if old not in text:
            raise SystemExit(f"{suite.name}: upstream text {old!r} not found; update the patch.")
        text = text.replace(old, new)
    # Our imports after the module docstring and license header (first import line).
    first = re.search(r"^(import|from) ", text, re.M)
    assert first is not None
    return text[: first.start()] + _OURS + text[first.start() :]


def _counts(output: str) -> dict[str, int]:
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    return {
        key: int(n)
        for n, key in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", summary)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flax-repo", type=Path, help="git dir of a flax clone or mirror")
    parser.add_argument("--flax-ref", default="v0.12.7")
    parser.add_argument("-v", "--verbose", action="store_true", help="print failing tests")
    parser.add_argument("--only", help="run the suites whose name contains this")
    parser.add_argument("--keep", type=Path, help="write the patched files here, not in a temp dir")
    args = parser.parse_args()
    flax_repo = args.flax_repo
    if flax_repo is not None and (flax_repo / ".git").is_dir():
        flax_repo = flax_repo / ".git"
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = str(args.keep or scratch)
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for i, suite in enumerate(SUITES):
            if args.only and args.only not in suite.name:
                continue
            test_file = Path(tmp) / f"upstream_{i}_test.py"
            test_file.write_text(_patch(_read(suite.origin, flax_repo, args.flax_ref), suite))
            result = subprocess.run(
                [
                    *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0"),
                    *("-W", "ignore", "-k", suite.select, "-o", "addopts=", str(test_file)),
                ],
                capture_output=True,
                text=True,
                cwd=tmp,
                env=env,
            )
            counts = _counts(result.stdout)
            errors = counts.get("error", 0) + counts.get("errors", 0)
            print(
                f"{suite.name}: {counts.get('passed', 0)} passed, "
                f"{counts.get('failed', 0)} failed, {counts.get('skipped', 0)} skipped"
                + (f", {errors} errors" if errors else "")
            )
            if args.verbose:
                for line in result.stdout.splitlines():
                    if line.startswith(("FAILED", "ERROR")):
                        print("   ", line[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())

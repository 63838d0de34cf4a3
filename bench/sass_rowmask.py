"""Static SASS of FA4's sm90 forward on a partial-tile mask, compiled on the CPU (no GPU): the
interval test per score (``KernelOptions(mask_mod="intervals")``, or the rules) against the
Interval Table read a row at a time (``"rows"``, ``kernels/fa4_rowmask.py``).

Per variant: instructions, branches, integer compares (ISETP), selects (FSEL / SEL), R2P and
global loads of the forward kernel. A static count, not a timing (``bench/h200.sh engines``
with ``fa4_rows`` says what it is worth).

    python bench/sass_rowmask.py [--masks shared_prompt_rm,clear]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))
from bench.sass import fake_fa4, opcodes, variant_main  # noqa: E402

VARIANTS = ("intervals", "rules", "rows")


def _child(name: str, variant: str) -> None:
    import torch

    import compilemask as cm
    from compilemask import masks

    spec = masks.EXAMPLES[name]()
    meta = masks.random_meta(spec, 2, 1000, torch.Generator().manual_seed(0))
    fake_fa4(cm.compile_mask(spec), meta, variant=variant, backward=False)


def _counts(dump: Path) -> dict:
    sass = next(dump.glob("*fwd_sm90*.sass")).read_text()
    return opcodes(sass, ["BRA", "ISETP", "FSEL", "SEL", "R2P", "LDG"])


def main() -> None:
    variant_main(__file__, _child, VARIANTS, _counts, "mask_mod", "shared_prompt_rm,clear,hstu")


if __name__ == "__main__":
    main()

"""Static SASS of FA4's sm90 backward (head dim 128, the transposed tile) on a partial-tile mask,
compiled on the CPU (no GPU): the default per-score test without a column view (the Interval
Table, or the rules where they cost less: ``mask_mod_variant``), the same with FA4's index wrap
kept (``kernels/fa4_unwrap.py`` off), the column view
(``"columns"``, ``kernels/fa4_colmask.py``), the same without its overflow path (the code every
unflagged key runs) and the always-True mask_mod (a wrong mask: the ceiling of any partial-tile
test).

Per variant: instructions, global loads, integer compares, selects, spill loads / stores of the
backward kernel, and ptxas's registers and spill bytes. A static count, not a timing
(``bash bench/h200.sh columns`` times it).

    python bench/sass_colmask.py [--masks shared_prompt_rm,clear]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))
from bench.sass import fake_fa4, opcodes, registers, variant_main  # noqa: E402

# "columns (common path)": the column mask without its overflow path (wrong for overflowing
# keys; counts the code every other key runs)
VARIANTS = ("default (wrapped)", "default", "columns", "columns (common path)", "true")


def _child(name: str, variant: str) -> None:
    import torch

    import compilemask as cm
    from bench.engines import _CeilingMaskMod
    from compilemask import masks
    from compilemask.pipeline.pipeline import PipelineConfig

    if variant == "default (wrapped)":  # FA4's wrap of the mask_mod's indices kept
        from compilemask.kernels import fa4_unwrap

        fa4_unwrap._unwrapped = lambda fn: False
    spec = masks.EXAMPLES[name]()
    meta = masks.random_meta(spec, 2, 1000, torch.Generator().manual_seed(0))
    if variant == "columns (common path)":
        from compilemask.kernels import fa4_colmask

        class CommonPath(fa4_colmask.ColumnIntervalMask):
            OVERFLOW_PATH = False

        # the patch fa4_lib.patched applies around the compile
        fa4_colmask.PATCHES = tuple((*p[:3], CommonPath) for p in fa4_colmask.PATCHES)
    if variant == "true":
        _CeilingMaskMod().__enter__()
    fake_fa4(cm.compile_mask(spec), meta,
             config=PipelineConfig(column_view=variant.startswith("columns")))


def _counts(dump: Path) -> dict:
    sass = next(dump.glob("*bwd_sm90*.sass")).read_text()
    return {**opcodes(sass, ["LDG", "ISETP", "FSEL", "STL", "LDL"]),
            **registers(next(dump.glob("*bwd_sm90*.ptx")))}


def main() -> None:
    variant_main(__file__, _child, VARIANTS, _counts, "backward mask_mod",
                 "shared_prompt_rm,clear,prefix_lm,sink_window")


if __name__ == "__main__":
    main()

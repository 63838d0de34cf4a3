"""Static SASS of FA4's sm90 forward on a partial-tile mask, compiled on the CPU (no GPU): the
interval test per score (``KernelOptions(mask_mod="intervals")``, or the rules) against the
Interval Table read a row at a time (``"rows"``, ``kernels/fa4_rowmask.py``).

Per variant: instructions, branches, integer compares (ISETP), selects (FSEL / SEL), R2P and
global loads of the forward kernel. A static count, not a timing (``bench/h200.sh engines``
with ``fa4_rows`` says what it is worth).

    python bench/sass_rowmask.py [--masks shared_prompt_rm,clear]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("intervals", "rules", "rows")


def _compile(mask: str, variant: str, dump: Path) -> bool:
    """One process per variant: the CuTe DSL reads its dump settings at import."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_ARCH="sm_90a",
               FLASH_ATTENTION_NUM_SMS="132", CUTE_DSL_KEEP="ptx,cubin,sass",
               CUTE_DSL_DUMP_DIR=str(dump), COMPILEMASK_CACHE_DIR=str(dump / "cache"))
    r = subprocess.run([sys.executable, __file__, "--child", mask, variant], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode:
        print(f"{mask} {variant}: {r.stderr.strip().splitlines()[-1]}", file=sys.stderr)
    return r.returncode == 0


def _child(name: str, variant: str) -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import compilemask as cm
    from compilemask import masks
    from compilemask.kernels import fa4

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import fake_on_cuda

    spec = masks.EXAMPLES[name]()
    mask = cm.compile_mask(spec)
    B, S, H, D = 2, 1000, 4, 128
    meta = masks.random_meta(spec, B, S, torch.Generator().manual_seed(0))
    desc = mask.preprocess(meta or None, seqlen_q=S, batch_size=B)
    lists = {"fwd": desc.block_sparse("fwd")}
    with FakeTensorMode():
        q = torch.empty(B, S, H, D, dtype=torch.bfloat16, device="cuda")
        fdesc, flists, _ = fake_on_cuda(desc, lists)
        fa4.fwd(q, q, q, fdesc, D**-0.5, "fa4", lists=flists["fwd"], variant=variant)


def _counts(dump: Path) -> dict:
    sass = next(dump.glob("*fwd_sm90*.sass")).read_text()
    return {"instructions": sass.count(";"), "BRA": len(re.findall(r"\bBRA\b", sass)),
            "ISETP": len(re.findall(r"\bISETP", sass)),
            "FSEL": len(re.findall(r"\bFSEL\b", sass)), "SEL": len(re.findall(r"\bSEL\b", sass)),
            "R2P": len(re.findall(r"\bR2P\b", sass)), "LDG": len(re.findall(r"\bLDG", sass))}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--masks", default="shared_prompt_rm,clear,hstu")
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.masks.split(","):
            for variant in VARIANTS:
                dump = Path(tmp) / f"{name}_{variant}"
                dump.mkdir()
                if _compile(name, variant, dump):
                    rows[(name, variant)] = _counts(dump)
    cols = list(next(iter(rows.values())))
    print("| mask | mask_mod | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for (name, variant), c in rows.items():
        print(f"| {name} | {variant} | " + " | ".join(str(c[k]) for k in cols) + " |")


if __name__ == "__main__":
    main()

"""Static SASS of FA4 kernels compiled on the CPU (no GPU), shared by ``bench/sass_*.py``: a
variant's compile in a child process with the CuTe DSL's dumps on, opcode counts, the table.
A static count, not a timing: it says what each score costs, the H200 what that is worth."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["compile_in_child", "fake_fa4", "opcodes", "print_table", "registers",
           "variant_table", "variant_main"]

ROOT = Path(__file__).resolve().parents[1]


def compile_in_child(script: str, args: list[str], dump: Path) -> bool:
    """Run ``script --child *args`` with the sm_90a fake-compile settings, its PTX / SASS dumped
    into ``dump``; one process per variant (the CuTe DSL reads its dump settings at import)."""
    # every cache in the dump folder: a kernel loaded from an earlier process's cache (the
    # parent's FA4 cache folder, when it set one) is not compiled, so not dumped
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_ARCH="sm_90a",
               FLASH_ATTENTION_NUM_SMS="132", CUTE_DSL_KEEP="ptx,cubin,sass",
               CUTE_DSL_DUMP_DIR=str(dump), COMPILEMASK_CACHE_DIR=str(dump / "cache"),
               FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=str(dump / "cache" / "fa4"),
               TILELANG_CACHE_DIR=str(dump / "cache" / "tilelang-builds"))
    r = subprocess.run([sys.executable, script, "--child", *args], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode:
        tail = (r.stderr.strip().splitlines() or ["failed"])[-1]
        print(f"{' '.join(args)}: {tail}", file=sys.stderr)
    return r.returncode == 0


def fake_fa4(mask, meta, *, B: int = 2, S: int = 1000, H: int = 4, D: int = 128,
             engine: str = "fa4", variant=None, score=None, tables=(), backward: bool = True,
             config=None) -> None:
    """FA4's forward (and backward) for ``mask`` on a descriptor of ``meta`` (``config``: its
    PipelineConfig), compiled under fake CUDA tensors in a child of ``compile_in_child`` (the
    dumps are the point); ``score``: a ``ScoreMod`` reading ``tables``."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from compilemask.kernels import fa4

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import fake_on_cuda

    desc = mask.preprocess(meta or None, seqlen_q=S, batch_size=B, config=config)
    lists = {k: desc.block_sparse(k) for k in ("fwd", "bwd64")}
    with FakeTensorMode():
        q = torch.empty(B, S, H, D, dtype=torch.bfloat16, device="cuda")
        fdesc, fl, fake = fake_on_cuda(desc, lists)
        sc = None if score is None else (score, [fake(t) for t in tables])
        out, lse = fa4.fwd(q, q, q, fdesc, D**-0.5, engine, lists=fl["fwd"], variant=variant,
                           score=sc)
        if backward:
            fa4.bwd(q, q, q, q, out, lse, fdesc, D**-0.5, engine, lists=fl["bwd64"],
                    variant=variant, score=sc)


def variant_table(script: str, masks: list[str], variants, counts, label: str) -> None:
    """Compile every (mask, variant) in a child of ``script`` (``--child MASK VARIANT``) and
    print ``counts(dump folder)`` per pair as one table; ``label`` names the variant column."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in masks:
            for n, variant in enumerate(variants):
                dump = Path(tmp) / f"{name}_{n}"
                dump.mkdir()
                if compile_in_child(script, [name, variant], dump):
                    rows[(name, variant)] = counts(dump)
    print_table(["mask", label], rows)


def variant_main(script: str, child, variants, counts, label: str, masks: str) -> None:
    """A variant tool's entry point: ``--child MASK VARIANT`` compiles one pair
    (``child(mask, variant)``), else ``[--masks a,b]`` (default ``masks``) prints the table."""
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--masks", default=masks)
    variant_table(script, ap.parse_args().masks.split(","), variants, counts, label)


def opcodes(sass: str, names: list[str]) -> dict:
    """Instructions, then how many of each opcode in ``names`` (a prefix: ``ISETP`` counts
    ``ISETP.GE.AND`` too)."""
    return {"instructions": sass.count(";"),
            **{n: len(re.findall(rf"\b{re.escape(n)}\b", sass)) for n in names}}


def print_table(labels: list[str], rows: dict) -> None:
    """``rows``: (label values) -> counts, as a markdown table."""
    cols = list(next(iter(rows.values())))
    print("| " + " | ".join(labels + cols) + " |")
    print("|" + "---|" * (len(labels) + len(cols)))
    for key, c in rows.items():
        print("| " + " | ".join([*map(str, key), *(str(c[k]) for k in cols)]) + " |")


def registers(ptx: Path) -> dict:
    """ptxas's register use and spill bytes for a dumped kernel's PTX (``ptxas -v``, sm_90a)."""
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
                       capture_output=True, text=True)
    regs = re.findall(r"Used (\d+) registers", r.stderr)
    spill = re.findall(r"(\d+) bytes spill stores", r.stderr)
    return {"registers": int(regs[-1]) if regs else None,
            "spill stores (bytes)": int(spill[-1]) if spill else None}

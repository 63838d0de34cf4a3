"""Command line: ``python -m compilemask demo [--train] | explain FILE.py:NAME | show ...``."""

from __future__ import annotations

import sys

import torch

import compilemask as cm
from compilemask.api.cli import run
from compilemask.masks import hstu, random_meta

__all__ = ["main"]


DEMO_USAGE = "usage: python -m compilemask demo [--train]"


def demo(argv=None) -> int:
    """The HSTU mask end to end on the CPU: compile, explain, preprocess, attend, check.
    ``--train``: a few training steps of a tiny transformers model on the mask instead."""
    argv = list(argv or [])
    if any(a in ("-h", "--help") for a in argv):
        print(DEMO_USAGE + "\n  --train  train a tiny transformers model with CompileMask "
              "attention (needs the [hf] extra)")
        return 0
    unknown = [a for a in argv if a != "--train"]
    if unknown:
        print(f"compilemask demo: error: unknown argument(s) {' '.join(unknown)} ({DEMO_USAGE})",
              file=sys.stderr)
        return 2
    if "--train" in argv:
        return _demo_train()
    spec = hstu()
    mask = cm.compile_mask(spec)
    print(mask.explain(show_code=False))
    print()
    B, S, H, D = 2, 300, 4, 64
    gen = torch.Generator().manual_seed(0)
    meta = random_meta(spec, B, S, gen)
    print("batch metadata:", {k: v.tolist() for k, v in meta.items()})
    desc = mask.preprocess(meta, seqlen_q=S, seqlen_k=S, fwd_tiles=(64, 64), check=True)
    print(desc.to_string(batch=0))
    exact = torch.equal(desc.dense_mask(), mask.reference_mask(meta, seqlen_q=S, seqlen_k=S))
    print(f"descriptor mask == brute-force mask of the Python rules: {exact}")
    q, k, v = (torch.randn(B, S, H, D, generator=gen, dtype=torch.float32).to(torch.bfloat16)
               for _ in range(3))
    out = cm.attention(q, k, v, desc)
    dense = mask.reference_mask(meta, seqlen_q=S, seqlen_k=S)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(1, 2), k.double().transpose(1, 2), v.double().transpose(1, 2),
        attn_mask=dense.unsqueeze(1)).transpose(1, 2)
    ref = torch.nan_to_num(ref) * dense.any(-1)[:, :, None, None]  # rows that see nothing: 0
    err = (out.double() - ref).abs().max().item()
    print(f"attention (CPU reference path) vs float64 SDPA: max abs error {err:.3e}")
    return 0 if exact and err < 2e-2 else 1


def _demo_train() -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("compilemask demo --train: error: needs transformers; install the [hf] extra: "
              "pip install -e \".[hf]\"", file=sys.stderr)
        return 2
    from compilemask.integrations.demo import train  # needs transformers (the [hf] extra)

    return train()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m compilemask {demo [--train]|explain FILE.py:NAME|"
              "show FILE.py:NAME ...|warmup FILE.py:NAME --seqlens ...}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        return demo(rest)
    if cmd in ("explain", "show", "warmup"):
        return run(cmd, rest)
    print(f"compilemask: unknown command {cmd!r} (demo, explain, show, warmup)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

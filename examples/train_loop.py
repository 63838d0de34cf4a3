"""A training loop on an HSTU mask whose sequence length and metadata change every step.

The mask is compiled once, before the loop. Each batch builds its Execution Descriptor from its
own metadata (``mask.preprocess``), and every layer of a small model passes that descriptor to
``cm.attention``. The loop prints the time of each step: the preprocess apart from the forward,
backward and optimizer step.

    python examples/train_loop.py                 # CPU, a few seconds
    python examples/train_loop.py --device cuda   # bf16 autocast, the GPU engines
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import compilemask as cm
from compilemask.masks import hstu


class Block(nn.Module):
    """Pre-norm attention (GQA) and MLP; the attention is ``cm.attention`` over the descriptor."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q = nn.Linear(dim, heads * head_dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, desc):
        B, S, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(B, S, self.heads, self.head_dim)  # [B, S, H, D], as FlashAttention
        k, v = self.kv(h).view(B, S, 2, self.kv_heads, self.head_dim).unbind(2)
        x = x + self.o(cm.attention(q, k, v, desc).reshape(B, S, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, max_len: int, dim=128, layers=2, heads=2, kv_heads=1,
                 head_dim=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, head_dim) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, desc):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x, desc)  # one descriptor per batch, read by every layer
        return self.head(self.norm(x))


def make_batch(batch: int, min_len: int, max_len: int, vocab: int, gen: torch.Generator):
    """A batch of one random length: HSTU metadata per sequence, and token ids that count up
    (mod ``vocab``) from a random start, so the next token is learnable; labels are -100 past a
    sequence's end."""
    S = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
    hist_end = torch.randint(S // 4, 3 * S // 4, (batch,), generator=gen)
    meta = {"ctx_end": hist_end // 8, "hist_end": hist_end,
            "seq_end": S - torch.randint(0, S // 8 + 1, (batch,), generator=gen),
            "group_size": torch.randint(4, 33, (batch,), generator=gen)}
    ids = (torch.randint(0, vocab, (batch, 1), generator=gen) + torch.arange(S)) % vocab
    labels = torch.where(torch.arange(S) < meta["seq_end"][:, None], ids.roll(-1, 1), -100)
    labels[:, -1] = -100
    return S, meta, ids, labels


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=192)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    mask = cm.compile_mask(hstu())  # once: the rules do not change, the metadata does
    model = TinyLM(args.vocab, args.max_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # the GPU engines take bf16 or fp16; the CPU reference path runs float32 as it is
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
    print(f"mask {mask.name!r} (K = {mask.num_intervals}), {len(model.blocks)} layers, "
          f"batch {args.batch}, sequence lengths {args.min_len}..{args.max_len}, {device}")

    seqlens, losses, prep_ms, step_ms = [], [], [], []
    for step in range(1, args.steps + 1):
        S, meta, ids, labels = make_batch(args.batch, args.min_len, args.max_len, args.vocab,
                                          gen)
        meta = {k: v.to(device) for k, v in meta.items()}
        ids, labels = ids.to(device), labels.to(device)
        t0 = time.perf_counter()
        # per batch: metadata on the GPU runs the generated TileLang preprocess there
        desc = mask.preprocess(meta, seqlen_q=S)
        _sync(device)
        t1 = time.perf_counter()
        with autocast:
            logits = model(ids, desc)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        _sync(device)
        t2 = time.perf_counter()
        seqlens.append(S)
        losses.append(loss.item())
        prep_ms.append(1e3 * (t1 - t0))
        step_ms.append(1e3 * (t2 - t1))
        print(f"step {step:3d}  S {S:4d}  preprocess {prep_ms[-1]:7.2f} ms  "
              f"fwd+bwd+step {step_ms[-1]:8.2f} ms  loss {losses[-1]:.4f}")
    ok = all(math.isfinite(x) for x in losses)
    later = sorted(step_ms[1:]) or step_ms  # the first step also compiles and warms up
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; median step {later[len(later) // 2]:.2f} ms"
          f" after the first ({step_ms[0]:.2f} ms){'' if ok else '; NON-FINITE LOSS'}")
    return {"seqlens": seqlens, "losses": losses, "preprocess_ms": prep_ms, "step_ms": step_ms}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: time them when they are done
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()

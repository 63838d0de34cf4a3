"""``python -m compilemask demo --train``: a few training steps of a tiny transformers model whose
attention is CompileMask on an HSTU mask (CPU; needs the ``[hf]`` extra)."""

from __future__ import annotations

import time

import compilemask as cm
from compilemask.integrations.transformers import register
from compilemask.masks import hstu

__all__ = ["train"]


def train(steps: int = 5, seed: int = 0) -> int:
    """Train a 2-layer Qwen3 (GQA, float32) on one fixed HSTU batch; print the loss per step.
    Returns 0 when every loss is finite and the last is below the first."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    B, S, vocab = 2, 200, 128
    mask = cm.compile_mask(hstu())
    # the second sequence ends early: its last rows see nothing and carry no loss
    meta = {"ctx_end": torch.tensor([16, 8]), "hist_end": torch.tensor([120, 90]),
            "seq_end": torch.tensor([200, 170]), "group_size": torch.tensor([16, 10])}
    desc = mask.preprocess(meta, seqlen_q=S, check=True)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, use_cache=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register())
    model.train()
    ids = torch.randint(0, vocab, (B, S))
    labels = torch.where(torch.arange(S) < meta["seq_end"][:, None], ids, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}: {config.num_hidden_layers} layers, {n_params} parameters, "
          f"attn_implementation={model.config._attn_implementation!r}; mask {mask.name!r} "
          f"(K = {mask.num_intervals}), batch {B} x {S} tokens")
    losses = []
    for step in range(1, steps + 1):
        loss = model(ids, labels=labels, compilemask_desc=desc).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"step {step}  loss {losses[-1]:.4f}")
    ok = all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {steps} steps, "
          f"{time.perf_counter() - t0:.1f} s: {'decreasing' if ok else 'NOT decreasing'}")
    return 0 if ok else 1

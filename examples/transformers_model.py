"""CompileMask inside a transformers model, checked against the model's own SDPA attention.

A small random-init Qwen3 (GQA) runs a forward and backward with CompileMask attention
(``compilemask.integrations.transformers.register()``) on an HSTU mask whose second sequence
ends early; a copy with the same weights runs under ``attn_implementation="sdpa"`` with the
descriptor's dense mask as its 4-D ``attention_mask``. The two must give the same logits and
gradients up to float32 rounding. Needs the ``[hf]`` extra.

    python examples/transformers_model.py
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

import compilemask as cm
from compilemask.integrations.transformers import register
from compilemask.masks import hstu


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=160)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    S, vocab = args.seqlen, 256
    torch.manual_seed(args.seed)

    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, use_cache=False)
    # from_config writes the attention implementation into the config: one copy each
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                             attn_implementation=register())
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    sdpa.load_state_dict(model.state_dict())

    # context, causal history, targets in groups; the second sequence's rows past seq_end see
    # nothing (output 0) and carry no loss
    meta = {"ctx_end": torch.tensor([S // 10, 0]), "hist_end": torch.tensor([S * 6 // 10, S // 2]),
            "seq_end": torch.tensor([S, S * 9 // 10]), "group_size": torch.tensor([8, 5])}
    mask = cm.compile_mask(hstu())
    desc = mask.preprocess(meta, seqlen_q=S, check=True)
    ids = torch.randint(0, vocab, (2, S))
    labels = torch.where(torch.arange(S) < meta["seq_end"][:, None], ids, -100)

    out = model(ids, labels=labels, compilemask_desc=desc)
    out.loss.backward()
    # SDPA's boolean convention is the descriptor's: True = attend
    ref = sdpa(ids, labels=labels, attention_mask=desc.dense_mask()[:, None])
    ref.loss.backward()

    logit_diff = (out.logits - ref.logits).abs().max().item()
    grads = dict(sdpa.named_parameters())
    grad_diff = max((p.grad - grads[n].grad).abs().max().item()
                    for n, p in model.named_parameters())
    loss_diff = abs(out.loss.item() - ref.loss.item())
    print(f"{type(model).__name__}: {args.layers} layers, attn_implementation="
          f"{model.config._attn_implementation!r}; mask {mask.name!r} (K = {mask.num_intervals})"
          f", batch 2 x {S} tokens")
    print(f"loss {out.loss.item():.6f} (sdpa {ref.loss.item():.6f})")
    print(f"max |logits - sdpa logits| = {logit_diff:.2e}")
    print(f"max |grad - sdpa grad|     = {grad_diff:.2e} over {len(grads)} parameters")
    return {"max_logit_diff": logit_diff, "max_grad_diff": grad_diff, "loss_diff": loss_diff,
            "loss": out.loss.item()}


if __name__ == "__main__":
    main()

"""FA4's sm90 score_mod calls without the index wrap, for score_mods that do not need it.

Whenever a call has aux tensors, FA4 4.0.0b36 reduces q_idx and kv_idx modulo the sequence
lengths before every score_mod call (a fast division per index and score), so that a
score_mod's table reads stay in bounds on the padded rows and columns of edge tiles. A
generated score_mod clamps its reads itself, and one that is finite at any index
(``codegen.cute_score_mod.index_total``) carries ``UNWRAPPED_ATTR``: for it, the functions
installed here call FA4's own ``apply_score_mod_inner`` / ``apply_score_mod_bwd_inner`` with no
divisors, FA4's unwrapped path. The padded positions then see indices past the sequence;
their scores are masked (forward columns), discarded (forward rows) or multiplied by a zero
probability (backward rows, whose LSE is +inf), which holds for any finite score.
Static SASS, causal + ALiBi, D = 128: the forward goes from 3976 to 3176 instructions (2376
with no score_mod), the backward from 1544 to 1416 (``python bench/sass_score_mod.py
unwrap``).

Every other score_mod, and every call of an architecture other than sm90, runs FA4's code
unchanged. ``tests/test_score_mod.py`` pins the FA4 internals relied on (the module globals
and the parameter lists).
"""

from __future__ import annotations

from flash_attn.cute import flash_bwd_sm90, flash_fwd_sm90, softmax

from compilemask.codegen.cute_score_mod import UNWRAPPED_ATTR

__all__ = ["install"]

_FWD = softmax.apply_score_mod_inner
_BWD = softmax.apply_score_mod_bwd_inner


def _divisors(fn, fastdiv_mods):
    return None if getattr(fn, UNWRAPPED_ATTR, False) else fastdiv_mods


# Plain functions, called while FA4's kernels are traced: they pick FA4's arguments and call
# its @cute.jit functions, which inline into the kernel as before.
def apply_score_mod_inner(score_tensor, index_tensor, score_mod, batch_idx, head_idx,
                          softmax_scale, vec_size, qk_acc_dtype, aux_data, fastdiv_mods,
                          seqlen_info, constant_q_idx, qhead_per_kvhead=1,
                          transpose_indices=False):
    return _FWD(score_tensor, index_tensor, score_mod, batch_idx, head_idx, softmax_scale,
                vec_size, qk_acc_dtype, aux_data, _divisors(score_mod, fastdiv_mods),
                seqlen_info, constant_q_idx, qhead_per_kvhead, transpose_indices)


def apply_score_mod_bwd_inner(grad_tensor, score_tensor, index_tensor, score_mod_bwd, batch_idx,
                              head_idx, softmax_scale, vec_size, qk_acc_dtype, aux_data,
                              fastdiv_mods, seqlen_info, constant_q_idx, qhead_per_kvhead=1,
                              transpose_indices=False):
    return _BWD(grad_tensor, score_tensor, index_tensor, score_mod_bwd, batch_idx, head_idx,
                softmax_scale, vec_size, qk_acc_dtype, aux_data,
                _divisors(score_mod_bwd, fastdiv_mods), seqlen_info, constant_q_idx,
                qhead_per_kvhead, transpose_indices)


def install() -> None:
    """Make FA4's sm90 kernels call the functions above (idempotent)."""
    flash_fwd_sm90.apply_score_mod_inner = apply_score_mod_inner
    flash_bwd_sm90.apply_score_mod_inner = apply_score_mod_inner
    flash_bwd_sm90.apply_score_mod_bwd_inner = apply_score_mod_bwd_inner

"""FA4's sm90 mask_mod and score_mod calls without the index wrap, for the generated functions.

Whenever a call has aux tensors, FA4 4.0.0b40 clamps q_idx and kv_idx into the sequence
lengths before a mask_mod call on an edge tile (every partial tile of the sm90 backward) and
before every score_mod call (a min per index and score; 4.0.0b36 reduced them modulo the
lengths, a fast division each), so that a mask_mod's or a score_mod's table reads stay in
bounds on the padded rows and columns past the sequence.

The generated functions clamp their reads themselves, so they carry ``UNWRAPPED_ATTR``:
- a mask_mod, always: the padded positions' mask values are replaced by FA4's own seqlen test;
- a score_mod where it is finite at any index (``codegen.cute_score_mod.index_total``): the
  padded positions' scores are then masked (forward columns), discarded (forward rows) or
  multiplied by a zero probability (backward rows, whose LSE is +inf).
For those, :class:`UnwrappedMask` and the two functions patched in here call FA4's own code
with no divisors, its unwrapped path. The backward's mask also drops FA4's seqlen test for a
generated mask_mod, which masks the keys past seqlen_k itself (the clipped table, or a
compare): keys only, as FA4's own masks test. Static SASS of the sm90 kernels, D = 128
(``bench/sass_colmask.py``, ``bench/sass_score_mod.py unwrap``): causal + ALiBi's forward
3976 -> 3176 instructions (2376 with no score_mod); shared-prompt RM's backward 2808 -> 2568
with its 24 bytes of spill gone; prefix-LM's 2544 -> 2296, its 32 bytes of spill gone.

Every other mask_mod or score_mod, and every architecture other than sm90, runs FA4's code
unchanged. ``tests/test_fa4_unwrap.py`` pins the FA4 internals relied on (the module globals,
the parameter lists, the wrap's conditions, the keys-only seqlen test of FA4's own masks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import cutlass.cute as cute

from compilemask.codegen.cute_predicate import UNWRAPPED_ATTR, VECTOR_ATTR
from compilemask.kernels import fa4_lib

__all__ = ["UnwrappedMask", "PATCHES"]

softmax = fa4_lib.module("softmax")
AttentionMask = fa4_lib.module("mask").AttentionMask
AuxData = fa4_lib.module("utils").AuxData

_FWD = softmax.apply_score_mod_inner
_BWD = softmax.apply_score_mod_bwd_inner


def _unwrapped(fn) -> bool:
    return fn is not None and getattr(fn, UNWRAPPED_ATTR, False)


@dataclass(frozen=True)
class UnwrappedMask(AttentionMask):
    """FA4's mask, without the divisors for a mask_mod carrying ``UNWRAPPED_ATTR``; the base of
    the forward's and the backward's installed masks (``fa4_rowmask``, ``fa4_colmask``), which
    mask the calls they take (:meth:`takes`) their own way (:meth:`apply_own`).

    With ``KEYS_ONLY_SEQLEN`` (the backward's), such a mask_mod also runs without FA4's
    seqlen test, a compare per row and per key and a second select per score in
    every partial tile: its keys past seqlen_k are already masked, and the backward's padded
    query rows need none, as for FA4's own masks, which test keys only (their Q and dO rows are
    zero, so their P, dS and dV terms are)."""

    KEYS_ONLY_SEQLEN: ClassVar[bool] = False

    @cute.jit
    def apply_mask(
        self,
        acc_S: cute.Tensor,
        batch_idx: cutlass.Int32,
        head_idx: cutlass.Int32,
        m_block: cutlass.Int32,
        n_block: cutlass.Int32,
        thr_mma: cute.TiledMma,
        mask_seqlen: cutlass.Constexpr[bool],
        mask_causal: cutlass.Constexpr[bool],
        mask_local: cutlass.Constexpr[bool] = False,
        mask_mod: cutlass.Constexpr = None,
        aux_data: AuxData = AuxData(),  # noqa: B008 (FA4's signature)
        fastdiv_mods=(None, None),
    ) -> None:
        if cutlass.const_expr(self.takes(mask_mod, mask_causal, mask_local)):
            self.apply_own(acc_S, batch_idx, head_idx, m_block, n_block, thr_mma, mask_seqlen,
                           mask_mod, aux_data)
        else:
            ours = cutlass.const_expr(_unwrapped(mask_mod) and not mask_causal
                                      and not mask_local)
            keys = cutlass.const_expr(ours and self.KEYS_ONLY_SEQLEN)
            AttentionMask.apply_mask(self, acc_S, batch_idx, head_idx, m_block, n_block,
                                     thr_mma, cutlass.const_expr(mask_seqlen and not keys),
                                     mask_causal, mask_local, mask_mod, aux_data,
                                     (None, None) if cutlass.const_expr(ours) else fastdiv_mods)

    def takes(self, mask_mod, mask_causal: bool, mask_local: bool) -> bool:
        """Whether a subclass masks this call its own way (:meth:`apply_own`); decided while
        the kernel is traced."""
        return False

    @cute.jit
    def apply_own(self, acc_S: cute.Tensor, batch_idx: cutlass.Int32, head_idx: cutlass.Int32,
                  m_block: cutlass.Int32, n_block: cutlass.Int32, thr_mma: cute.TiledMma,
                  mask_seqlen: cutlass.Constexpr[bool], mask_mod: cutlass.Constexpr,
                  aux_data: AuxData) -> None:
        raise NotImplementedError("a subclass that takes a call masks it")


# Plain functions, called while FA4's kernels are traced: they pick FA4's arguments and call
# its @cute.jit functions, which inline into the kernel as before.
def apply_score_mod_inner(score_tensor, index_tensor, score_mod, batch_idx, head_idx,
                          softmax_scale, vec_size, qk_acc_dtype, aux_data, fastdiv_mods,
                          seqlen_info, constant_q_idx, qhead_per_kvhead=1,
                          transpose_indices=False):
    return _FWD(score_tensor, index_tensor, score_mod, batch_idx, head_idx, softmax_scale,
                vec_size, qk_acc_dtype, aux_data,
                None if _unwrapped(score_mod) else fastdiv_mods, seqlen_info, constant_q_idx,
                qhead_per_kvhead, transpose_indices)


def apply_score_mod_bwd_inner(grad_tensor, score_tensor, index_tensor, score_mod_bwd, batch_idx,
                              head_idx, softmax_scale, vec_size, qk_acc_dtype, aux_data,
                              fastdiv_mods, seqlen_info, constant_q_idx, qhead_per_kvhead=1,
                              transpose_indices=False):
    # a generated hook that trains a table takes its scores several at a time (it reads its
    # tables per element itself), where they divide the fragment
    want = getattr(score_mod_bwd, VECTOR_ATTR, None) if score_mod_bwd is not None else None
    if want and cute.size(grad_tensor.shape) % want == 0:
        vec_size = want
    return _BWD(grad_tensor, score_tensor, index_tensor, score_mod_bwd, batch_idx, head_idx,
                softmax_scale, vec_size, qk_acc_dtype, aux_data,
                None if _unwrapped(score_mod_bwd) else fastdiv_mods, seqlen_info,
                constant_q_idx, qhead_per_kvhead, transpose_indices)


# FA4's sm90 kernels call the score_mod functions above during this package's calls
# (``fa4_lib.patched``: FA4 module, global, FA4's own value, ours); the masks are
# ``fa4_rowmask``'s and ``fa4_colmask``'s
PATCHES = (
    ("flash_fwd_sm90", "apply_score_mod_inner", ("softmax", "apply_score_mod_inner"),
     apply_score_mod_inner),
    ("flash_bwd_sm90", "apply_score_mod_inner", ("softmax", "apply_score_mod_inner"),
     apply_score_mod_inner),
    ("flash_bwd_sm90", "apply_score_mod_bwd_inner", ("softmax", "apply_score_mod_bwd_inner"),
     apply_score_mod_bwd_inner),
)

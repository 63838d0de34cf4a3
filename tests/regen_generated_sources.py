"""Every source the package generates, for every example mask, as ``{name: text}``; and the
table of their sha256 that tests/test_generated_sources.py checks (``tests/data/
generated_sources.json``).

A change to a generator that is meant to change its output regenerates the table:

    python -m tests.regen_generated_sources

(from the checkout's root), and the table's diff goes into the same commit. Generation only:
no program is compiled, so it runs on a CPU-only machine.

The generators are looked up at their module paths of the layered folders and, before them, of
the flat package (``compilemask.flex`` was ``compilemask.dsl.flex``'s path), so
``tools/compare_generated_sources.py`` can run this file against an older checkout.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

TABLE = Path(__file__).resolve().parent / "data" / "generated_sources.json"

SEQLEN = 64
BATCH = 2

# where each generator lives: the layered path first, then the flat one
_WHERE = {
    "compile_mask": ("compilemask",),
    "EXAMPLES": ("compilemask.masks",),
    "random_meta": ("compilemask.masks",),
    "flex_mask_mod": ("compilemask.masks",),
    "from_mask_mod": ("compilemask.dsl.flex", "compilemask.flex"),
    "compile_score_mod": ("compilemask.dsl.score_mod", "compilemask.score_mod"),
    "score_mods": ("compilemask.dsl.score_mods", "compilemask.score_mods"),
    "tilelang_source": ("compilemask.codegen.preprocess",),
    "column_table_source": ("compilemask.codegen.column_table",),
    "list_programs": ("compilemask.codegen.blocksparse",),
    "mask_mod_source": ("compilemask.codegen.cute_mask_mod",),
    "VARIANTS": ("compilemask.codegen.cute_mask_mod",),
    "predicate_source": ("compilemask.codegen.cute_predicate",),
    "score_mod_source": ("compilemask.codegen.cute_score_mod",),
    "TileConfig": ("compilemask.contract.descriptor", "compilemask.descriptor"),
}

RESOLVED: dict[str, str] = {}  # generator -> the module it was found in


def find(name: str):
    """The generator ``name`` from the first of its modules that has it."""
    tried = []
    for mod in _WHERE[name]:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if not (e.name and mod.startswith(e.name)):
                raise  # the module exists but one of its imports is missing
            tried.append(mod)
            continue
        if name == "score_mods":
            RESOLVED[name] = mod
            return m
        if hasattr(m, name):
            RESOLVED[name] = mod
            return getattr(m, name)
        tried.append(mod)
    raise ImportError(f"generator {name!r} is in none of {tried}")


def _text(fn, *args, **kwargs) -> str:
    """The generated text, or the refusal (a refusal that changes is a change too)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - recorded, compared
        return f"REFUSED {type(e).__name__}: {e}"


def mask_sources(mask) -> dict[str, str]:
    """Every source generated for one compiled mask, by kind."""
    tl, ct = find("tilelang_source"), find("column_table_source")
    mm, ps = find("mask_mod_source"), find("predicate_source")
    tiles = find("TileConfig")(64, 64)
    out = {"reference": mask.reference_source()}
    for target in ("cuda", "c"):
        out[f"preprocess/{target}"] = _text(tl, mask, target)
        out[f"column_table/{target}"] = _text(ct, mask, target)
    out["preprocess/cuda/int32"] = _text(tl, mask, "cuda", meta_dtype="int32")
    out["preprocess/cuda/rows"] = _text(tl, mask, "cuda", rows=True)
    out["preprocess/cuda/tiles64"] = _text(tl, mask, "cuda", tiles, tiles)
    for variant in (None, *find("VARIANTS")):
        for heads in (1, 2):
            out[f"mask_mod/{variant or 'default'}/h{heads}"] = _text(mm, mask, variant, heads)
    for r in mask.regions:
        for what in ("rule", "guard"):
            out[f"predicate/{r.index}/{what}"] = _text(
                ps, getattr(r, what), mask.scalar_params, mask.array_params,
                name=f"predicate_{r.index}", table_params=mask.table_params)
        # the kernels' fallback predicate: default name, no table params
        out[f"predicate/{r.index}/kernel"] = _text(ps, r.rule, mask.scalar_params,
                                                  mask.array_params)
    return out


def _score_mods() -> dict:
    """The score_mods of ``dsl.score_mods`` and a few written inline, by name."""
    import torch

    sm = find("score_mods")
    g = torch.Generator().manual_seed(0)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx)

    def causal_inf(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score, -float("inf"))

    bias = torch.randn(BATCH, 4, generator=g)

    def per_batch_head(score, b, h, q_idx, kv_idx):
        return score * 0.5 + bias[b, h]

    return {
        "alibi": sm.alibi(sm.alibi_slopes(4)),
        "softcap": sm.softcap(30.0),
        "t5_bias": sm.t5_bias(torch.randn(32, 4, generator=g)),
        "temperature": sm.temperature(torch.rand(4, generator=g) + 0.5),
        "rel_bias": rel_bias,
        "causal_inf": causal_inf,
        "per_batch_head": per_batch_head,
    }


def score_mod_sources() -> dict[str, str]:
    import torch  # noqa: F401 - the score_mods' tensors

    csm, src = find("compile_score_mod"), find("score_mod_source")
    out = {}
    for name, fn in _score_mods().items():
        try:
            sm, _ = csm(fn, name)
        except Exception as e:  # noqa: BLE001 - a refusal, compared
            out[f"score_mod/{name}"] = f"REFUSED {type(e).__name__}: {e}"
            continue
        for offset, gqa, bits in ((0, 1, False), (2, 1, False), (0, 4, False), (0, 1, True)):
            out[f"score_mod/{name}/o{offset}_g{gqa}_b{int(bits)}"] = _text(
                src, sm, offset, gqa, bits)
        if sm.relative:  # relative indices read from tables, a trained table
            out[f"score_mod/{name}/o0_g4_b0_relative"] = _text(src, sm, 0, 4, False,
                                                                relative=True)
            out[f"score_mod/{name}/o0_g4_b0_relative_train"] = _text(
                src, sm, 0, 4, False, (0,), relative=True)
    return out


def _flex_masks():
    """``(name, mask_mod)``: each example's FlexAttention mask_mod over seeded metadata, and a
    few written inline."""
    import torch

    ex, rm, fm = find("EXAMPLES"), find("random_meta"), find("flex_mask_mod")
    g = torch.Generator().manual_seed(0)
    out = []
    for name, make in ex.items():
        spec = make()
        meta = rm(spec, BATCH, SEQLEN, g)
        out.append((f"flex_{name}", fm(spec, meta, SEQLEN)))
    doc = torch.arange(SEQLEN) // 16
    prefix = torch.tensor([5, 20])

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (q_idx >= kv_idx)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 8)

    return out + [("gym_document", document), ("gym_prefix_lm", prefix_lm),
                  ("gym_window", window)]


def example_sources() -> dict[str, str]:
    """``{"<mask>/<kind>...": text}`` of the example masks, the tile-list programs and the
    score_mods: the fast part."""
    compile_mask = find("compile_mask")
    out = {}
    for name, make in find("EXAMPLES").items():
        for kind, text in mask_sources(compile_mask(make())).items():
            out[f"{name}/{kind}"] = text
    for target in ("cuda", "c"):
        for i, p in enumerate(find("list_programs")(target=target)):
            out[f"lists/{target}/{i}"] = p.source
    out.update(score_mod_sources())
    return out


def flex_sources() -> dict[str, str]:
    """``{"<flex_|gym_><mask>/<kind>...": text}`` of the FlexAttention mask_mods as converted
    by ``from_mask_mod`` (a conversion and a compile each: the slow part)."""
    compile_mask, from_mask_mod = find("compile_mask"), find("from_mask_mod")
    out = {}
    for name, fn in _flex_masks():
        try:
            spec, _ = from_mask_mod(fn, batch_size=BATCH, name=name, seqlen=SEQLEN)
            mask = compile_mask(spec)
        except Exception as e:  # noqa: BLE001 - a refusal, compared
            out[f"{name}/convert"] = f"REFUSED {type(e).__name__}: {e}"
            continue
        for kind, text in mask_sources(mask).items():
            out[f"{name}/{kind}"] = text
    return out


def collect() -> dict[str, str]:
    """Every generated source, by name."""
    return {**example_sources(), **flex_sources()}


def is_flex(name: str) -> bool:
    return name.startswith(("flex_", "gym_"))


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def table() -> dict[str, str]:
    return {k: digest(v) for k, v in sorted(collect().items())}


def main() -> int:
    # generation compiles nothing, but the package must not reach the user's cache folder
    with tempfile.TemporaryDirectory(prefix="compilemask-regen-") as tmp:
        os.environ.setdefault("COMPILEMASK_CACHE_DIR", tmp)
        t = table()
    TABLE.parent.mkdir(exist_ok=True)
    TABLE.write_text(json.dumps(t, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(t)} hashes to {TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

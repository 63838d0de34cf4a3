"""The examples run: each mask module's main() (compilemask/masks/<name>.py), the end-to-end
scripts in examples/ at small sizes, and the ``show`` command of docs/inspection.md."""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import shlex

import pytest
import torch

import compilemask as cm
from compilemask import masks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    path = os.path.join(ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- each mask module's main(): explain, preprocess random metadata, print the tiles ----------
@pytest.mark.parametrize("name", sorted(masks.EXAMPLES))
def test_mask_module_main(name, capsys):
    module = importlib.import_module(f"compilemask.masks.{name}")
    desc = module.main(seqlen=150, batch=2, seed=1)
    out = capsys.readouterr().out
    assert f"K = {desc.num_intervals} interval slot(s)" in out  # the explanation
    assert desc.to_string(batch=0) in out  # the tiles
    # the descriptor main() printed is the mask of the Python rules on the same metadata
    meta = masks.random_meta(desc.mask.spec, 2, 150, torch.Generator().manual_seed(1))
    ref = desc.mask.reference_mask(meta, seqlen_q=150, seqlen_k=150, batch_size=2)
    assert torch.equal(desc.dense_mask(), ref)


def test_clear_main_explains_k(capsys):
    from compilemask.masks import clear

    module = importlib.import_module("compilemask.masks.clear")
    module.main(seqlen=120, radius=1, width=8)
    out = capsys.readouterr().out
    assert cm.compile_mask(clear(1, 8)).num_intervals == 4
    assert "K = 4 = 2R + 2 with R = 1" in out and "2R + 1 = 3 values" in out
    assert "quotient ranges enumerated" in out and "-> 3 intervals" in out


def test_dilated_causal_is_the_fallback_one(capsys):
    module = importlib.import_module("compilemask.masks.dilated_causal")
    desc = module.main(seqlen=100)
    out = capsys.readouterr().out
    assert desc.has_fallback and "FALLBACK" in out and "fallback regions: all" in out
    assert "without a bounded quotient range" in out  # the reason
    # with the code: the generated CuTe predicate of the fallback region
    code = desc.mask.explain(show_code=True)
    assert "generated CuTe fallback predicate (region 0 'all'" in code
    assert "@cute.jit" in code and "def fallback_predicate(q_idx, kv_idx" in code


# ---- examples/ ---------------------------------------------------------------------------------
def test_train_loop(capsys):
    res = load("train_loop").main(["--steps", "8", "--min-len", "24", "--max-len", "80",
                                   "--lr", "1e-2"])
    out = capsys.readouterr().out
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(steps) == len(res["losses"]) == 8
    assert len(set(res["seqlens"])) > 1 and all(24 <= s <= 80 for s in res["seqlens"])
    assert all(f"S {s:4d}" in ln for s, ln in zip(res["seqlens"], steps))  # per-step lengths
    assert all(math.isfinite(x) for x in res["losses"])
    assert sum(res["losses"][-3:]) < sum(res["losses"][:3])  # it learns the counting tokens
    assert all(t > 0 for t in res["preprocess_ms"] + res["step_ms"])
    assert "median step" in out and "NON-FINITE" not in out


def test_transformers_model_matches_sdpa(capsys):
    pytest.importorskip("transformers")
    res = load("transformers_model").main(["--seqlen", "48"])
    out = capsys.readouterr().out
    assert res["max_logit_diff"] < 1e-4 and res["max_grad_diff"] < 1e-4
    assert res["loss_diff"] < 1e-5 and math.isfinite(res["loss"])
    assert "attn_implementation='compilemask'" in out and "max |logits - sdpa logits|" in out


# ---- the show command of docs/inspection.md ----------------------------------------------------
def test_docs_show_command_runs(tmp_path, capsys):
    from compilemask.api.cli import run

    guide = open(os.path.join(ROOT, "docs", "inspection.md")).read()
    line = re.search(r"`python -m compilemask (show [^`]*\.py:\w+ [^`]*)`", guide).group(1)
    cmd, *argv = shlex.split(line)
    argv[0] = os.path.join(ROOT, argv[0])  # the file, relative to the repository root
    argv[argv.index("--out") + 1] = str(tmp_path / "mask.png")
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("needs matplotlib (the [viz] extra)")
    assert run(cmd, argv) == 0
    assert (tmp_path / "mask.png").stat().st_size > 1000
    assert capsys.readouterr().out.startswith("hstu: seqlen_q=4096")

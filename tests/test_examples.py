"""Every example's main() runs: compile, explain, check against the brute-force mask, picture."""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest

import compilemask as cm
from compilemask import masks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["causal", "sliding_window", "prefix_lm", "packed_documents", "hstu",
         "shared_prompt_rm", "clear", "dilated_causal"]

pytest.importorskip("matplotlib")


def load(name):
    path = os.path.join(ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", NAMES)
def test_example_main_runs(name, tmp_path, capsys):
    mod = load(name)
    assert isinstance(mod.SPEC, cm.MaskSpec)
    desc = mod.main(seqlen=150, batch=2, seed=1, out_dir=str(tmp_path), show_code=False)
    out = capsys.readouterr().out
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert "descriptor mask == reference mask of the Python rules" in out
    assert desc.to_string(batch=0) in out  # the tile rendering is printed
    assert f"K = {desc.num_intervals} interval slot(s)" in out  # the explanation is printed


def test_example_main_with_generated_code(tmp_path, capsys):
    load("hstu").main(seqlen=64, batch=1, out_dir=str(tmp_path))
    out = capsys.readouterr().out
    assert "generated TileLang preprocess" in out and "generated torch reference" in out


@pytest.mark.parametrize("name", NAMES)
def test_example_uses_its_mask_module(name):
    """The example is the library mask: its SPEC is built by compilemask/masks/<name>.py."""
    mod = load(name)
    assert masks.recipes_for(mod.SPEC).module == f"compilemask.masks.{name}"
    assert getattr(mod, name) is getattr(importlib.import_module(f"compilemask.masks.{name}"), name)


def test_hstu_example_mirrors_the_library_mask():
    """Written out inline as a user would; compiles to the same rules as masks.hstu()."""
    mask = cm.compile_mask(load("hstu").SPEC)
    assert mask.key == cm.compile_mask(masks.hstu()).key
    assert mask.num_intervals == 2 and [r.num_intervals for r in mask.regions] == [1, 1, 2]


def test_clear_explains_k(capsys, tmp_path):
    mod = load("clear")
    mod.main(seqlen=120, batch=1, out_dir=str(tmp_path), show_code=False)
    out = capsys.readouterr().out
    R = mod.RADIUS
    assert cm.compile_mask(mod.SPEC).num_intervals == 2 * R + 2
    assert f"K = {2 * R + 2} = 2R + 2 with R = {R}" in out
    assert f"2R + 1 = {2 * R + 1} values" in out
    assert "quotient ranges enumerated" in out and f"-> {2 * R + 1} intervals" in out


def test_dilated_causal_is_the_fallback_one(capsys, tmp_path):
    mod = load("dilated_causal")
    desc = mod.main(seqlen=100, batch=1, out_dir=str(tmp_path), show_code=True)
    out = capsys.readouterr().out
    assert desc.has_fallback and "FALLBACK" in out and "fallback regions: all" in out
    assert "without a bounded quotient range" in out  # the reason
    # the generated CuTe predicate of the fallback region is shown
    assert "generated CuTe fallback predicate (region 0 'all'" in out
    assert "@cute.jit" in out and "def fallback_predicate(q_idx, kv_idx" in out


def test_examples_show_from_the_command_line(tmp_path, capsys):
    from compilemask.cli import run

    assert run("show", [os.path.join(ROOT, "examples", "clear.py"), "--seqlen", "200",
                        "--meta", "text_end=40,img_rows=12", "--tiles", "32x32",
                        "--out", str(tmp_path / "c.png")]) == 0
    assert "clear_r1_w8: seqlen_q=200" in capsys.readouterr().out

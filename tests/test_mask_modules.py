"""The mask modules (compilemask/masks/<name>.py): each factory finds its recipes, each
FlexAttention mask_mod is the compiled mask on the random (degenerate) metadata, each main()
shows the mask."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

import compilemask as cm
from compilemask import masks

NAMES = sorted(masks.EXAMPLES)


def module(name):
    return importlib.import_module(f"compilemask.masks.{name}")


@pytest.mark.parametrize("name", NAMES)
def test_factory_registers_its_module(name):
    spec = masks.EXAMPLES[name]()
    assert masks.recipes_for(spec).module == f"compilemask.masks.{name}"
    assert getattr(masks, name) is getattr(module(name), name)  # the factory, not the module


def test_unknown_spec_has_no_recipe():
    spec = cm.MaskSpec("not_a_library_mask", params=[], regions=[
        cm.Region("all", when=lambda i: True, visible=lambda i, j: j <= i)])
    with pytest.raises(KeyError, match="no random metadata recipe"):
        masks.random_meta(spec, 1, 8)


@pytest.mark.parametrize("name", NAMES)
def test_flex_mask_mod_equals_compiled_mask(name):
    from torch.nn.attention.flex_attention import create_mask

    spec = masks.EXAMPLES[name]()
    mask = cm.compile_mask(spec)
    gen = torch.Generator().manual_seed(3)
    for S in (1, 37, 96):
        B = 3
        meta = masks.random_meta(spec, B, S, gen)
        ours = mask.preprocess(meta, seqlen_q=S, batch_size=B).dense_mask()
        flex = create_mask(masks.flex_mask_mod(spec, meta, S), B, None, S, S, device="cpu")
        assert torch.equal(ours, flex[:, 0]), (name, S, meta)


@pytest.mark.parametrize("name", ["hstu", pytest.param("clear", marks=pytest.mark.slow)])
def test_module_main_runs(name):
    out = subprocess.run([sys.executable, "-m", f"compilemask.masks.{name}"], check=True,
                         capture_output=True, text=True)
    assert f"MaskSpec {masks.EXAMPLES[name]().name!r}" in out.stdout
    assert "of 16 tiles" in out.stdout  # the descriptor's tiles are printed
    assert "RuntimeWarning" not in out.stderr

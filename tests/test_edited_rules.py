"""A rule file edited after import: the compiler reads the rules' text, Python runs the code
compiled at import; where they differ (even only in operand order) the compile is refused,
never done from the new text."""

import importlib
import os
import sys

import pytest
import torch

import compilemask as cm

_RULES = """
import compilemask as cm
before = cm.MaskSpec("before", params=["w"], regions=[
    cm.Region("all", when=lambda i: i >= 0, visible=lambda i, j: {rule})])
after = cm.MaskSpec("after", params=["w"], regions=[
    cm.Region("all", when=lambda i: i >= 0, visible=lambda i, j: {rule})])


def helper(i, j):
    return {rule}


by_def = cm.MaskSpec("by_def", params=["w"], regions=[
    cm.Region("all", when=lambda i: i >= 0, visible=helper)])
"""

# (rule at import, the same rule edited: operands exchanged, nothing else)
_EDITS = [("(j <= i) & (j > i - w)", "(i <= j) & (j > i - w)"),
          ("(j <= i) & (j > i - w)", "(j <= i) & (j > w - i)"),
          ("(j <= i) & (i - j < w)", "(j <= i) & (j - i < w)")]


def _exact(mask, meta):
    desc = mask.preprocess(meta, seqlen_q=24)
    assert torch.equal(desc.dense_mask(), mask.reference_mask(meta, seqlen_q=24))


def _import(tmp_path, monkeypatch, name, rule):
    path = tmp_path / f"{name}.py"
    path.write_text(_RULES.format(rule=rule))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return path, importlib.import_module(name)


@pytest.mark.parametrize("k", range(len(_EDITS)))
def test_operands_exchanged_after_import_are_refused(tmp_path, monkeypatch, k):
    old, new = _EDITS[k]
    name = f"edited_operands_{k}"
    path, mod = _import(tmp_path, monkeypatch, name, old)
    _exact(cm.compile_mask(mod.before), {"w": 5})
    path.write_text(_RULES.format(rule=new))
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 5))
    # never compiled before: its text is read now, and it is not what the function computes
    for spec, fn in ((mod.after, "'<lambda>'"), (mod.by_def, "'helper'")):
        with pytest.raises(ValueError, match="does not match the function's code") as err:
            cm.compile_mask(spec)
        assert f"Region 'all', visible function {fn}" in str(err.value), err.value
        assert "reload" in str(err.value), err.value
    # reloaded, the text and the code agree again
    mod = importlib.reload(mod)
    _exact(cm.compile_mask(mod.after), {"w": 5})
    _exact(cm.compile_mask(mod.by_def), {"w": 5})


def test_an_unedited_file_compiles(tmp_path, monkeypatch):
    # closures, helpers and globals read by the rules: the text matches the code that runs
    _, mod = _import(tmp_path, monkeypatch, "unedited_rules", "(j <= i) & (j > i - w)")
    for spec in (mod.before, mod.after, mod.by_def):
        _exact(cm.compile_mask(spec), {"w": 3})

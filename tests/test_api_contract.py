"""The public contract: README example, demo command, compile cache keyed by canonical rules."""

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import compilemask as cm
from compilemask import masks

ROOT = Path(__file__).resolve().parents[1]


def test_readme_usage_example_runs(tmp_path, capsys):
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    path = tmp_path / "readme_example.py"
    path.write_text(code)
    runpy.run_path(str(path), run_name="__main__")  # asserts dense == reference inside
    assert "K = 2" in capsys.readouterr().out


def test_demo_command():
    res = subprocess.run([sys.executable, "-m", "compilemask", "demo"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "descriptor mask == brute-force mask of the Python rules: True" in res.stdout
    err = float(re.search(r"max abs error ([0-9.e+-]+)", res.stdout).group(1))
    assert err < 2e-2


def test_compile_cache_is_semantic():
    a, b = cm.compile_mask(masks.hstu()), cm.compile_mask(masks.hstu())
    assert a.key == b.key and a._ir is b._ir  # same rules: compiled once
    c = cm.compile_mask(masks.sliding_window(7))
    d = cm.compile_mask(masks.sliding_window(8))  # a different constant: a different mask
    assert c.key != d.key
    assert a.key != c.key


def test_public_surface():
    assert set(cm.__all__) >= {"MaskSpec", "Region", "compile_mask", "attention", "visualize"}
    mask = cm.compile_mask(masks.causal())
    desc = mask.preprocess(None, seqlen_q=5, batch_size=3)
    assert desc.batch_size == 3 and desc.intervals.shape == (3, 5, 1, 2)
    assert torch.equal(desc.dense_mask()[0], torch.ones(5, 5, dtype=torch.bool).tril())


def test_array_params_are_part_of_the_cache_key():
    # arr[i] * 0 simplifies away: the rules are equal, the metadata interface is not
    plain = cm.MaskSpec("p", params=["arr"], regions=[
        cm.Region("r", when=lambda i: True, visible=lambda i, j: j < i),
    ])
    arr_spec = cm.MaskSpec("q", params=["arr"], regions=[
        cm.Region("r", when=lambda i: True,
                  visible=lambda i, j: j < i + arr[i] * 0),  # noqa: F821
    ])
    a, b = cm.compile_mask(plain), cm.compile_mask(arr_spec)
    assert a.array_params == () and b.array_params == ("arr",)
    assert a.key != b.key


def test_transformers_integration_imports_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    from compilemask.integrations.transformers import register

    with pytest.raises(ImportError, match=r"\[hf\]"):
        register()

"""Every generated source (TileLang preprocess, column table and tile-list programs, FA4
mask_mods, CuTe predicates and score_mods, the torch reference) of every example mask is the
text recorded in tests/data/generated_sources.json (its sha256): a refactoring that changes one
fails here, naming the mask and the source.

A change meant to change generated code regenerates the table in the same commit:
``python -m tests.regen_generated_sources``; ``python tools/compare_generated_sources.py OLD``
shows the diffs against an older checkout."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import regen_generated_sources as gen

REGEN = "python -m tests.regen_generated_sources"


def _what(name: str) -> str:
    owner, _, kind = name.partition("/")
    if owner == "lists":
        return f"tile-list program {kind!r}"
    if owner == "score_mod":
        sm, _, form = kind.partition("/")
        return f"score_mod {sm!r}, source {form or 'conversion'!r}"
    return f"mask {owner!r}, source {kind!r}"


def _check(got: dict, flex: bool) -> None:
    table = json.loads(gen.TABLE.read_text())
    want = {k: v for k, v in table.items() if gen.is_flex(k) == flex}
    assert want, f"{gen.TABLE} holds no entries of this part: run `{REGEN}`"
    problems = []
    for name in sorted(set(want) | set(got)):
        if name not in got:
            problems.append(f"{_what(name)}: in the table, no longer generated")
        elif name not in want:
            problems.append(f"{_what(name)}: generated, not in the table")
        elif gen.digest(got[name]) != want[name]:
            problems.append(f"{_what(name)}: generated text changed (sha256 "
                            f"{gen.digest(got[name])[:12]}, table {want[name][:12]})")
    assert not problems, (
        f"{len(problems)} generated sources differ from {gen.TABLE.name}:\n  "
        + "\n  ".join(problems)
        + f"\nIf the change is intended, run `{REGEN}` from the checkout's root and commit the "
        "table with it; `python tools/compare_generated_sources.py <older checkout>` shows "
        "the diffs.")


def _fresh(part: str) -> dict:
    """``gen.<part>()`` in a fresh process: the text must not depend on what ran before it
    (sympy's caches hand out an earlier equal constant, printed at its own precision)."""
    here = pathlib.Path(__file__).resolve().parent
    code = f"import json, regen_generated_sources as g; print(json.dumps(g.{part}()))"
    res = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONHASHSEED="0"), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def examples():
    return _fresh("example_sources")


def test_example_masks_generate_the_recorded_sources(examples):
    assert len(examples) > 300  # every mask x kind, the lists and the score_mods
    _check(examples, flex=False)


@pytest.mark.slow
def test_flex_mask_mods_generate_the_recorded_sources():
    _check(_fresh("flex_sources"), flex=True)


def test_a_changed_source_names_the_mask_and_kind(examples):
    edited = dict(examples)
    edited["causal/preprocess/cuda"] += "\n# edited\n"
    del edited["score_mod/alibi/o2_g1_b0"]
    with pytest.raises(AssertionError) as e:
        _check(edited, flex=False)
    msg = str(e.value)
    assert "mask 'causal', source 'preprocess/cuda': generated text changed" in msg
    assert "score_mod 'alibi', source 'o2_g1_b0': in the table, no longer generated" in msg
    assert "2 generated sources differ" in msg and REGEN in msg

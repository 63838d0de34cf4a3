"""Memory of long jobs, measured in a fresh process (ru_maxrss: torch's allocations included):
a loop over new lengths and a fixed set of masks stays flat once its caches are warm, a loop of
ever new masks stays within the caches' bounds, and the CPU preprocess's peak grows with the
descriptor, not with Sq x n_tiles. The bounds and the measured growth are in docs/operations.md."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

PRELUDE = '''
import gc, json, resource, sys
import torch
import compilemask as cm
from compilemask.dsl import flex
from compilemask.dsl import MaskSpec, Region


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def spec(w):
    return MaskSpec(f"window_{w}", params=[], regions=[
        Region("all", when=lambda i: True, visible=lambda i, j: i - w < j <= i)])


def prefix_mod(p):
    def prefix(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < p)
    return prefix


def step(S, w, check=False):
    """One training step's mask work: a window compiled (cached after its first time) and
    preprocessed at length S, a mask_mod capturing an int converted and compiled."""
    m = cm.compile_mask(spec(w))
    desc = m.preprocess(None, S)
    fspec, meta = cm.from_mask_mod(prefix_mod(w % 50))
    cm.compile_mask(fspec)
    if check:  # the cached masks still equal their rules
        i = torch.arange(S)
        ref = (i[None, :] <= i[:, None]) & (i[:, None] - w < i[None, :])
        assert torch.equal(m.dense_mask(desc)[0], ref), (S, w)


def length(n):
    return 64 + (n * 7) % 1500  # a new length each step, up to 1563
'''


def _run(body: str, tmp_path, timeout: int) -> dict:
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = dict(os.environ, COMPILEMASK_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _flat_loop(tmp_path, steps: int, masks: int, timeout: int) -> dict:
    """``steps`` steps over ``masks`` distinct windows (and captured ints), a new length each
    step; RSS peak growth after a warm-up of each mask at the longest and a short length."""
    return _run(f'''
        steps, masks = {steps}, {masks}
        for w in range(2, 2 + masks):
            step(1563, w, check=w < 5)
            step(64 + w, w)
        gc.collect()
        before = peak_mb()
        for n in range(steps):
            step(length(n), 2 + n % masks, check=n % 97 == 0)
        gc.collect()
        print(json.dumps({{"growth_mb": peak_mb() - before, "peak_mb": peak_mb()}}))
    ''', tmp_path, timeout)


# after the warm-up, nothing per step is kept: the growth is the allocator's noise over new
# lengths (measured: under 1 MB)
FLAT_MB = 8


def test_new_lengths_and_a_set_of_masks_stay_flat(tmp_path):
    got = _flat_loop(tmp_path, steps=200, masks=10, timeout=600)
    print(got)
    assert got["growth_mb"] < FLAT_MB, got


@pytest.mark.slow
def test_5000_steps_new_lengths_500_masks_stay_flat(tmp_path):
    got = _flat_loop(tmp_path, steps=5000, masks=500, timeout=900)
    print(got)
    assert got["growth_mb"] < FLAT_MB, got


def _new_mask_loop(tmp_path, steps: int, full: int, timeout: int) -> dict:
    """A new window every step: RSS peak growth over all of them, and over the steps after
    the first ``full`` (every cache then at its bound)."""
    return _run(f'''
        step(1563, 1)
        gc.collect()
        before = peak_mb()
        for n in range({steps}):
            step(length(n), 2 + n, check=n % 97 == 0)
            if n == {full}:
                gc.collect()
                full = peak_mb()
        gc.collect()
        print(json.dumps({{"growth_mb": peak_mb() - before, "peak_mb": peak_mb(),
                          "after_full_mb": peak_mb() - full}}))
    ''', tmp_path, timeout)


# every cache a new mask reaches is bounded (contract.lru): what they hold at their bounds,
# ~1024 compiled forms of ~35 KB and the smaller tables, stays under this (measured: 51 MB over
# 1,500 new masks); past the bounds a new mask adds nothing
NEW_MASKS_MB = 96


@pytest.mark.stress
def test_steps_with_a_new_mask_every_step_stay_bounded(tmp_path):
    # 5,000 new masks (a compile and a z3 proof each, ~0.2 s): every cache fills by step 1,100;
    # the native heap (z3's contexts, the allocator's arenas) settles by ~2,100 (+11 MB there,
    # no Python object added), then 2,500 more steps add nothing
    got = _new_mask_loop(tmp_path, steps=5000, full=2500, timeout=3600)
    print(got)
    assert got["growth_mb"] < NEW_MASKS_MB and got["after_full_mb"] < FLAT_MB, got


def test_a_new_captured_int_every_step_leaks_no_conversion(tmp_path):
    # the default run's variant: conversions alone (no compile), past the cache's bound
    got = _run('''
        from compilemask.contract import cache
        flex._CACHE.maxsize = 16
        cache.MASKS.keep = 16  # the registry's strong LRU: each conversion compiles a mask
        for n in range(600):  # the allocator's own growth settles within ~600 conversions
            cm.from_mask_mod(prefix_mod(n))
        gc.collect()
        before = peak_mb()
        for n in range(600, 1100):
            cm.from_mask_mod(prefix_mod(n))
        gc.collect()
        print(json.dumps({"growth_mb": peak_mb() - before, "cached": len(flex._CACHE)}))
    ''', tmp_path, timeout=600)
    print(got)
    assert got["cached"] == 16 and got["growth_mb"] < 2, got


def _preprocess_peak(tmp_path, seqlen: int) -> dict:
    return _run(f'''
        from compilemask import masks
        m = cm.compile_mask(masks.causal())
        m.preprocess(None, 1024)
        gc.collect()
        before = peak_mb()
        desc = m.preprocess(None, {seqlen})
        print(json.dumps({{"delta_mb": peak_mb() - before, "peak_mb": peak_mb()}}))
    ''', tmp_path, timeout=900)


def test_cpu_preprocess_peak_grows_with_the_descriptor(tmp_path):
    # 64K tokens: 512 x 512 tiles; Sq x n_tiles booleans alone would be 32 MB per temporary
    # (measured before chunking: +132 MB; chunked: +19 MB)
    got = _preprocess_peak(tmp_path, 1 << 16)
    print(got)
    assert got["delta_mb"] < 64, got


@pytest.mark.slow
def test_cpu_preprocess_at_256k_tokens_stays_under_1_5_gb(tmp_path):
    # measured before chunking: +2060 MB; chunked: +154 MB
    got = _preprocess_peak(tmp_path, 1 << 18)
    print(got)
    assert got["delta_mb"] < 512 and got["peak_mb"] < 1536, got


def test_a_length_past_int32_indexing_or_memory_is_refused(monkeypatch):
    import compilemask as cm
    from compilemask import masks
    from compilemask.compiler import sizes

    m = cm.compile_mask(masks.causal())
    with pytest.raises(ValueError, match=r"batch_size=4096: the descriptor's intervals .* past "
                       r"the int32 indexing"):
        m.preprocess(None, 1 << 20, batch_size=4096)
    need = sizes.cpu_preprocess_bytes(m, 2, 1 << 20, 1 << 20, *_tilings())
    monkeypatch.setattr(sizes, "_memory_bytes", lambda: need - 1)
    with pytest.raises(MemoryError, match=r"seqlen_q=1048576, seqlen_k=1048576, batch_size=2: "
                       r"the CPU preprocess needs about .* GiB"):
        m.preprocess(None, 1 << 20, batch_size=2)
    monkeypatch.setattr(sizes, "_memory_bytes", lambda: need)
    sizes.check_descriptor_fits(m, 2, 1 << 20, 1 << 20, *_tilings(), "cpu")  # fits: no error


def _tilings():
    from compilemask.contract.descriptor import DEFAULT_BWD_TILES, DEFAULT_FWD_TILES
    return DEFAULT_FWD_TILES, DEFAULT_BWD_TILES


def test_bound_preprocessor_keeps_a_bounded_table_of_lengths():
    import compilemask as cm
    from compilemask import masks
    from compilemask.pipeline import pipeline

    m = cm.compile_mask(masks.prefix_lm())  # has params: nothing compiles until a call
    pre = pipeline.Preprocessor(m, 64, 64, 2, "cpu")
    for S in range(65, 65 + 3 * pre._shapes.maxsize):
        pre._shapes_for(S, S)
    assert len(pre._shapes) == pre._shapes.maxsize == 64


def test_bitmaps_in_chunks_equal_one_piece(monkeypatch):
    import torch

    from compilemask.compiler import tiles
    from compilemask.contract.descriptor import TileConfig

    gen = torch.Generator().manual_seed(0)
    B, Sq, Sk, K = 3, 1000, 700, 3
    starts = torch.randint(0, Sk, (B, Sq, K), generator=gen)
    lens = torch.minimum(torch.randint(0, 300, (B, Sq, K), generator=gen), Sk - starts)
    always = torch.rand(B, Sq, K, generator=gen) < 0.2
    for fwd, bwd in ((TileConfig(128, 128), TileConfig(64, 128)),
                     (TileConfig(64, 64), TileConfig(128, 32))):
        whole = tiles.bitmaps(starts, lens, always, fwd, bwd, Sq, Sk)
        monkeypatch.setattr(tiles, "_STATE_CHUNK", 1)  # one row tile of one sequence a chunk
        pieces = tiles.bitmaps(starts, lens, always, fwd, bwd, Sq, Sk)
        monkeypatch.undo()
        for a, b in zip(whole, pieces):
            assert torch.equal(a, b)
        # and the states are those of each tile's rows, computed directly
        f = tiles.unpack_bitmap(whole[0], -(-Sk // fwd.tile_n))
        assert torch.equal(f, tiles.tile_states(starts, lens, always, fwd, Sq, Sk))


def test_a_captured_0d_tensor_is_one_compiled_mask_for_every_value():
    import torch

    import compilemask as cm

    def make(p):
        def prefix(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) | (kv_idx < p)
        return prefix

    keys = set()
    for v in (3, 9, 17, 40):
        spec, meta = cm.from_mask_mod(make(torch.tensor(v)))
        m = cm.compile_mask(spec)
        keys.add(m.key)
        i = torch.arange(40)
        ref = (i[None, :] <= i[:, None]) | (i[None, :] < v)
        assert torch.equal(m.dense_mask(m.preprocess(meta, 40))[0], ref)
    assert len(keys) == 1


def test_a_mask_mod_converted_for_many_ints_says_how_to_make_one_mask(caplog):
    from compilemask.contract.log import said
    from compilemask.dsl import flex

    def make(p):
        def prefix_for_hint(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) | (kv_idx < p)
        return prefix_for_hint

    def per_head_for_hint(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (h < 2)

    said.clear()
    with caplog.at_level("WARNING", logger="compilemask"):
        flex.from_mask_mod_heads(per_head_for_hint, num_heads=2 * flex._VARIANTS_SAID)
        for v in range(flex._VARIANTS_SAID + 2):
            flex.from_mask_mod(make(1000 + v))
    hints = [r for r in caplog.records if "_for_hint" in r.getMessage()]
    assert len(hints) == 1 and "0-d tensor" in hints[0].getMessage()
    assert "prefix_for_hint" in hints[0].getMessage()  # one conversion per head is no variant

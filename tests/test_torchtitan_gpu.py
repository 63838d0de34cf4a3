"""TorchTitan training steps on the GPU: CompileMask against TorchTitan's FlexAttention, from the
same initial weights and data, for every mask a TorchTitan user can name.

With TorchTitan 0.3.0 the steps run through the one training command (``torchrun -m
torchtitan.train --module compilemask.integrations.torchtitan --config ... --mask NAME``: the
trainer, its per-batch descriptor, the packaged data); with TorchTitan 0.2.x, whose trainer
this package does not drive, through the benchmark's loop (TorchTitan's Qwen3, FSDP over one
rank, selective activation checkpointing, ``torch.compile`` per block). Each run is its own
process (one process group, one compile cache per run)."""

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
# bf16 steps of the same model from the same weights: the losses agree to this (relative)
LOSS_TOL = 1e-2
STEPS = 4

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _legacy() -> bool:
    from compilemask.integrations.torchtitan import _compat

    return _compat.legacy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    return env


def _agree(a, b):
    return len(a) == len(b) and all(abs(x - y) <= LOSS_TOL * abs(y) for x, y in zip(a, b))


# ---- TorchTitan 0.3.0: the training command ---------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LOSS = re.compile(r"step:\s*(\d+).*?loss:\s*([-+0-9.einf]+)")


def _train(config, mask, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "--master_port", str(_free_port()), "-m", "torchtitan.train",
           "--module", "compilemask.integrations.torchtitan", "--config", config,
           "--mask", mask, "--training.steps", str(STEPS), "--training.seq_len", "2048",
           "--metrics.log_freq", "1", "--debug.seed", "0", "--dump_folder", str(tmp_path)]
    if mask == "clear":
        cmd += ["--mask_options", "radius", "1", "width", "64"]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=900)
    log = ANSI.sub("", out.stdout + out.stderr)
    assert out.returncode == 0, log[-4000:]
    losses = {int(s): float(v) for s, v in LOSS.findall(log)}
    assert sorted(losses) == list(range(1, STEPS + 1)), log[-4000:]
    return [losses[s] for s in sorted(losses)]


@pytest.mark.parametrize("mask", ["hstu", "block_causal", "shared_prompt_rm", "clear",
                                  "prefix_lm", "causal"])
def test_gpu_training_command_trains_each_mask(mask, tmp_path):
    if _legacy():
        pytest.skip("TorchTitan 0.2.x: its trainer is not driven by this package (the loop "
                    "below runs instead)")
    ours = _train("compilemask_qwen3_debug", mask, tmp_path / "cm")
    flex = _train("flex_qwen3_debug", mask, tmp_path / "flex")
    assert all(math.isfinite(x) for x in ours)
    assert _agree(ours, flex), (ours, flex)


# ---- TorchTitan 0.2.x: the benchmark's loop ---------------------------------------------------

@pytest.mark.parametrize("mask", ["hstu", "packed_hstu", "documents", "shared_prompt_rm",
                                  "clear", "causal"])
def test_gpu_torchtitan_loop_trains_each_mask(mask, tmp_path):
    """A few steps of TorchTitan's debug Qwen3 (2 layers, 2K tokens) with CompileMask and with
    TorchTitan's Flex (Triton): finite losses that agree step by step."""
    cmd = [sys.executable, str(ROOT / "bench" / "torchtitan_e2e.py"), "--masks", mask,
           "--methods", "compilemask,flex_triton", "--seqlens", "2048", "--flavor",
           "debugmodel", "--layers", "2", "--vocab", "2048", "--steps", str(STEPS),
           "--warmup", "0", "--out", str(tmp_path)]
    out = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    rows = {r["method"]: r for r in json.loads((tmp_path / "torchtitan_e2e.json").read_text())
            ["rows"]}
    assert rows["compilemask"]["status"] == "ok", rows["compilemask"]["status"]
    assert rows["flex_triton"]["status"] == "ok", rows["flex_triton"]["status"]
    ours, flex = rows["compilemask"]["losses"], rows["flex_triton"]["losses"]
    assert len(ours) == STEPS and all(math.isfinite(x) for x in ours)
    assert _agree(ours, flex), (ours, flex)
    # the step ran the optimizer: the loss moved
    assert ours[-1] != ours[0]

import hashlib
import os
import sys
import tempfile
from pathlib import Path

# Before compilemask is imported: the tests' cached programs (ours, TileLang's, flash-attn-4's)
# go to a temporary folder, never to the user's ~/.cache. COMPILEMASK_TEST_CACHE_DIR names a
# folder of your choice instead (e.g. on a GPU machine, where builds take minutes).
_TEST_CACHE = os.environ.get("COMPILEMASK_TEST_CACHE_DIR")
if not _TEST_CACHE:
    # one folder per user and checkout in the system's temporary folder, shared by the xdist
    # workers and by later runs (the slow pass after the default one): programs compile once;
    # every cached artefact is verified before it runs
    _checkout = hashlib.sha256(str(Path(__file__).resolve().parents[1]).encode()).hexdigest()
    _TEST_CACHE = os.path.join(tempfile.gettempdir(),
                               f"compilemask-tests-{os.getuid()}-{_checkout[:12]}")
    os.makedirs(_TEST_CACHE, mode=0o700, exist_ok=True)
os.environ["COMPILEMASK_CACHE_DIR"] = _TEST_CACHE
os.environ["TILELANG_CACHE_DIR"] = os.path.join(_TEST_CACHE, "tilelang-builds")
os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = os.path.join(_TEST_CACHE, "fa4")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # CPU: CuTe kernels (ours and FA4's) compile for the H200's sm_90a; the DSL reads the target
    # when it is first imported, so it is set before any test module imports it
    for _k, _v in (("CUTE_DSL_ARCH", "sm_90a"), ("FLASH_ATTENTION_ARCH", "sm_90a"),
                   ("FLASH_ATTENTION_NUM_SMS", "132")):
        os.environ.setdefault(_k, _v)


# ``python -m pytest`` puts the checkout's root first on sys.path, where its folder kernels/
# would hide the PyPI package ``kernels`` that transformers imports: the root is searched after
# the installed packages (tests that import bench/ find it there)
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT] + [str(_ROOT)]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

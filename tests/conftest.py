import os

import pytest
import torch

if not torch.cuda.is_available():
    # CPU: CuTe kernels (ours and FA4's) compile for the H200's sm_90a; the DSL reads the target
    # when it is first imported, so it is set before any test module imports it
    for _k, _v in (("CUTE_DSL_ARCH", "sm_90a"), ("FLASH_ATTENTION_ARCH", "sm_90a"),
                   ("FLASH_ATTENTION_NUM_SMS", "132")):
        os.environ.setdefault(_k, _v)


# transformers imports the PyPI package ``kernels``, which this checkout's folder kernels/ hides
# from ``python -m pytest`` run at its root
import compilemask.integrations  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

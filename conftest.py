"""Test configuration for tests/ and the doctests: 8 forced host devices.

This file sits at the repository root so that pytest loads it before it imports
any module that imports jax.
"""

import os

# Multi-device tests run on 8 CPU devices; XLA reads this flag once, when the
# backend starts, so it must be set before anything imports jax.
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

"""Settings of the whole test session."""

import os

# Triton kernels run in triton's interpreter (numpy on the host): the tests check them on CPU tensors.
# Triton reads this when a kernel module is imported, so it is set before any test imports one.
os.environ.setdefault("TRITON_INTERPRET", "1")

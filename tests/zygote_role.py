"""A role for tests/test_zygote.py: reports what a forked child sees, then exits with a status.

``python -m tests.zygote_role STATUS [THREADS]``: prints one JSON line (cwd, argv, sys.path[0],
stdin, the environment's ZYGOTE_TEST_* variables, its command line, whether it inherited
torch._dynamo) and, with THREADS, torch's
thread count after ``set_num_threads`` and products on torch's and numba's parallel kernels
(which a fork after their thread pools started would hang or kill); ``sleep`` as STATUS sleeps
until signalled."""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    report = {"cwd": os.getcwd(), "argv": sys.argv, "path0": sys.path[0], "stdin": sys.stdin.read(),
              "env": {k: v for k, v in os.environ.items() if k.startswith("ZYGOTE_TEST_")},
              "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\0").decode().split("\0"),
              "dynamo": "torch._dynamo" in sys.modules}  # inherited from the zygote (ROLE_PRELOAD)
    if len(sys.argv) > 2:
        import numpy as np
        import torch

        from dorylus.models import kernels

        torch.set_num_threads(int(sys.argv[2]))
        report["threads"] = torch.get_num_threads()
        rng = np.random.default_rng(0)
        a = rng.standard_normal((512, 512)).astype(np.float32)
        report["matmul_error"] = float(np.abs((torch.from_numpy(a) @ torch.from_numpy(a)).numpy()
                                              - a.astype(np.float64) @ a.astype(np.float64)).max())
        n = 2000
        indptr = np.arange(0, 5 * n + 1, 5, dtype=np.int64)
        indices = rng.integers(0, n, 5 * n).astype(np.int32)
        x = rng.standard_normal((n, 16)).astype(np.float32)
        os.environ["DORYLUS_GATHER_KERNEL"] = "numba"
        out = kernels.gather(indptr, indices, x)
        want = x[indices].astype(np.float64).reshape(n, 5, 16).sum(axis=1)
        report["gather_error"] = float(np.abs(out - want).max())
    print(json.dumps(report), flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(600)
    return int(sys.argv[1])


if __name__ == "__main__":
    sys.exit(main())

import subprocess
import sys

import pytest

from lambdas.handler import compute_task


def test_function_bundle_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import lambdas.handler; "
            "loaded = {m for m, mod in sys.modules.items() if mod is not None}; "
            "assert not {m for m in loaded if m.startswith(('torch', 'dorylus.models', 'graphserver'))}, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_unknown_task_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown task 'AE'"):
        compute_task({"task": "AE", "seed": 0, "epoch": 1, "layer": 0}, {}, None)

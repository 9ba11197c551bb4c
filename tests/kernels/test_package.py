"""The `kernels` package imports without Triton and says clearly when a Triton entry point cannot run."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kernels

REPO = Path(kernels.__file__).resolve().parent.parent


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"})


def test_import_does_not_load_triton():
    result = run_python("""
        import sys
        import kernels
        assert "triton" not in sys.modules, "import kernels loaded triton"
        print(kernels.triton_available())
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_missing_triton_is_a_clear_error():
    result = run_python("""
        import sys
        sys.modules["triton"] = None  # as if not installed
        import torch, kernels
        try:
            cache, lens = torch.zeros(1, 16, 2, 64), torch.ones(1, dtype=torch.int32)
            kernels.decode_attention(torch.zeros(1, 2, 64), cache, cache, lens[None], lens, 1.0)
        except ModuleNotFoundError as e:
            print(e)
    """)
    assert result.returncode == 0, result.stderr
    assert "needs Triton" in result.stdout and "decode_attention_ref" in result.stdout

"""Running a tutorial script in its smoke mode, for the tutorial tests.

The tutorials read ``OPACUS_RC_SMOKE=1`` (a run sized for a test) and ``OPACUS_RC_OUTPUTS``
(where their JSON results go); the model hub is switched off (everything they load ships in a
package) and matplotlib draws without a display.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_smoke(
    script: Path,
    *,
    outputs: Path,
    cwd: Path | None = None,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in smoke mode with this interpreter; fail the test if it fails.

    Args:
        script: The tutorial's ``.py`` file.
        outputs: Folder for its results (``OPACUS_RC_OUTPUTS``); also the working directory
            unless ``cwd`` is given.
        cwd: Working directory of the run.
        timeout: Seconds before the run is killed.
        env: Further environment variables.

    Returns:
        The finished process (its ``stdout`` and ``stderr`` as text).
    """
    full_env = {
        **os.environ,
        "OPACUS_RC_SMOKE": "1",
        "OPACUS_RC_OUTPUTS": str(outputs),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MPLBACKEND": "Agg",
        **(env or {}),
    }
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=outputs if cwd is None else cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + "\n" + proc.stderr[-5000:]
    return proc

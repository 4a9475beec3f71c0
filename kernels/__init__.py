"""kvlab.kernels: the lab's Triton kernels (notebook 05).

This folder sits at the top of the repository and ships as ``kvlab.kernels`` (see pyproject's
``package-dir``), because a bare ``import kernels`` would shadow Hugging Face's ``kernels``
package, which transformers probes for. The kernels arrive with notebook 05; what lives here now
is the one question every kernel launch asks first: compiled on a GPU, or interpreted on the CPU?
"""

from __future__ import annotations

import os


def triton_mode() -> str:
    """``"interpreter"`` when kernels run on the CPU through Triton's interpreter, else ``"compiled"``.

    ``import kvlab`` sets ``TRITON_INTERPRET=1`` on machines without a GPU before triton loads.
    """
    return "interpreter" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "compiled"


def triton_version() -> str | None:
    """Installed triton version, or None where triton is not installed (e.g. macOS)."""
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None

"""kvlab: build an LLM inference engine's KV cache, one measured step at a time.

Importing kvlab switches Triton to its CPU interpreter when there is no GPU (this has to happen
before triton is first imported), so import kvlab first in a notebook.
"""

from kvlab.env import configure_triton as _configure_triton

_configure_triton()

from kvlab.env import setup  # noqa: E402
from kvlab.models import load_model, tiny_llama  # noqa: E402

__version__ = "0.1.0"
__all__ = ["setup", "load_model", "tiny_llama", "__version__"]

"""Where the lab runs: device choice, Triton mode, seeds, versions; every notebook's first cell calls
:func:`setup`. Triton reads ``TRITON_INTERPRET`` once, on its first import, so :func:`configure_triton`
runs at ``import kvlab`` time and switches the interpreter on whenever there is no GPU.
"""

from __future__ import annotations

import ctypes
import os
import platform
import random
import sys
import warnings
from dataclasses import dataclass
from importlib import metadata

import torch

from kvlab import kernels  # its __init__ imports no triton: configure_triton below still runs first


def configure_triton() -> bool:
    """Turn Triton's interpreter on without a CUDA device; return whether it is on. An explicit
    ``TRITON_INTERPRET`` wins, and a triton imported before us can only be reported."""
    if "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules:
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """Compute dtype: fp32 on the CPU (fp16 matmuls there are ~3.5x slower), fp16 on a GPU."""
    device = torch.device(device) if device is not None else default_device()
    return torch.float32 if device.type == "cpu" else torch.float16


def seed_everything(seed: int = 0) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def silence_known_warnings() -> None:
    """Hide warnings a learner cannot act on (they also make nbval output noisy)."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*TRITON_INTERPRET.*")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:  # transformers loads here, not at `import kvlab`: `kvlab --help` and a mistyped command never need it
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        pass


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def hosted() -> str:
    """``"colab"``, ``"kaggle"`` or ``""`` (a JupyterLab of its own), read from the variables each sets."""
    if "COLAB_RELEASE_TAG" in os.environ or "COLAB_GPU" in os.environ or "google.colab" in sys.modules:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in os.environ or "KAGGLE_URL_BASE" in os.environ:
        return "kaggle"
    return ""


WIDGET_MODES = ("figurewidget", "output")


def widget_mode() -> str:
    """How live figures render: ``"figurewidget"`` or ``"output"`` (``KVLAB_WIDGETS`` forces one); Colab and
    Kaggle get ``"output"``: their widget managers do not render FigureWidget reliably."""
    forced = os.environ.get("KVLAB_WIDGETS", "").strip().lower()
    if forced:
        if forced not in WIDGET_MODES:
            raise ValueError(f"KVLAB_WIDGETS must be one of {WIDGET_MODES} (or unset), got {forced!r}")
        return forced
    return "output" if hosted() else "figurewidget"


@dataclass(frozen=True)
class LabInfo:
    device: str
    device_name: str
    triton_interpret: bool
    python: str
    torch: str
    triton: str
    transformers: str
    kvlab: str
    threads: int
    triton_available: bool = True  # False on macOS / Windows: the kernel cells and tests are skipped
    platform: str = ""  # "colab", "kaggle" or "" (kvlab.env.hosted)
    widgets: str = "figurewidget"  # how live figures render (kvlab.env.widget_mode)

    def line(self) -> str:
        mode = "interpreter (CPU)" if self.triton_interpret else "compiled (GPU)"
        triton = (f"triton {self.triton} {mode}" if self.triton_available
                  else "no triton: kernel cells skipped (they run on Linux)")
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''} for torch"
        where = f" on {self.platform}" if self.platform else ""
        return (
            f"kvlab {self.kvlab}{where} | device {self.device} ({self.device_name}) | {triton} | "
            f"torch {self.torch} | transformers {self.transformers} | {threads} | widgets: {self.widgets}"
        )


def limit_memory(gb: float) -> None:
    """Cap the worker's (and its kernel's) data segment at ``gb`` GiB on Linux. RLIMIT_DATA, not RLIMIT_AS:
    a GPU's driver reserves address space it never fills."""
    if not sys.platform.startswith("linux"):
        return
    import resource  # Unix only: the memory limit applies on Linux
    cap = int(gb * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX-512: the engine-vs-vLLM ratio moves with both."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    simd = "AVX-512" if "avx512f" in flags else "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    return f"{name} ({simd}, {os.cpu_count()} logical CPUs)"


def lab_info() -> LabInfo:
    device = default_device()
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else (platform.processor() or platform.machine())
    return LabInfo(device=device.type, device_name=name,
                   triton_interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
                   python=platform.python_version(), torch=torch.__version__,
                   triton=_version("triton") if kernels.available() else "not available",
                   transformers=_version("transformers"), kvlab=_version("kvlab"), threads=torch.get_num_threads(),
                   triton_available=kernels.available(), platform=hosted(), widgets=widget_mode())


def _colab_widgets() -> None:
    """Colab renders third-party widgets only with its custom widget manager switched on."""
    try:
        from google.colab import output  # google.colab: only on Colab
    except ImportError:
        return
    output.enable_custom_widget_manager()


def _glibc_trim():
    """glibc's ``malloc_trim`` (Linux), else None: macOS's and musl's allocators give pages back themselves."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _trim_after_cell(*_args) -> None:
    trim = _glibc_trim()
    if trim is not None:
        trim(0)


def return_memory_after_cells(shell=None) -> bool:
    """After every cell, hand the heap's freed pages back to the OS (glibc keeps them otherwise: after
    one large cell a kernel stayed 0.8 GiB above what it holds, and the next cell started from there;
    measured in notebook 07). Returns whether it is on: only in IPython on glibc (Linux)."""
    if _glibc_trim() is None:
        return False
    if shell is None:
        try:
            from IPython import get_ipython  # IPython is there only in a notebook or an IPython shell
        except ImportError:
            return False
        shell = get_ipython()
    if shell is None or not hasattr(shell, "events"):
        return False
    if _trim_after_cell not in shell.events.callbacks.get("post_run_cell", []):
        shell.events.register("post_run_cell", _trim_after_cell)
    return True


def setup(seed: int = 0, quiet: bool = False) -> LabInfo:
    """The first call of every notebook: Triton mode, seeds, quiet warnings, widgets and one status line;
    without triton, cells marked ``# needs triton`` print why they are skipped; on Linux, freed memory
    goes back to the OS after every cell."""
    configure_triton()
    seed_everything(seed)
    silence_known_warnings()
    if hosted() == "colab":
        _colab_widgets()
    kernels.skip_cells_without_triton()
    return_memory_after_cells()
    info = lab_info()
    if not quiet:
        print(info.line())
    return info

"""What each notebook costs a laptop: Run All's wall time, its slowest cells, the kernel's peak memory.

    .venv/bin/python tools/notebook_costs.py                 # every notebook, one after another
    .venv/bin/python tools/notebook_costs.py 04 07 --json out.json

Each notebook runs headless in a fresh kernel (nbclient, as Run All does), alone: run nothing else
beside it, two torch processes on 2 cores slow each other many times over. Memory is the resident
set of the kernel's whole process tree (the kernel and every child it starts), sampled every 0.2 s,
and its private part: without the pages mapped from files (the model's weights, 0.5 GiB, are mapped
from its safetensors file, shared by every kernel and given back under pressure; see tree_memory).
``make test`` prints the same table from its nbval run (tests/conftest.py uses :class:`TreePeak`
and :func:`table`).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
GIB = 2 ** 30


def tree_memory(proc: psutil.Process) -> tuple[int, int]:
    """(resident, private) bytes of a process and all its descendants. Private leaves out pages mapped
    from files (Linux's RssFile + RssShmem, psutil's ``shared``): the model's safetensors are mapped,
    not copied, so its 0.5 GiB of weights are resident but shared by every kernel that loads it and given
    back to the file under pressure. Where psutil has no ``shared`` (macOS), private = resident."""
    rss = private = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for p in procs:
        try:
            m = p.memory_info()
        except psutil.Error:
            continue
        rss += m.rss
        private += m.rss - getattr(m, "shared", 0)
    return rss, private


class TreePeak:
    """Samples the memory of process ``pid`` and its descendants every ``interval`` seconds in a thread;
    ``peak`` is the largest resident sum seen since the last :meth:`reset`, ``private_peak`` the largest
    private sum (:func:`tree_memory`)."""

    def __init__(self, pid: int, interval: float = 0.2):
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.peak = self.private_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        rss, private = tree_memory(self.proc)
        self.peak = max(self.peak, rss)
        self.private_peak = max(self.private_peak, private)
        return rss

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> TreePeak:
        self._thread.start()
        return self

    def reset(self) -> int:
        """The resident peak so far (:attr:`last_private`: the private one), and start new ones from the
        current sample."""
        peak, private = self.peak, self.private_peak
        self.peak = self.private_peak = 0
        self.sample()
        self.last_private = max(private, self.private_peak)
        return max(peak, self.peak)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.sample()
        self.last_private = self.private_peak
        return self.peak


def run_notebook(path: Path, timeout: int = 1800, kernel: str = "python3") -> dict:
    """Run one notebook top to bottom in a fresh kernel; per cell its index (all cells counted, as
    JupyterLab numbers them) and seconds, and the whole run's wall time and peak memory."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    cells: list[tuple[int, float]] = []
    started: dict[int, float] = {}
    sampler: list[TreePeak] = []
    peaks: list[tuple[int, int, int]] = []  # (peak bytes, cell index, private peak bytes) per cell

    def on_start(cell, cell_index):
        if not sampler and client.km is not None and client.km.has_kernel:
            sampler.append(TreePeak(client.km.provisioner.process.pid).start())
        started[cell_index] = time.perf_counter()

    def on_done(cell, cell_index, execute_reply):
        cells.append((cell_index, time.perf_counter() - started[cell_index]))
        if sampler:
            peaks.append((sampler[0].reset(), cell_index, sampler[0].last_private))  # this cell's peaks

    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel, resources={"metadata": {"path": str(path.parent)}},
                            on_cell_start=on_start, on_cell_executed=on_done)
    t0 = time.perf_counter()
    error = None
    try:
        client.execute()
    except Exception as exc:  # a failing cell: report what ran, and the error, instead of no row
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    wall = time.perf_counter() - t0
    if sampler:
        peaks.append((sampler[0].stop(), -1, sampler[0].last_private))
    peak, peak_cell, _ = max(peaks, default=(0, -1, 0))
    private = max((p for _, _, p in peaks), default=0)
    return dict(notebook=path.stem, wall_s=wall, peak_bytes=peak, peak_cell=peak_cell, private_bytes=private,
                cells=cells, error=error)


def table(rows: list[dict], slowest: int = 5) -> list[str]:
    """One line per notebook: wall time, peak memory (resident, and private: without the mapped model
    file, :func:`tree_memory`), its ``slowest`` cells (seconds (cell index))."""
    lines = [f"{'notebook':<28}{'Run All':>9}{'peak mem':>10}{'private':>10}{'in cell':>8}  slowest cells: seconds (cell index)"]
    for r in rows:
        top = sorted(r["cells"], key=lambda c: -c[1])[:slowest]
        cells = ", ".join(f"{s:.0f} ({i})" for i, s in top)
        where = r.get("peak_cell", -1)
        lines.append(f"{r['notebook']:<28}{r['wall_s']:>8.0f}s{r['peak_bytes'] / GIB:>6.2f} GiB"
                     f"{r.get('private_bytes', 0) / GIB:>6.2f} GiB{where if where >= 0 else '-':>8}  {cells}"
                     + (f"  FAILED {r['error']}" if r.get("error") else ""))
    total = sum(r["wall_s"] for r in rows)
    lines.append(f"{'all':<28}{total:>8.0f}s{max((r['peak_bytes'] for r in rows), default=0) / GIB:>6.2f} GiB"
                 f"{max((r.get('private_bytes', 0) for r in rows), default=0) / GIB:>6.2f} GiB")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", help="notebook names or number prefixes (default: all)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds one cell may take")
    args = ap.parse_args(argv)
    paths = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if args.notebooks:
        paths = [p for p in paths if any(p.stem.startswith(n) or p.name == n for n in args.notebooks)]
        if not paths:
            ap.error(f"notebooks: no notebook matches {args.notebooks}")
    rows = []
    for p in paths:
        rows.append(run_notebook(p, timeout=args.timeout))
        print(table(rows[-1:])[1], flush=True)
    print("\n".join(table(rows)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

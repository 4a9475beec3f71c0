"""Which names a notebook's cells read and bind, to find the cells that break when re-run after Run All.

A room re-runs cells all day. A cell that reads a name an earlier cell bound, where a LATER cell binds the
same name to something else, reads the later value when re-run: 02's Task 1 read-back once met a ``bm``
rebound by section 6's cell, 05's kernel cells a ``ctx`` turned into an int by a later loop. Such names
must become names of their own. Static analysis, no kernel: :func:`rebinding_hazards`.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
from pathlib import Path

BUILTINS = set(dir(builtins)) | {"display", "get_ipython", "__file__"}


def _code(source: str) -> str:
    """Cell source with IPython's magics and shell lines blanked (line numbers kept)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def _targets(node) -> list[str]:
    """Names an assignment target binds."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _targets(elt)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return []  # attribute and subscript targets mutate, they bind no name


class _Cell(ast.NodeVisitor):
    """Top-level bindings of one cell (name -> the statements' source), and the names it reads that it
    did not bind before (at the cell's own top level, in order; nested scopes read globals at call time)."""

    def __init__(self, source: str):
        self.source = source
        self.binds: dict[str, list[str]] = {}
        self.reads: set[str] = set()
        self._bound: set[str] = set()  # bound so far at the top level
        self._locals: list[set[str]] = []  # names local to each enclosing function / comprehension
        tree = ast.parse(_code(source))
        for stmt in tree.body:
            self._statement(stmt)

    def _bind(self, name: str, stmt) -> None:
        if self._locals:
            self._locals[-1].add(name)
            return
        self.binds.setdefault(name, []).append(ast.get_source_segment(_code(self.source), stmt) or name)

    def _statement(self, stmt) -> None:
        # reads first (the right-hand side runs before the target is bound), then the bindings
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            if stmt.value is not None:
                self.visit(stmt.value)
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                if isinstance(stmt, ast.AugAssign):
                    self.visit(t)  # x += 1 reads x
                elif not isinstance(t, ast.Name):
                    self.visit(t)  # a[i] = ... reads a (and i)
                for name in _targets(t):
                    self._bind(name, stmt)
                    self._bound.add(name)
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            self.visit(stmt.iter)
            for name in _targets(stmt.target):
                self._bind(name, stmt)
                self._bound.add(name)
            for s in stmt.body + stmt.orelse:
                self._statement(s)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                self.visit(item.context_expr)
                if item.optional_vars is not None:
                    for name in _targets(item.optional_vars):
                        self._bind(name, stmt)
                        self._bound.add(name)
            for s in stmt.body:
                self._statement(s)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for a in stmt.names:
                name = (a.asname or a.name).split(".")[0]
                self._bind(name, stmt)
                self._bound.add(name)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for d in stmt.decorator_list:
                self.visit(d)
            self._bind(stmt.name, stmt)
            self._bound.add(stmt.name)
            self._scope(stmt)
        elif isinstance(stmt, (ast.If, ast.While)):
            self.visit(stmt.test)
            for s in stmt.body + stmt.orelse:
                self._statement(s)
        elif isinstance(stmt, ast.Try):
            for s in stmt.body + stmt.orelse + stmt.finalbody:
                self._statement(s)
            for h in stmt.handlers:
                if h.name:
                    self._bind(h.name, h)
                    self._bound.add(h.name)
                for s in h.body:
                    self._statement(s)
        else:
            self.visit(stmt)

    def _scope(self, node) -> None:
        """A function, lambda or class body: its own locals; what it reads of the cell's globals counts."""
        local: set[str] = set()
        args = getattr(node, "args", None)
        if args is not None:
            local |= {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
            local |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
            for default in args.defaults + [d for d in args.kw_defaults if d is not None]:
                self.visit(default)
        for n in ast.walk(node):  # names assigned anywhere in the body are local to it
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                local.add(n.id)
        self._locals.append(local)
        body = node.body if isinstance(node.body, list) else [node.body]
        for s in body:
            self.visit(s)
        self._locals.pop()

    def visit_Lambda(self, node):
        self._scope(node)

    def visit_FunctionDef(self, node):  # nested
        self._bind(node.name, node)
        self._scope(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def _comprehension(self, node):
        local = {n for g in node.generators for n in _targets(g.target)}
        self.visit(node.generators[0].iter)  # the first iterable runs in the enclosing scope
        self._locals.append(local)
        for i, g in enumerate(node.generators):
            if i:
                self.visit(g.iter)
            for cond in g.ifs:
                self.visit(cond)
        for part in ("elt", "key", "value"):
            if hasattr(node, part):
                self.visit(getattr(node, part))
        self._locals.pop()

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    def visit_NamedExpr(self, node):
        self.visit(node.value)
        for name in _targets(node.target):
            self._bind(name, node)
            self._bound.add(name)

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            if any(node.id in scope for scope in self._locals):
                return
            if node.id not in self._bound and node.id not in BUILTINS:
                self.reads.add(node.id)


def code_cells(path: Path) -> list[tuple[int, str]]:
    """(index among all cells, source) of each code cell."""
    cells = json.loads(Path(path).read_text())["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def rebinding_hazards(path: Path) -> list[str]:
    """One line per (cell, name): the cell reads ``name`` bound by an earlier cell, and a later cell
    binds it differently, so re-running the cell after Run All reads the later value. Bindings whose
    statements are the same text everywhere (the same import, the same model load) are no hazard."""
    cells = [(i, _Cell(src)) for i, src in code_cells(path)]
    out = []
    for pos, (i, cell) in enumerate(cells):
        for name in sorted(cell.reads):
            before = [(j, c) for j, c in cells[:pos] if name in c.binds]
            after = [(j, c) for j, c in cells[pos + 1:] if name in c.binds]
            if not before or not after:
                continue
            texts = {t for _, c in before[-1:] + after for t in c.binds[name]}
            if len(texts) > 1:
                out.append(f"cell {i} reads {name!r} (bound by cell {before[-1][0]}), rebound later by cell "
                           f"{', '.join(str(j) for j, _ in after)}")
    return out


# ---- what a reader reads: printed words and long cells on the main path ------------------------------

MAIN_PATH_END = "## Going deeper"


def main_path_cells(cells: list[dict]) -> list[tuple[int, dict]]:
    """(index, cell) of the cells before the ``## Going deeper`` heading."""
    out = []
    for i, c in enumerate(cells):
        if c["cell_type"] == "markdown" and any(line.startswith(MAIN_PATH_END) for line in
                                                "".join(c["source"]).splitlines()):
            break
        out.append((i, c))
    return out


def _text(t) -> str:
    return "".join(t) if isinstance(t, list) else t


def printed_words(executed: dict) -> dict[int, int]:
    """Words each main-path code cell of an executed notebook printed (stdout, and results shown as plain
    text); widgets, figures, images and HTML do not count: they are looked at, not read line by line."""
    out = {}
    for i, c in main_path_cells(executed["cells"]):
        if c["cell_type"] != "code":
            continue
        n = 0
        for o in c.get("outputs", []):
            if o.get("output_type") == "stream" and o.get("name") == "stdout":
                n += len(_text(o.get("text", "")).split())
            elif o.get("output_type") in ("execute_result", "display_data"):
                data = o.get("data", {})
                if set(data) <= {"text/plain"}:
                    n += len(_text(data.get("text/plain", "")).split())
        if n:
            out[i] = n
    return out


def long_code_cells(path: Path, limit: int = 25) -> list[tuple[int, int]]:
    """(index, lines) of the main-path code cells longer than ``limit`` lines."""
    cells = json.loads(Path(path).read_text())["cells"]
    return [(i, n) for i, c in main_path_cells(cells) if c["cell_type"] == "code"
            and (n := len("".join(c["source"]).rstrip("\n").split("\n"))) > limit]


def task_cells(cells: list[dict]) -> dict[str, list[int]]:
    """Per build task (its checker's name), the cells a participant re-runs after Run All, in order: the
    task's own cell (its stub or solution and checker call) and every main-path cell that plugs it in
    (``check.use("<name>", ...)``)."""
    main = main_path_cells(cells)
    out, heading = {}, False
    for i, c in main:
        text = "".join(c["source"])
        if c["cell_type"] == "markdown":
            heading = heading or bool(re.search(r"^### Task \d+", text, re.M))
            continue
        if heading:
            calls = [n for n in re.findall(r"check\.(\w+)\(", text) if n not in ("use", "solution", "progress", "mine")]
            if calls:
                out[calls[0]] = [i]
            heading = False
    for name, idx in out.items():
        idx += [i for i, c in main if c["cell_type"] == "code" and i not in idx
                and re.search(r"check\.use\(\s*[\"']" + name + r"[\"']", "".join(c["source"]))]
    return out


def section_cells(cells: list[dict]) -> dict[str, list[int]]:
    """Per main-path section (its ``## `` heading; "(opening)" for the cells before the first), its code
    cells in order: what a room re-runs when it goes back to a section and runs it again from its start."""
    out: dict[str, list[int]] = {}
    title = "(opening)"
    for i, c in main_path_cells(cells):
        if c["cell_type"] == "markdown":
            heading = next((line[3:].strip() for line in "".join(c["source"]).splitlines() if line.startswith("## ")), None)
            if heading is not None:
                title = heading
            continue
        out.setdefault(title, []).append(i)
    return out

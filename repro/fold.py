"""Folding a bug's switches into plain code: the source transform behind `repro checkout`.

A fix part is a switch in one tree (`Fix.PART in fixes` at each `# fix: PART` site). Folding
part P on (or off) rewrites every site of P as the code that variant runs: the test becomes a
constant, and the constant is simplified away, text edit by text edit, so that every line the
transform does not need to touch keeps its formatting (`diff -r` of a fixed and a buggy tree
is the fix, nothing else). Positions come from `ast`; edits are made on the text; the file is
parsed again after each round until nothing is left to fold.

What folds by pattern, with no rule of the bug's own:
- `Fix.P in E` / `Fix.P not in E` -> a constant; `not`, `and`, `or` and `x if c else y` over
  constants simplified; an `if` (or `elif`) on a constant replaced by the branch it takes,
  dedented (a block left empty gets `pass`; statements after a kept `return` go);
- a local assigned once from a switch (`clamp = Fix.P in self.fixes`): the assignment goes and
  its uses become the constant;
- `# fix: P` comments (own lines with their continuation lines, or trailing) go.
Where a switch travels as a name (a Triton constexpr, a launcher's keyword, a dataclass field
of kernel switches), the bug's record names it (`harness.record.Fold`): in the files named
there, a parameter, a dataclass field or a keyword argument so named goes (a keyword only when
its value carries no other bug's switch), a positional argument passed for such a parameter
of a function of the same file (or to a function elsewhere, a csrc binding) goes, and every
other use becomes the constant. C++ files a rule names fold the same way, on text: `bool NAME`
parameters and fields, and the arguments and initialisers passed for them by position, go;
other uses become `true`/`false` and `c ? a : b`, `c && x` and `if (false && ...) ...;` reduce.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import subprocess
import textwrap
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

MAX_ROUNDS = 50
FIX_COMMENT = re.compile(r"#\s*fix:\s*([a-z0-9_]+)")


class FoldError(ValueError):
    """A site the transform cannot fold (the tree would not be the variant)."""


@dataclass(frozen=True)
class Switches:
    """What to fold in one file: Fix member names (`MOE_ALIGN_OOB_GUARD`) and names declared
    by the record's fold rules, each to its constant; the parts' values for comments."""

    members: dict[str, bool]
    names: dict[str, bool] = field(default_factory=dict)
    parts: frozenset[str] = frozenset()  # the parts' values (`moe_align_oob_guard`)
    positional: dict | None = None  # filled from the first parse (_Round.positional_switches)


def fold_text(text: str, switches: Switches) -> str:
    """The file with every switch of `switches` folded (unchanged text when there is none)."""
    for _ in range(MAX_ROUNDS):
        edits = _Round(text, switches).edits()
        if not edits:
            return _drop_fix_comments(text, switches.parts)
        text = _apply(text, edits)
    raise FoldError(f"no fixed point after {MAX_ROUNDS} rounds")


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    kept: list[tuple[int, int, str]] = []
    for start, end, new in sorted(edits):
        if kept and start < kept[-1][1]:
            continue  # overlaps an earlier edit: the next round makes it again
        kept.append((start, end, new))
    for start, end, new in reversed(kept):
        text = text[:start] + new + text[end:]
    return text


def _drop_fix_comments(text: str, parts: frozenset[str]) -> str:
    """`# fix: P` comments of the folded parts: own-line ones with the comment lines that
    continue them (same indent, no new `fix:`), trailing ones cut off (comments only: a
    string that holds `# fix:` stays)."""
    comments = {
        tok.start[0]: tok.start[1]
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    }
    out: list[str] = []
    dropping = None  # the indent of an own-line comment being dropped
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        col = comments.get(n)
        own = col is not None and not line[:col].strip()
        if dropping is not None:
            if own and col == dropping and "fix:" not in line:
                continue
            dropping = None
        match = FIX_COMMENT.match(line, col) if col is not None else None
        if match and match.group(1) in parts:
            if own:
                dropping = col
                continue
            line = line[:col].rstrip() + "\n"
        out.append(line)
    return "".join(out)


def _is_bool(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, bool)


TERMINAL = (ast.Return, ast.Raise, ast.Continue, ast.Break)


class _Round:
    """One pass over a parse of `text`: the edits it finds (non-overlapping ones are applied)."""

    def __init__(self, text: str, switches: Switches) -> None:
        self.text = text
        self.sw = switches
        self.tree = ast.parse(text)
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        self.out: list[tuple[int, int, str]] = []
        self.local: dict[str, bool] = {}  # names assigned once from a switch, in this scope
        if switches.positional is None:  # from the first parse: later rounds see fewer params
            object.__setattr__(switches, "positional", self.positional_switches())

    def positional_switches(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """{function: (its positional arity, the indices of its switch parameters)}."""
        found = {}
        for fn in self.tree.body:
            if isinstance(fn, ast.FunctionDef):
                params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
                at = tuple(i for i, a in enumerate(params) if a in self.sw.names)
                found[fn.name] = (len(params), at)
        return found

    # -- positions ------------------------------------------------------------------------

    def off(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1].encode()
        return self.starts[lineno - 1] + len(line[:col].decode())

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.off(node.lineno, node.col_offset), self.off(
            node.end_lineno, node.end_col_offset
        )

    def src(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]

    def line_span(self, first: int, last: int) -> tuple[int, int]:
        return self.starts[first - 1], self.starts[last]

    def edit(self, start: int, end: int, new: str) -> None:
        self.out.append((start, end, new))

    # -- evaluation -------------------------------------------------------------------------

    def leaf(self, node: ast.AST) -> bool | None:
        """The constant of a switch itself, else None."""
        if (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and isinstance(node.ops[0], ast.In | ast.NotIn)
            and isinstance(node.left, ast.Attribute)
            and isinstance(node.left.value, ast.Name)
            and node.left.value.id == "Fix"
            and node.left.attr in self.sw.members
        ):
            value = self.sw.members[node.left.attr]
            return value if isinstance(node.ops[0], ast.In) else not value
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id in self.local:
                return self.local[node.id]
            return self.sw.names.get(node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            return self.sw.names.get(node.attr)
        return None

    def has_switch(self, node: ast.AST) -> bool:
        return any(self.leaf(n) is not None for n in ast.walk(node))

    def other_switch(self, node: ast.AST) -> bool:
        """`node` reads a Fix member this fold leaves alone (another bug's switch)."""
        return any(
            isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == "Fix"
            and n.attr not in self.sw.members
            for n in ast.walk(node)
        )

    def residual(self, node: ast.AST) -> bool | str:
        """A boolean tree over switches: its constant, or the text of what is left."""
        value = self.leaf(node)
        if value is not None:
            return value
        if not self.has_switch(node):
            return self.src(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            inner = self.residual(node.operand)
            if isinstance(inner, bool):
                return not inner
            return "not " + self.wrap(node.operand, inner)
        if isinstance(node, ast.BoolOp):
            absorbing = isinstance(node.op, ast.Or)  # True absorbs `or`, False absorbs `and`
            kept = []
            for v in node.values:
                r = self.residual(v)
                if r is absorbing:
                    return absorbing
                if not isinstance(r, bool):
                    kept.append(self.wrap(v, r))
            if not kept:
                return not absorbing
            return (" or " if absorbing else " and ").join(kept)
        if isinstance(node, ast.IfExp):
            test = self.residual(node.test)
            if isinstance(test, bool):
                return self.residual(node.body if test else node.orelse)
            return (
                f"{self.residual_text(node.body)} if {test} else {self.residual_text(node.orelse)}"
            )
        return self.src(node)

    def residual_text(self, node: ast.AST) -> str:
        r = self.residual(node)
        return str(r) if isinstance(r, bool) else r

    def wrap(self, node: ast.AST, text: str) -> str:
        """`text` in parentheses where it replaces an operand that binds looser than `and`."""
        return f"({text})" if isinstance(node, ast.BoolOp | ast.IfExp | ast.Lambda) else text

    # -- the round ----------------------------------------------------------------------------

    def edits(self) -> list[tuple[int, int, str]]:
        self.block(self.tree.body, scope=self.tree)
        return self.out

    def block(self, body: list[ast.stmt], scope: ast.AST) -> None:
        for i, stmt in enumerate(body):
            if self.statement(stmt, body, i, scope):
                return

    def statement(self, stmt: ast.stmt, body: list[ast.stmt], i: int, scope: ast.AST) -> bool:
        """Edits for one statement; True when the rest of `body` is dead (and dropped)."""
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            self.function(stmt)
            return False
        if isinstance(stmt, ast.ClassDef):
            self.fields(stmt)
            self.block(stmt.body, stmt)
            return False
        if isinstance(stmt, ast.If):
            test = self.residual(stmt.test)
            if isinstance(test, bool):
                return self.fold_if(stmt, test, body, i)
            if test != self.src(stmt.test):
                self.edit(*self.span(stmt.test), test)
                for name in ("body", "orelse"):
                    self.block(getattr(stmt, name), scope)
                return False
        if self.assigned_switch(stmt, scope):
            return False
        for child in ast.iter_child_nodes(stmt):
            if isinstance(child, ast.expr):
                self.expression(child)
        for name in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, name, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                self.block(inner, scope)
        for handler in getattr(stmt, "handlers", []):
            self.block(handler.body, scope)
        return False

    def function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer = self.local
        self.local = dict(outer)
        self.local.update(self.switch_locals(fn))
        params = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        defaults = dict(
            zip(
                [a.arg for a in (fn.args.posonlyargs + fn.args.args)][-len(fn.args.defaults) :]
                if fn.args.defaults
                else [],
                fn.args.defaults,
                strict=True,
            )
        )
        defaults.update(
            {a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True) if d}
        )
        doomed = [a for a in params if a.arg in self.sw.names]
        if doomed:
            items = sorted(params, key=lambda a: (a.lineno, a.col_offset))
            ends = {a.arg: defaults.get(a.arg, a) for a in params}
            self.drop_items(items, doomed, ends)
            kwonly = fn.args.kwonlyargs
            if kwonly and fn.args.vararg is None and all(a in doomed for a in kwonly):
                self.drop_star(kwonly[0])
        for d in fn.args.defaults + [d for d in fn.args.kw_defaults if d]:
            self.expression(d)
        self.block(fn.body, fn)
        self.local = outer

    def switch_locals(self, fn: ast.AST) -> dict[str, bool]:
        """Names assigned exactly once in `fn`, from a switch (`guard = fixes.oob_guard`)."""
        counts: dict[str, int] = {}
        for n in ast.walk(fn):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                counts[n.id] = counts.get(n.id, 0) + 1
        found = {}
        for n in ast.walk(fn):
            if (
                isinstance(n, ast.Assign)
                and len(n.targets) == 1
                and isinstance(n.targets[0], ast.Name)
                and counts.get(n.targets[0].id) == 1
                and self.has_switch(n.value)
            ):
                value = self.residual(n.value)
                if isinstance(value, bool):
                    found[n.targets[0].id] = value
        return found

    def assigned_switch(self, stmt: ast.stmt, scope: ast.AST) -> bool:
        """Drop `name = <switch>` (its uses fold to the constant)."""
        if not (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id in self.local
            and not isinstance(scope, ast.Module | ast.ClassDef)
            and self.has_switch(stmt.value)
        ):
            return False
        self.edit(*self.line_span(stmt.lineno, stmt.end_lineno), "")
        return True

    def fields(self, cls: ast.ClassDef) -> None:
        """A dataclass field named by a fold rule goes (its line or lines)."""
        for stmt in cls.body:
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and stmt.target.id in self.sw.names
            ):
                self.edit(*self.line_span(stmt.lineno, stmt.end_lineno), "")

    def expression(self, node: ast.expr) -> None:
        if not self.has_switch(node) and not self.named_items(node):
            return
        if isinstance(node, ast.Call):
            self.call(node)
            return
        r = self.residual(node)
        if isinstance(r, bool) or r != self.src(node):
            self.edit(*self.span(node), str(r))
            return
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.expression(child)

    def named(self, node: ast.AST) -> bool:
        """`node` is a name a fold rule declares (`FIXED_OOB_GUARD`, `fixes.oob_guard`)."""
        if isinstance(node, ast.Name):
            return node.id in self.sw.names and node.id not in self.local
        return isinstance(node, ast.Attribute) and node.attr in self.sw.names

    def named_items(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.keyword) and n.arg in self.sw.names for n in ast.walk(node))

    def call(self, call: ast.Call) -> None:
        self.expression(call.func)
        name = call.func.id if isinstance(call.func, ast.Name) else None
        arity, doomed_at = self.sw.positional.get(name, (-1, ()))
        doomed: list[ast.AST] = []
        for i, arg in enumerate(call.args):
            if len(call.args) == arity and i in doomed_at:
                doomed.append(arg)
            elif name not in self.sw.positional and self.named(arg):
                doomed.append(arg)  # to another module or a C++ binding, whose parameter goes
            else:
                self.expression(arg)
        for kw in call.keywords:
            if kw.arg in self.sw.names and not self.other_switch(kw.value):
                doomed.append(kw)
            else:
                self.expression(kw.value)
        if doomed:
            items = sorted([*call.args, *call.keywords], key=lambda n: (n.lineno, n.col_offset))
            self.drop_items(items, doomed, {})

    def drop_items(self, items: list, doomed: list, ends: dict) -> None:
        """Remove items of a comma-separated list (arguments, parameters): whole lines where an
        item has its lines to itself, else the item and one comma beside it."""
        for item in doomed:
            last = ends.get(getattr(item, "arg", None), item) if ends else item
            start, end = self.off(item.lineno, item.col_offset), self.span(last)[1]
            before = self.text[self.starts[item.lineno - 1] : start]
            rest = self.text[end : self.starts[last.end_lineno]]
            if not before.strip() and rest.strip() in (",", "") and rest.endswith("\n"):
                self.edit(*self.line_span(item.lineno, last.end_lineno), "")
                continue
            k = items.index(item)
            if k + 1 < len(items):
                nxt = items[k + 1]
                self.edit(start, self.off(nxt.lineno, nxt.col_offset), "")
            elif k > 0:
                prev = (
                    ends.get(getattr(items[k - 1], "arg", None), items[k - 1])
                    if ends
                    else items[k - 1]
                )
                self.edit(self.span(prev)[1], end, "")
            else:
                self.edit(start, end, "")

    def drop_star(self, first_kwonly: ast.arg) -> None:
        """The bare `*` before keyword-only parameters that are all gone."""
        at = self.off(first_kwonly.lineno, first_kwonly.col_offset)
        star = self.text.rindex("*", 0, at)
        n = self.text.count("\n", 0, star) + 1
        line = self.lines[n - 1]
        if line.strip() in ("*,", "*"):
            self.edit(*self.line_span(n, n), "")
        else:
            self.edit(star, at, "")

    # -- if statements ------------------------------------------------------------------------

    def fold_if(self, stmt: ast.If, test: bool, body: list[ast.stmt], i: int) -> bool:
        """Replace `stmt` by the branch `test` takes; True when that branch ends the block."""
        indent = stmt.col_offset
        first, last = stmt.lineno, stmt.end_lineno
        is_elif = self.lines[first - 1][indent:].startswith("elif")
        kept = stmt.body if test else stmt.orelse
        if is_elif:
            raise FoldError(f"line {first}: an elif on a switch is not folded")
        if kept and kept[0].lineno == first:  # `if c: stmt` on one line
            new = " " * indent + self.src(kept[0]) + "\n"
            self.edit(*self.line_span(first, last), new)
            return isinstance(kept[-1], TERMINAL) and self.drop_rest(body, i)
        if not kept:
            alone = len(body) == 1
            self.edit(*self.line_span(first, last), " " * indent + "pass\n" if alone else "")
            return False
        if not test and len(kept) == 1 and isinstance(kept[0], ast.If):
            orelse_if = kept[0]
            if self.lines[orelse_if.lineno - 1][orelse_if.col_offset :].startswith("elif"):
                # `if SWITCH: ... elif c: ...` off: the elif becomes the if
                start = self.starts[first - 1]
                at = self.off(orelse_if.lineno, orelse_if.col_offset)
                self.edit(start, at + len("elif"), " " * indent + "if")
                return False
        region = self.branch_lines(stmt, test)
        chunk = "".join(self.lines[region[0] - 1 : region[1]])
        self.edit(
            *self.line_span(first, last), textwrap.indent(textwrap.dedent(chunk), " " * indent)
        )
        return isinstance(kept[-1], TERMINAL) and self.drop_rest(body, i)

    def branch_lines(self, stmt: ast.If, test: bool) -> tuple[int, int]:
        header_end = stmt.test.end_lineno
        while not self.lines[header_end - 1].split("#")[0].rstrip().endswith(":"):
            header_end += 1
        if not stmt.orelse:
            return header_end + 1, stmt.end_lineno
        else_line = next(
            n
            for n in range(stmt.body[-1].end_lineno + 1, stmt.orelse[0].lineno + 1)
            if self.lines[n - 1].lstrip().startswith("else")
        )
        return (header_end + 1, else_line - 1) if test else (else_line + 1, stmt.end_lineno)

    def drop_rest(self, body: list[ast.stmt], i: int) -> bool:
        if i + 1 < len(body):
            self.edit(*self.line_span(body[i + 1].lineno, body[-1].end_lineno), "")
        return True


# -- C++ (csrc/) ---------------------------------------------------------------------------------

CXX_SUFFIXES = (".cu", ".cpp", ".h", ".cuh")
CXX_DECL = re.compile(r"\b(\w+)\s*\(([^()]*)\)\s*(?:const\s*)?[{;]")
CXX_STRUCT = re.compile(r"\bstruct\s+(\w+)\s*\{([^{}]*)\}")


def cxx_positions(texts: Iterable[str], names: dict[str, bool]) -> dict[str, dict[int, tuple]]:
    """{function or struct: {its arity: the indices of its switch parameters or fields}} over
    the C++ files of a fold rule (a struct's fields are initialised by position too)."""
    found: dict[str, dict[int, tuple]] = {}

    def note(name: str, items: list[str]) -> None:
        at = tuple(
            i for i, item in enumerate(items) if re.fullmatch(rf"bool\s+({'|'.join(names)})", item)
        )
        if at:
            found.setdefault(name, {})[len(items)] = at

    for text in texts:
        for m in CXX_DECL.finditer(text):
            note(m.group(1), [i.strip() for i in m.group(2).split(",")])
        for m in CXX_STRUCT.finditer(text):
            fields = re.sub(r"//[^\n]*", "", m.group(2)).split(";")
            note(m.group(1), [f.strip() for f in fields][:-1])
    return found


def _cxx_items(text: str, open_at: int) -> tuple[list[tuple[int, int]], int]:
    """The top-level comma-separated items of the (...) or {...} opening at `open_at`: their
    spans, and the index of the closing bracket."""
    depth, start, items = 0, open_at + 1, []
    for k in range(open_at, len(text)):
        c = text[k]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                if text[start:k].strip():
                    items.append((start, k))
                return items, k
        elif c == "," and depth == 1:
            items.append((start, k))
            start = k + 1
    raise FoldError("unbalanced brackets")


def _runs(indices: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def fold_cxx(text: str, names: dict[str, bool], positions: dict, parts: frozenset[str]) -> str:
    """Fold C++ switches named by a rule: parameters, fields and the arguments or initialisers
    passed for them go; other uses become `true`/`false`; `x ? a : b`, `c && x` and an `if`
    on a constant simplified; `// fix: P` comment lines dropped."""
    if not names:
        return text
    alt = "|".join(names)
    # the struct definitions' fields
    text = re.sub(rf"^[ \t]*bool\s+({alt});[^\n]*\n", "", text, flags=re.M)
    # parameters, arguments and initialisers, by position (right to left keeps offsets)
    edits = []
    for name, by_arity in positions.items():
        for m in re.finditer(rf"\b{name}\s*(?:<<<.*?>>>\s*)?(?:\w+\s*)?([({{])", text, re.S):
            items, _ = _cxx_items(text, m.start(1))
            at = set(by_arity.get(len(items), ()))
            for run in _runs(sorted(at)):
                i, j = run[0], run[-1]
                if i > 0:  # from the comma before the run
                    edits.append((items[i - 1][1], items[j][1]))
                elif j + 1 < len(items):  # to the next item kept
                    b = items[j + 1][0]
                    while text[b] in " \t\n":
                        b += 1
                    edits.append((items[0][0], b))
                else:
                    edits.append((items[0][0], items[-1][1]))
    for a, b in sorted(set(edits), reverse=True):
        text = text[:a] + text[b:]
    text = re.sub(r"\(\s*\n\s*\)", "()", text)

    # the remaining uses
    def const(m: re.Match) -> str:
        return "true" if names[m.group(1)] else "false"

    text = re.sub(rf"(?:\bfixes\.)?\b({alt})\b", const, text)
    text = re.sub(r"\btrue \? ([^:;]+?) : ([^;]+?);", r"\1;", text)
    text = re.sub(r"\bfalse \? ([^:;]+?) : ([^;]+?);", r"\2;", text)
    text = re.sub(r"^[ \t]*if \(false && [^;]*;\n", "", text, flags=re.M)
    text = re.sub(r"\(true && ", "(", text)
    lines = text.splitlines(keepends=True)
    drop = [re.match(r"\s*// fix: (\w+)", line) for line in lines]
    return "".join(line for line, m in zip(lines, drop, strict=True) if not (m and m[1] in parts))


FOLDED = ("kernels/", "harness/", "repro/")  # Python folded (tests/ keep their switches)
NO_SWITCH_LEFT = ("kernels/", "harness/runner/", "csrc/")  # what must hold no switch of the bug


@functools.lru_cache(maxsize=8)
def tree_paths(root: Path) -> list[str]:
    """The project's files: git's tracked and unignored ones, else every file but caches."""
    try:
        out = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "ls-files",
                "-z",
                "--cached",
                "--others",
                "--exclude-standard",
            ],
            capture_output=True,
            check=True,
        ).stdout.decode()
        paths = sorted({p for p in out.split("\0") if p and (root / p).is_file()})
        if paths:
            return paths
    except (OSError, subprocess.CalledProcessError):
        pass
    skip = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".cache"}
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and not skip & set(p.relative_to(root).parts)
    )


def switches_for(path: str, bug, values: dict) -> Switches | None:
    """The switches of `bug` to fold in `path` ({Fix: on?} in `values`), or None."""
    if not (path.endswith(".py") and path.startswith(FOLDED)):
        return None
    names = {
        name: values[rule.part] for rule in bug.folds if path in rule.files for name in rule.names
    }
    members = {part.name: values[part] for part in bug.fix_parts}
    return Switches(members, names, frozenset(part.value for part in bug.fix_parts))


def _cxx_rules(root: Path, bug, values: dict) -> tuple[dict, dict]:
    """The bug's C++ switch names per file, and their positions over those files."""
    per_file: dict[str, dict[str, bool]] = {}
    for rule in bug.folds:
        for path in rule.files:
            if path.endswith(CXX_SUFFIXES):
                per_file.setdefault(path, {}).update(dict.fromkeys(rule.names, values[rule.part]))
    names = {n: v for file_names in per_file.values() for n, v in file_names.items()}
    texts = [(root / path).read_text() for path in per_file]
    return per_file, cxx_positions(texts, names) if names else {}


def fold_bug(root: Path, bug, values: dict) -> dict[str, str]:
    """{path: folded text} for every file of the tree under `root` that folding changes."""
    changed = {}
    cxx, positions = _cxx_rules(root, bug, values)
    parts = frozenset(part.value for part in bug.fix_parts)
    for path, names in cxx.items():
        text = (root / path).read_text()
        new = fold_cxx(text, names, positions, parts)
        if new != text:
            changed[path] = new
    for path in tree_paths(root):
        sw = switches_for(path, bug, values)
        if sw is None:
            continue
        text = (root / path).read_text()
        needles = [*sw.members, *sw.names, *(f"fix: {part}" for part in sw.parts)]
        if not any(needle in text for needle in needles):
            continue
        try:
            new = fold_text(text, sw)
        except (FoldError, SyntaxError) as e:
            raise FoldError(f"{path}: {e}") from None
        if new != text:
            changed[path] = new
    return changed


def leftovers(root: Path, bug, changed: dict[str, str]) -> list[str]:
    """`path:line` of every switch of `bug` still in the code under test after folding: its
    Fix members, its `fix:` comments, and the names its fold rules declare (as code, not in
    strings; a keyword that carries another bug's switch is that bug's)."""
    members = [f"Fix.{part.name}" for part in bug.fix_parts]
    comments = [f"fix: {part.value}" for part in bug.fix_parts]
    found = []
    for path in tree_paths(root):
        if not path.startswith(NO_SWITCH_LEFT) or path.endswith((".so", ".o")):
            continue
        text = changed.get(path)
        if text is None:
            try:
                text = (root / path).read_text()
            except (OSError, UnicodeDecodeError):
                continue
        names = {n for rule in bug.folds if path in rule.files for n in rule.names}
        hits = {
            n
            for n, line in enumerate(text.splitlines(), 1)
            if any(m in line for m in members + comments)
        }
        if names and path.endswith(".py"):
            tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
            for k, tok in enumerate(tokens):
                if tok.type == tokenize.NAME and tok.string in names:
                    after = "".join(t.string for t in tokens[k + 1 : k + 4])
                    if not after.startswith("=Fix."):
                        hits.add(tok.start[0])
        found += [f"{path}:{n}" for n in sorted(hits)]
    return found

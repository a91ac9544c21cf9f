"""vLLM's source, read as text, and what of a definition a patch relies on it lacks (API
process, at the engine's start, and `make check-vllm`).

`Hook` names one definition in vLLM (a module attribute, its parameters, a class's members,
names its source must mention, statements that must sit under a condition); `check_hook`
says what of it a source tree lacks, following re-exports, relative imports and base
classes through the AST, never importing vLLM. The source is the installed vLLM's
(`installed_source`) or a wheel's (`wheel_source`): `make check-vllm` checks both pinned
builds without a GPU.
"""

import ast
import functools
import importlib.util
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Hook:
    """One definition in vLLM a patch relies on: `module`'s `name` (a dotted path inside
    it, e.g. a class's method), with these parameters and, for a class, these members
    (methods, properties, fields, or `self.X` assigned in its methods or its bases'), and
    whose source mentions these names."""

    module: str
    name: str
    parameters: tuple[str, ...] = ()
    members: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()  # names its source must mention
    # (statement, condition): every statement whose source contains the first, and there is
    # one, sits inside an `if` whose test contains the second: what a setting means, as far
    # as text can tell (e.g. a call made only while a flag is off).
    guards: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


Source = Callable[[str], str | None]  # module name -> its source, or None


@functools.cache
def installed_source() -> Source:
    """The installed vLLM's source files, read without importing them (one reader per
    process, so each module is parsed once however many engines start)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return lambda module: None
    root = Path(next(iter(spec.submodule_search_locations))).parent
    return lambda module: _read(root, module)


def _read(root: Path, module: str) -> str | None:
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.read_text()
    return None


def wheel_source(wheel: Path) -> Source:
    """A vLLM wheel's source files, read from the archive."""
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())

    def read(module: str) -> str | None:
        base = module.replace(".", "/")
        for name in (f"{base}.py", f"{base}/__init__.py"):
            if name in names:
                return archive.read(name).decode()
        return None

    return read


def check_hook(source: Source, hook: Hook) -> list[str]:
    """What of `hook` the source lacks."""
    definition = _definition(source, hook.module, hook.name.split("."))
    if definition is None:
        return [str(hook)]
    lacking = []
    if hook.reads:
        text = ast.unparse(definition)
        lacking += [f"{hook} reading {name}" for name in hook.reads if name not in text]
    lacking += [
        f"{hook} doing {statement!r} only under {condition!r}"
        for statement, condition in hook.guards
        if not _guarded(definition, statement, condition)
    ]
    if hook.parameters:
        if not isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef):
            return [f"{hook} (not a function)"]
        arguments = definition.args
        names = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}
        absent = [p for p in hook.parameters if p not in names]
        if absent:
            lacking.append(f"{hook}({', '.join(absent)})")
    if hook.members:
        if not isinstance(definition, ast.ClassDef):
            return [f"{hook} (not a class)"]
        members = _members(source, hook.module, definition)
        lacking += [f"{hook}.{member}" for member in hook.members if member not in members]
    return lacking


def _guarded(definition: ast.AST, statement: str, condition: str) -> bool:
    """Whether `definition` has statements containing `statement`, each under an `if` (or
    `elif`) whose test contains `condition`."""
    found = False

    def visit(node: ast.AST, guarded: bool) -> bool:
        nonlocal found
        # Simple statements (no body of their own) are what a guard is about.
        if (
            isinstance(node, ast.stmt)
            and not hasattr(node, "body")
            and statement in ast.unparse(node)
        ):
            found = True
            return guarded
        if isinstance(node, ast.If):
            inside = guarded or condition in ast.unparse(node.test)
            return all(visit(child, inside) for child in node.body) and all(
                visit(child, guarded) for child in node.orelse
            )
        return all(visit(child, guarded) for child in ast.iter_child_nodes(node))

    return visit(definition, False) and found


def _definition(source: Source, module: str, path: list[str]) -> ast.AST | None:
    """The function or class at `path` in `module`, following `from x import y` re-exports."""
    body = _parsed(source, module)
    if body is None:
        return None
    scope: list[ast.stmt] = body
    node: ast.AST | None = None
    parent: ast.AST | None = None
    for i, name in enumerate(path):
        node = next((n for n in scope if _defines(n, name)), None)
        if node is None and i == 0:
            target = _imported_from(scope, module, name)
            return None if target is None else _definition(source, target, [name, *path[1:]])
        if node is None:
            if isinstance(parent, ast.ClassDef):
                return _inherited(source, module, parent, name)
            return None
        parent = node
        scope = getattr(node, "body", [])
    return node


@functools.cache
def _parsed(source: Source, module: str) -> list[ast.stmt] | None:
    """A module's top-level statements, parsed once per source tree (gpu_model_runner.py
    alone is ~7,000 lines, and most hooks live there)."""
    text = source(module)
    return None if text is None else ast.parse(text).body


def _defines(node: ast.stmt, name: str) -> bool:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name == name
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign):
        targets = [node.target]
    return any(isinstance(t, ast.Name) and t.id == name for t in targets)


def _imported_from(scope: list[ast.stmt], module: str, name: str) -> str | None:
    for node in scope:
        if isinstance(node, ast.ImportFrom) and any(
            (alias.asname or alias.name) == name for alias in node.names
        ):
            if node.level:
                package = module.rsplit(".", node.level)[0]
                return f"{package}.{node.module}" if node.module else package
            return node.module
    return None


def _inherited(source: Source, module: str, cls: ast.ClassDef, name: str) -> ast.AST | None:
    for base_module, base in _bases(source, module, cls):
        own: ast.AST | None = next((n for n in base.body if _defines(n, name)), None)
        found = own or _inherited(source, base_module, base, name)
        if found is not None:
            return found
    return None


def _bases(source: Source, module: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
    """The class's base classes that are vLLM's own, with the module each is in."""
    scope = _parsed(source, module) or []
    bases = []
    for base in cls.bases:
        if not isinstance(base, ast.Name):
            continue
        local = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == base.id), None)
        if local is not None:
            bases.append((module, local))
            continue
        target = _imported_from(scope, module, base.id)
        if target is not None and target.startswith("vllm"):
            found = _definition(source, target, [base.id])
            if isinstance(found, ast.ClassDef):
                bases.append((_home(source, target, base.id), found))
    return bases


def _home(source: Source, module: str, name: str) -> str:
    """The module that defines `name`, following re-exports from `module`."""
    scope = _parsed(source, module) or []
    if any(_defines(n, name) for n in scope):
        return module
    target = _imported_from(scope, module, name)
    return module if target is None else _home(source, target, name)


def _members(source: Source, module: str, cls: ast.ClassDef) -> set[str]:
    members: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
        elif isinstance(node, ast.Assign):
            members |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for walked in ast.walk(cls):
        target_nodes: list[ast.expr] = []
        if isinstance(walked, ast.Assign):
            target_nodes = walked.targets
        elif isinstance(walked, ast.AnnAssign | ast.AugAssign):
            target_nodes = [walked.target]
        for target in target_nodes:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                members.add(target.attr)
    for base_module, base in _bases(source, module, cls):
        members |= _members(source, base_module, base)
    return members

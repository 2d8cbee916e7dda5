"""Build the AWS Lambda function bundle: ``dorylus package-lambda``.

The zip holds ``lambdas/``, the project modules the handler imports (found by walking imports,
not by a hand-kept list, so a new torch-free model module is picked up and an accidental torch
import is caught here rather than as an ``ImportError`` in AWS), and the manylinux wheels of
numpy and pyzmq for the Lambda runtime's Python and architecture, unpacked at the zip's root as
Lambda's ``/var/task`` expects.

Wheels must match the runtime, not this machine: Lambda's ``python3.10``/``3.11`` runtimes run
on Amazon Linux 2 (glibc 2.26), ``python3.12`` and later on Amazon Linux 2023 (glibc 2.34), so
a wheel tagged ``manylinux_2_28`` fails to load on ``python3.11`` even though it installs. The
wheels come from ``pip download --only-binary=:all: --platform ... --python-version ...
--implementation cp`` into a cache directory, or from ``--wheels DIR``.

The zip is reproducible, so that Terraform's ``source_code_hash`` changes only when the code
does: entries sorted, one fixed timestamp, fixed permissions, no directory entries, no
``__pycache__``. It is refused (and never left half-written) if it contains torch or exceeds
Lambda's limits: 50 MB zipped for a direct upload, 250 MB unzipped.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dorylus import atomic
from dorylus.errors import ConfigError, DorylusError

ZIP_LIMIT_BYTES = 50 * 1024 * 1024          # Lambda: deployment package, direct upload
UNZIPPED_LIMIT_BYTES = 250 * 1024 * 1024    # Lambda: function code + layers, unzipped
# Lambda runtime (Python version) -> glibc of the Amazon Linux it runs on.
RUNTIME_GLIBC = {"3.10": (2, 26), "3.11": (2, 26), "3.12": (2, 34), "3.13": (2, 34), "3.14": (2, 34)}
ARCHES = {"x86_64": "x86_64", "arm64": "aarch64"}   # Lambda's name -> the wheel platform's
REQUIREMENTS = ("numpy>=1.24", "pyzmq>=25")
PROJECT_PACKAGES = ("dorylus", "lambdas", "graphserver")
ENTRY = "lambdas/handler.py"
FORBIDDEN = ("torch",)
ZIP_TIME = (1980, 1, 1, 0, 0, 0)            # the zip format's earliest date
ROOT = Path(__file__).resolve().parents[1]  # holds dorylus/ and lambdas/ (a checkout or site-packages)


class BundleError(DorylusError):
    """The function bundle cannot be built: missing wheels, torch in it, or over Lambda's limits."""


@dataclass(frozen=True)
class Target:
    """A Lambda runtime: Python ``X.Y`` on ``x86_64`` or ``arm64``."""

    python: str
    arch: str

    def __post_init__(self) -> None:
        if self.python not in RUNTIME_GLIBC:
            raise ConfigError(f"--python {self.python}: Lambda has no such Python runtime; "
                              f"choose one of {', '.join(RUNTIME_GLIBC)}")
        if self.arch not in ARCHES:
            raise ConfigError(f"--arch {self.arch}: Lambda runs x86_64 or arm64 only")

    @property
    def cp(self) -> str:
        return "cp" + self.python.replace(".", "")

    @property
    def glibc(self) -> tuple[int, int]:
        return RUNTIME_GLIBC[self.python]

    @property
    def platforms(self) -> list[str]:
        """pip ``--platform`` tags whose wheels load on this runtime, newest first."""
        machine, (major, minor) = ARCHES[self.arch], self.glibc
        return [f"manylinux_{major}_{m}_{machine}" for m in range(minor, 16, -1)] + [f"manylinux2014_{machine}"]

    def accepts(self, wheel: str) -> bool:
        """Whether the wheel file name's tags are installable on this runtime."""
        parsed = _parse_wheel_name(wheel)
        if parsed is None:
            return False
        _, _, pythons, abis, platforms = parsed
        minor = int(self.python.split(".")[1])
        python_ok = any(p in (self.cp, "py3", f"py3{minor}")
                        or (re.fullmatch(r"cp3(\d+)", p) and int(p[3:]) <= minor and "abi3" in abis)
                        for p in pythons)
        abi_ok = bool({self.cp, "abi3", "none"} & set(abis))
        return python_ok and abi_ok and any(self._platform_ok(p) for p in platforms)

    def _platform_ok(self, tag: str) -> bool:
        machine = ARCHES[self.arch]
        legacy = {f"manylinux1_{machine}": (2, 5), f"manylinux2010_{machine}": (2, 12),
                  f"manylinux2014_{machine}": (2, 17)}
        if tag == "any":
            return True
        if tag in legacy:
            return legacy[tag] <= self.glibc
        match = re.fullmatch(rf"manylinux_(\d+)_(\d+)_{machine}", tag)
        return bool(match) and (int(match[1]), int(match[2])) <= self.glibc


def _parse_wheel_name(name: str) -> tuple[str, str, list[str], list[str], list[str]] | None:
    """``(distribution, version, python tags, abi tags, platform tags)`` of a wheel file name."""
    if not name.endswith(".whl"):
        return None
    parts = name[:-4].split("-")
    if len(parts) not in (5, 6):
        return None
    dist, version, py, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
    return dist.lower().replace("_", "-"), version, py.split("."), abi.split("."), plat.split(".")


def _version_key(version: str) -> tuple:
    release = re.match(r"\d+(\.\d+)*", version)
    numbers = tuple(int(x) for x in release[0].split(".")) if release else ()
    return numbers, release is not None and release.end() == len(version)  # a final release beats its rcs


def select_wheels(directory: Path, target: Target, requirements=REQUIREMENTS) -> list[Path]:
    """The newest wheel in ``directory`` of each requirement's distribution that installs on
    ``target`` (version specifiers are pip's business when downloading; here the name matters)."""
    if not directory.is_dir():
        raise ConfigError(f"--wheels {directory}: not a directory")
    chosen = []
    for requirement in requirements:
        dist = re.match(r"[A-Za-z0-9._-]+", requirement)[0].lower().replace("_", "-")
        candidates = [p for p in directory.iterdir()
                      if (parsed := _parse_wheel_name(p.name)) and parsed[0] == dist and target.accepts(p.name)]
        if not candidates:
            raise BundleError(f"no {dist} wheel for Lambda Python {target.python} {target.arch} "
                              f"(glibc {target.glibc[0]}.{target.glibc[1]}) in {directory}")
        chosen.append(max(candidates, key=lambda p: _version_key(_parse_wheel_name(p.name)[1])))
    return chosen


def download_wheels(target: Target, cache_dir: Path, requirements=REQUIREMENTS) -> list[Path]:
    """Wheels for ``target``, downloaded by pip into ``cache_dir/<cp>-<arch>`` on first use;
    later builds reuse them, which is what makes two builds give the same bytes."""
    directory = cache_dir / f"{target.cp}-{target.arch}"
    try:
        return select_wheels(directory, target, requirements)
    except (BundleError, ConfigError):
        pass
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
               "--only-binary=:all:", "--implementation", "cp", "--python-version", target.python,
               *(arg for tag in target.platforms for arg in ("--platform", tag)),
               "--dest", str(directory), *requirements]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [ln for ln in result.stderr.splitlines() if ln.strip() and "is ignored" not in ln]
        raise BundleError(f"pip download of {' '.join(requirements)} for Lambda Python {target.python} "
                          f"{target.arch} failed: {' '.join(lines[-3:]) or 'no message'} "
                          f"(no network? pass --wheels DIR with wheels downloaded elsewhere)")
    return select_wheels(directory, target, requirements)


# ----------------------------------------------------------------------------- import walking


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _catches_import_error(node: ast.Try) -> bool:
    names = []
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names += [getattr(k, "id", getattr(k, "attr", None)) for k in kinds]
    return bool({"ImportError", "ModuleNotFoundError"} & set(names))


class _Imports(ast.NodeVisitor):
    """What one file imports, as ``(module, eager)`` pairs: eager imports run when the file is
    imported; lazy ones sit inside a function body and run only if it is called (that is how
    the torch twins of the models stay out of the function). Imports in ``try: ... except
    ImportError`` are optional and never required; those under ``if TYPE_CHECKING:`` never run.
    A string constant naming a project module counts as a lazy import: registries such as
    ``dorylus.models.MODELS`` load their modules by name."""

    def __init__(self, package: str):
        self.package = package
        self.imports: set[tuple[str, bool]] = set()
        self.optional: set[str] = set()
        self._function_depth = 0
        self._optional_depth = 0

    def _add(self, name: str) -> None:
        if self._optional_depth:
            self.optional.add(name)
        else:
            self.imports.add((name, self._function_depth == 0))

    def _visit_function(self, node) -> None:
        for decorator in getattr(node, "decorator_list", ()):
            self.visit(decorator)
        self._function_depth += 1
        for child in (node.body if isinstance(node.body, list) else [node.body]):
            self.visit(child)
        self._function_depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        guarded = _catches_import_error(node)
        self._optional_depth += guarded
        for child in node.body:
            self.visit(child)
        self._optional_depth -= guarded
        for child in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        self._add(module)
        for alias in node.names:  # `from package import submodule`
            self._add(f"{module}.{alias.name}")

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and re.fullmatch(rf"({'|'.join(PROJECT_PACKAGES)})(\.\w+)+", node.value):
            self.imports.add((node.value, False))


@dataclass(frozen=True)
class ImportWalk:
    """The outcome of :func:`walk_imports`."""

    files: list[Path]        # project files to bundle, sorted
    external: set[str]       # top-level names of non-project modules imported eagerly
    left_out: list[str]      # project modules imported only lazily that would need torch


class _Graph:
    """Project modules under ``root`` and their import edges, parsed on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._parsed: dict[Path, tuple[list[tuple[Path, bool]], set[str], set[str]]] = {}

    def files_of(self, module: str) -> list[Path]:
        """The files importing ``module`` runs: each package's ``__init__`` on the way, then it."""
        pieces, found = module.split("."), []
        for i in range(1, len(pieces) + 1):
            path = _module_file(self.root, ".".join(pieces[:i]))
            if path is not None:
                found.append(path)
        return found

    def edges(self, path: Path) -> tuple[list[tuple[Path, bool]], set[str], set[str]]:
        """(project files imported, eager?), eager external top-level names, forbidden names
        imported eagerly and not optionally."""
        if path not in self._parsed:
            name = _module_name(self.root, path)
            visitor = _Imports(name if path.name == "__init__.py" else name.rpartition(".")[0])
            visitor.visit(ast.parse(path.read_bytes(), filename=str(path)))
            # Importing a.b.c runs a/__init__ and a/b/__init__ first.
            project = [(f, True) for f in self.files_of(name.rpartition(".")[0]) if f != path] if "." in name else []
            external, forbidden = set(), set()
            for module, eager in sorted(visitor.imports):
                top = module.split(".")[0]
                if top in PROJECT_PACKAGES:
                    project += [(f, eager) for f in self.files_of(module) if f != path]
                elif eager and top not in sys.stdlib_module_names and top != "__future__":
                    (forbidden if top in FORBIDDEN else external).add(top)
            self._parsed[path] = (project, external, forbidden)
        return self._parsed[path]

    def eager_closure(self, start: Path) -> dict[Path, Path | None]:
        """Every file that importing ``start`` runs, each mapped to the file that imported it."""
        parents: dict[Path, Path | None] = {start: None}
        queue = [start]
        while queue:
            path = queue.pop()
            for target, eager in self.edges(path)[0]:
                if eager and target not in parents:
                    parents[target] = path
                    queue.append(target)
        return parents

    def torch_chain(self, closure: dict[Path, Path | None]) -> tuple[str, list[str]] | None:
        """(forbidden module, import chain) if any file of ``closure`` imports one eagerly."""
        for path in sorted(closure):
            forbidden = self.edges(path)[2]
            if forbidden:
                chain, at = [], path
                while at is not None:
                    chain.append(str(at.relative_to(self.root)))
                    at = closure[at]
                return sorted(forbidden)[0], chain
        return None


def walk_imports(root: Path = ROOT, entry: str = ENTRY) -> ImportWalk:
    """The project files the function needs, starting from ``entry``.

    Everything ``entry`` imports eagerly (transitively) is bundled, and must not need torch:
    that raises :class:`BundleError` naming the chain of imports. A module imported only inside
    a function is bundled too if it (with its eager imports) is torch-free, and otherwise left
    out: calling that function in Lambda would fail, which is the point of importing it lazily.
    """
    start = root / entry
    if not start.is_file():
        raise ConfigError(f"function entry point {start} does not exist")
    graph = _Graph(root)
    included = graph.eager_closure(start)
    found = graph.torch_chain(included)
    if found:
        module, chain = found
        raise BundleError(f"the function would need {module}: imported by {' <- '.join(chain)}; "
                          f"the Lambda bundle must stay free of {', '.join(FORBIDDEN)}")
    left_out: set[Path] = set()
    queue = list(included)
    while queue:
        for target, eager in graph.edges(queue.pop())[0]:
            if eager or target in included or target in left_out:
                continue
            closure = graph.eager_closure(target)
            if graph.torch_chain(closure):
                left_out.add(target)
                continue
            for path, parent in closure.items():
                if path not in included:
                    included[path] = parent
                    queue.append(path)
    external = set().union(*(graph.edges(p)[1] for p in included))
    return ImportWalk(files=sorted(included, key=lambda p: p.relative_to(root).as_posix()), external=external,
                      left_out=sorted(str(p.relative_to(root)) for p in left_out))


# ----------------------------------------------------------------------------- the zip


@dataclass(frozen=True)
class Bundle:
    path: Path
    zipped_bytes: int
    unzipped_bytes: int
    sha256: str
    entries: int
    left_out: list[str]     # project modules imported only inside functions that need torch


def _wheel_entries(wheel: Path) -> dict[str, tuple[Path, str]]:
    """Archive name -> (wheel, member) for what ``pip install`` would put in site-packages:
    ``*.data/purelib`` and ``platlib`` go to the root; scripts, headers and data are left out."""
    out = {}
    with zipfile.ZipFile(wheel) as z:
        for member in z.namelist():
            if member.endswith("/"):
                continue
            if member.startswith("/") or ".." in member.split("/") or "\\" in member:
                raise BundleError(f"{wheel.name}: refusing member {member!r}, which would land outside the bundle")
            top, _, rest = member.partition("/")
            if top.endswith(".data"):
                kind, _, rest = rest.partition("/")
                if kind not in ("purelib", "platlib"):
                    continue
                out[rest] = (wheel, member)
            else:
                out[member] = (wheel, member)
    return out


def _mode(name: str) -> int:
    return 0o755 if re.search(r"\.so(\.|$)", name) else 0o644


def build_bundle(out: Path, wheels: list[Path], *, root: Path = ROOT, entry: str = ENTRY,
                 zip_limit: int = ZIP_LIMIT_BYTES, unzipped_limit: int = UNZIPPED_LIMIT_BYTES) -> Bundle:
    """Write the function zip to ``out`` (atomically: a temp file beside it, then a rename).

    ``wheels`` are unpacked at the root; project files come from walking ``entry``'s imports
    under ``root``. Raises :class:`BundleError` (and writes nothing) if torch would be bundled,
    a needed module is in no wheel, or the zip is over ``zip_limit`` / ``unzipped_limit``.
    """
    walk = walk_imports(root, entry)
    sources: dict[str, tuple[Path, str | None]] = {}
    for wheel in wheels:
        for name, source in _wheel_entries(wheel).items():
            if name in sources:
                raise BundleError(f"{name} is in both {sources[name][0].name} and {wheel.name}")
            sources[name] = source
    for path in walk.files:
        sources[path.relative_to(root).as_posix()] = (path, None)

    tops = {name.split("/")[0].removesuffix(".py") for name in sources}
    bad = sorted(t for t in tops if t.split("-")[0].lower() in FORBIDDEN)
    if bad:
        raise BundleError(f"refusing to bundle {', '.join(bad)}: the Lambda bundle must stay free of "
                          f"{', '.join(FORBIDDEN)}")
    missing = sorted(walk.external - tops)
    if missing:
        raise BundleError(f"the function imports {', '.join(missing)}, which no bundled wheel provides "
                          f"(wheels: {', '.join(w.name for w in wheels) or 'none'})")

    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give the zip's file name")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: directory {out.parent} does not exist")
    unzipped = 0
    # 0644: the zip is uploaded and shared, not a secret.
    with atomic.writing(out, mode=0o644) as f:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as z:
            open_wheels: dict[Path, zipfile.ZipFile] = {}
            try:
                for name in sorted(sources):
                    origin, member = sources[name]
                    if member is None:
                        data = origin.read_bytes()
                    else:
                        if origin not in open_wheels:
                            open_wheels[origin] = zipfile.ZipFile(origin)
                        data = open_wheels[origin].read(member)
                    unzipped += len(data)
                    if unzipped > unzipped_limit:
                        raise BundleError(f"the bundle unzips to more than {unzipped_limit:,} bytes "
                                          f"(Lambda's limit for function code); nothing written")
                    info = zipfile.ZipInfo(name, ZIP_TIME)
                    info.create_system = 3  # unix, so that external_attr holds permissions
                    info.external_attr = (0o100000 | _mode(name)) << 16
                    info.compress_type = zipfile.ZIP_DEFLATED
                    z.writestr(info, data, compresslevel=6)
            finally:
                for w in open_wheels.values():
                    w.close()
        size = f.tell()
        if size > zip_limit:
            raise BundleError(f"the bundle is {size:,} bytes zipped, over the {zip_limit:,} bytes Lambda "
                              f"accepts as a direct upload; nothing written")
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    return Bundle(path=out, zipped_bytes=size, unzipped_bytes=unzipped, sha256=digest, entries=len(sources),
                  left_out=walk.left_out)


def cache_home() -> Path:
    """Dorylus's cache directory (downloaded wheels, partition stores fetched from S3):
    ``$DORYLUS_CACHE_DIR``, else ``$XDG_CACHE_HOME/dorylus``, else ``~/.cache/dorylus``."""
    if os.environ.get("DORYLUS_CACHE_DIR"):
        return Path(os.environ["DORYLUS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "dorylus"


def package_lambda(out: Path, *, python: str, arch: str, wheels_dir: Path | None = None,
                   cache_dir: Path | None = None) -> Bundle:
    """``dorylus package-lambda``: wheels from ``wheels_dir`` (no network) or downloaded into
    ``cache_dir``, then :func:`build_bundle`."""
    target = Target(python, arch)
    if wheels_dir is not None:
        wheels = select_wheels(Path(wheels_dir), target)
    else:
        wheels = download_wheels(target, Path(cache_dir) if cache_dir else cache_home() / "wheels")
    return build_bundle(Path(out), wheels)


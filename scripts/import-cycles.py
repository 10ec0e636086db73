#!/usr/bin/env python3
"""Import cycles among the source files of the crate, as drawn from their `use` and path
references: prints every group of files (under each directory given, default `src`) that
import one another in a cycle, and exits non-zero when there is one.

A file imports the module files its `crate::`, `super::` and `self::` paths resolve to; a path
that ends at a name a module re-exports (`pub use child::Name`) resolves to the child that
defines it, since such a re-export is a facade, not a dependency of the parent. Test modules
(`#[cfg(test)] mod tests`) are left out.

    scripts/import-cycles.py src/model src/actors src/kernels/qmatmul
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"


def module_of(path: Path) -> list[str]:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return parts


def file_of(module: list[str]) -> Path | None:
    base = SRC.joinpath(*module) if module else SRC
    if not module:
        return SRC / "lib.rs"
    for candidate in (base.with_suffix(".rs"), base / "mod.rs"):
        if candidate.is_file():
            return candidate
    return None


def source(path: Path) -> str:
    text = path.read_text()
    test = re.search(r"#\[cfg\(test\)\]\s*mod \w+\s*\{", text)
    if test:
        text = text[: test.start()]
    text = re.sub(r"//[^\n]*", "", text)
    return text


def expand(tree: str) -> list[str]:
    """`a::{b, c::{d, e}}` as `a::b`, `a::c::d`, `a::c::e`."""
    tree = tree.replace(" ", "").replace("\n", "")
    depth, start = 0, None
    for i, ch in enumerate(tree):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                prefix, inner = tree[:start], tree[start + 1 : i]
                parts, level, last = [], 0, 0
                for j, c in enumerate(inner):
                    if c == "{":
                        level += 1
                    elif c == "}":
                        level -= 1
                    elif c == "," and level == 0:
                        parts.append(inner[last:j])
                        last = j + 1
                parts.append(inner[last:])
                return [p for part in parts if part for p in expand(prefix + part)]
    return [tree]


def reexports(path: Path) -> dict[str, str]:
    """Names a module file re-exports from its own children: name -> child."""
    out = {}
    for m in re.finditer(r"pub(?:\([^)]*\))?\s+use\s+([^;]+);", source(path)):
        for p in expand(m.group(1)):
            segs = p.split("::")
            if len(segs) >= 2 and segs[0] not in ("crate", "super", "self"):
                name = segs[-1].split("as")[-1]
                out[name] = segs[0]
    return out


def resolve(current: list[str], path: str) -> Path | None:
    segs = [s for s in path.split("::") if s]
    if segs[0] == "crate":
        module, segs = [], segs[1:]
    elif segs[0] == "self":
        module, segs = list(current), segs[1:]
    else:
        module = list(current)
        while segs and segs[0] == "super":
            module = module[:-1]
            segs = segs[1:]
    found = file_of(module)
    for seg in segs:
        deeper = file_of(module + [seg])
        if deeper is None:
            if found is not None:
                child = reexports(found).get(seg)
                if child and file_of(module + [child]):
                    found = file_of(module + [child])
            break
        module.append(seg)
        found = deeper
    return found


def imports(path: Path) -> set[Path]:
    text = source(path)
    current = module_of(path)
    paths = []
    for m in re.finditer(r"(?<!pub )(?<!pub\(crate\) )\buse\s+([^;]+);", text):
        paths += expand(m.group(1))
    paths += re.findall(r"(?<![\w:])((?:crate|super|self)(?:::\w+)+)", text)
    out = set()
    for p in paths:
        if not p.split("::")[0] in ("crate", "super", "self"):
            continue
        target = resolve(current, p)
        if target is not None and target != path:
            out.add(target)
    return out


def cycles(files: list[Path]) -> list[list[Path]]:
    graph = {f: imports(f) & set(files) for f in files}
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for f in files:
        if f not in index:
            visit(f)
    return out


def main() -> int:
    dirs = [Path(d).resolve() for d in sys.argv[1:]] or [SRC]
    found = False
    for d in dirs:
        files = sorted(d.rglob("*.rs"))
        groups = cycles(files)
        name = d.relative_to(ROOT)
        if not groups:
            print(f"{name}: no import cycle among {len(files)} files")
        for g in groups:
            found = True
            print(f"{name}: cycle among " + ", ".join(str(f.relative_to(ROOT)) for f in g))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

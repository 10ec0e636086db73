#!/usr/bin/env python3
"""Code-completion prompts from the local Python installation's standard library, disjoint
from HumanEval: each is one public top-level function's signature and docstring, written the
way HumanEval poses a problem, for the SLM to complete (`tokenrouter train-router --prompts`).

Usage: stdlib-prompts.py OUT.jsonl [--max-docstring CHARS] [--exclude HumanEval.jsonl]
--exclude drops functions named like an evaluation problem's entry point (statistics.median
and HumanEval's `median` are different functions, but a shared name is kept out anyway).
One JSON object per line, {"prompt": ..., "source": "module.function"}, in a fixed order.
"""
import argparse
import ast
import json
import pathlib
import sys
import sysconfig


def prompts(stdlib: pathlib.Path, max_docstring: int):
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        # Tests, third-party packages and demos are not library functions.
        if any(p in ("test", "tests", "site-packages", "idlelib", "lib2to3") for p in rel.parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        module = ".".join(rel.with_suffix("").parts)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) > max_docstring or not node.body:
                continue
            first = node.body[0]
            if node.decorator_list or first.end_lineno is None:
                continue
            # From the `def` line through the docstring's last line, as written.
            text = "".join(lines[node.lineno - 1 : first.end_lineno])
            if '"""' not in text and "'''" not in text:
                continue
            yield {"prompt": text.rstrip() + "\n", "source": f"{module}.{node.name}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--max-docstring", type=int, default=600)
    parser.add_argument("--exclude", help="JSONL of problems with an entry_point field")
    args = parser.parse_args()
    excluded = set()
    if args.exclude:
        with open(args.exclude, encoding="utf-8") as f:
            excluded = {json.loads(line)["entry_point"] for line in f if line.strip()}
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    if not stdlib.is_dir():
        sys.exit(f"stdlib-prompts: no Python standard library at '{stdlib}'")
    count = 0
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as out:
        for p in prompts(stdlib, args.max_docstring):
            if p["source"].rsplit(".", 1)[-1] in excluded:
                continue
            out.write(json.dumps(p) + "\n")
            count += 1
    print(f"stdlib-prompts: {count} prompts from {stdlib} in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

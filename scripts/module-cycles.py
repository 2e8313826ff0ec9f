#!/usr/bin/env python3
"""Finds import cycles between the modules of each crate, and source files
over the size limit.

For every crate (each `crates/*/src` and the binary's `src/`), the graph has
one node per module at each level: the crate's top-level modules, and below
any module with children, those children. An edge A -> B means non-test code
in A's files names B through `crate::B` (or `super::B` from a child) or
through an item the crate root re-exports from B. A module that reaches one
of its ancestors' siblings by way of the root is counted at the level where
both meet. Test code (`tests.rs` files, `#[cfg(test)] mod tests` blocks) may
reach anywhere and is left out.

A glob import of a parent (`use super::*`) hides which of its names a
module uses, and so the edges above: outside test code it is refused too.

Exit status 1 on a cycle, a glob import of a parent outside tests, or an
oversized hand-written file; the report names each. Usage: scripts/module-cycles.py [--max-lines 800]
"""
import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USE_RE = re.compile(r"\buse\s+(crate|super)::(.*?);", re.S)
PATH_RE = re.compile(r"\b(crate|super)::([A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*)")
TEST_BLOCK_RE = re.compile(r"#\[cfg\(test\)\]\s*(pub(\(crate\))?\s+)?mod\s+\w+\s*\{")
GLOB_SUPER_RE = re.compile(r"\buse\s+super::\*\s*;")
TEST_DECL_RE = re.compile(r"#\[cfg\(test\)\]\s*(pub(\(crate\))?\s+)?mod\s+\w+\s*;")


def crates():
    out = []
    for name in sorted(os.listdir(os.path.join(ROOT, "crates"))):
        src = os.path.join(ROOT, "crates", name, "src")
        if os.path.isdir(src):
            out.append((name, src))
    out.append(("envelope-kernels", os.path.join(ROOT, "kernels", "src")))
    out.append(("envelope (bin)", os.path.join(ROOT, "src")))
    return out


def module_path(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("lib", "main") and len(rel) == 1:
        return []
    if rel[-1] == "mod":
        rel = rel[:-1]
    return rel


def strip_tests(text):
    """Drops `#[cfg(test)] mod x { ... }` blocks (brace-matched) and comments."""
    text = re.sub(r"//[^\n]*", "", text)
    out, i = [], 0
    for m in TEST_BLOCK_RE.finditer(text):
        if m.start() < i:
            continue
        out.append(text[i : m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def expand(tree):
    """`a::{b, c::{d, e}}` -> [[a, b], [a, c, d], [a, c, e]]"""
    tree = re.sub(r"\s+", "", tree)
    if "{" not in tree:
        return [[p for p in tree.split("::") if p and p != "self"]]
    head, rest = tree.split("{", 1)
    rest = rest[: rest.rfind("}")]
    parts, depth, cur = [], 0, ""
    for ch in rest:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    parts.append(cur)
    prefix = [p for p in head.split("::") if p]
    out = []
    for p in parts:
        if p.strip():
            for tail in expand(p):
                out.append(prefix + tail)
    return out


def root_reexports(src):
    """Item name -> top-level module, from the crate root's `pub use`."""
    names = {}
    for root in ("lib.rs", "main.rs"):
        path = os.path.join(src, root)
        if not os.path.exists(path):
            continue
        text = strip_tests(open(path).read())
        for m in re.finditer(r"\bpub\s+use\s+(.*?);", text, re.S):
            for parts in expand(m.group(1)):
                parts = [p.split(" as ")[0] for p in parts]
                if parts and parts[0] == "crate":
                    parts = parts[1:]
                if len(parts) >= 2:
                    names[parts[-1]] = parts[0]
    return names


def references(text, here, modules):
    """Absolute module paths (lists) named from the module at `here`."""
    refs = []
    for m in USE_RE.finditer(text):
        for parts in expand(m.group(2)):
            refs.append((m.group(1), [p.split(" as ")[0] for p in parts]))
    body = USE_RE.sub("", text)
    for m in PATH_RE.finditer(body):
        refs.append((m.group(1), m.group(2).split("::")))
    out = []
    for kind, parts in refs:
        if kind == "super":
            base = here[:-1]
            while parts and parts[0] == "super":
                base, parts = base[:-1], parts[1:]
            parts = base + parts
        out.append(parts)
    return out


def resolve(parts, modules, reexports):
    """Longest prefix of `parts` that is a module, or the re-exported item's module."""
    best = None
    for n in range(len(parts), 0, -1):
        if tuple(parts[:n]) in modules:
            best = list(parts[:n])
            break
    if best is None and parts and parts[0] in reexports:
        best = [reexports[parts[0]]]
    return best


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    nodes = sorted(set(graph) | {m for v in graph.values() for m in v})

    def visit(n):
        index[n] = low[n] = len(index)
        stack.append(n)
        on.add(n)
        for m in sorted(graph.get(n, ())):
            if m not in index:
                visit(m)
                low[n] = min(low[n], low[m])
            elif m in on:
                low[n] = min(low[n], index[m])
        if low[n] == index[n]:
            comp = []
            while True:
                m = stack.pop()
                on.discard(m)
                comp.append(m)
                if m == n:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for n in nodes:
        if n not in index:
            visit(n)
    return out


def check_crate(name, src):
    files = {}
    for dirpath, _, filenames in os.walk(src):
        for f in filenames:
            if f.endswith(".rs"):
                path = os.path.join(dirpath, f)
                files[path] = module_path(src, path)
    modules = {tuple(m) for m in files.values()}
    # Inline `mod x {` blocks are rare here and are treated as part of their file.
    reexports = root_reexports(src)
    edges, globs = {}, []
    for path, here in files.items():
        if os.path.basename(path) == "tests.rs" or (here and here[-1] == "tests"):
            continue
        text = strip_tests(open(path).read())
        text = TEST_DECL_RE.sub("", text)
        if GLOB_SUPER_RE.search(text):
            globs.append(os.path.relpath(path, ROOT))
        for parts in references(text, here, modules):
            target = resolve(parts, modules, reexports)
            if not target or not here:
                continue
            # Compare at the level where the two paths part.
            k = 0
            while k < min(len(here), len(target)) and here[k] == target[k]:
                k += 1
            if k == len(here) or k == len(target):
                continue  # a module and its own ancestor or descendant
            a, b = tuple(here[: k + 1]), tuple(target[: k + 1])
            edges.setdefault(a, set()).add(b)
    return cycles(edges), sum(len(v) for v in edges.values()), globs


def oversized(max_lines):
    out = []
    for base in [os.path.join(ROOT, "crates"), os.path.join(ROOT, "src"), os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]:
        for dirpath, _, filenames in os.walk(base):
            if "/target" in dirpath:
                continue
            for f in filenames:
                if f.endswith((".rs", ".py", ".sh")):
                    path = os.path.join(dirpath, f)
                    n = sum(1 for _ in open(path, errors="replace"))
                    if n > max_lines:
                        out.append((os.path.relpath(path, ROOT), n))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-lines", type=int, default=800)
    args = ap.parse_args()
    bad = False
    for name, src in crates():
        found, n, globs = check_crate(name, src)
        for path in globs:
            bad = True
            print(f"{path}: `use super::*` outside tests (name what it uses)")
        for comp in found:
            bad = True
            print(f"{name}: modules that import each other: " + ", ".join("::".join(m) for m in comp))
        if not found:
            print(f"{name}: {n} module edges, no cycle")
    for path, n in oversized(args.max_lines):
        bad = True
        print(f"{path}: {n} lines (limit {args.max_lines})")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

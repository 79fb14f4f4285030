#!/usr/bin/env python3
"""One-way layering (docs/design.md §2): a folder of src/ includes only the folders below it, the
library never includes the test oracle, and tools see the public API plus the harness.

    python3 tests/layering/check.py [repo root]     # exit 1 and one line per upward include
    python3 tests/layering/check.py --self-test     # the check reports a planted violation
"""
import pathlib
import re
import sys

LIBRARY = ["core", "formats", "protocol", "math"]  # each may include itself and those before it
ALLOWED = {folder: set(LIBRARY[: i + 1]) for i, folder in enumerate(LIBRARY)}
ALLOWED["host"] = set(LIBRARY) | {"host"}
ALLOWED["cuda"] = set(LIBRARY) | {"cuda"}
ALLOWED["api"] = set(LIBRARY) | {"host", "cuda", "api"}
ALLOWED["reference"] = set(LIBRARY) | {"reference"}  # the oracle sits beside the executors
ALLOWED["harness"] = set(ALLOWED["api"]) | {"reference", "harness"}
ALLOWED["tools"] = {"harness", "reference"}  # plus include/epmoe and tools' own headers
ALLOWED["python"] = set()  # the bindings: include/epmoe and tools' `epmoe run` only

INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/[^"]+"', re.M)
SOURCES = ("*.hpp", "*.cpp", "*.cu", "*.cuh", "*.h")


def layer_of(path: pathlib.Path, root: pathlib.Path) -> str | None:
    parts = path.relative_to(root).parts
    if parts[0] == "src":
        return parts[1]
    if parts[0] in ("tools", "python"):
        return parts[0]
    return None


def violations(root: pathlib.Path) -> list[str]:
    known = set(ALLOWED)
    found = []
    for top in ("src", "tools", "python"):
        for pattern in SOURCES:
            for path in sorted((root / top).rglob(pattern)):
                layer = layer_of(path, root)
                if layer not in ALLOWED:
                    found.append(f"{path.relative_to(root)}: folder src/{layer} has no rule here")
                    continue
                for folder in INCLUDE.findall(path.read_text(errors="replace")):
                    if folder == "epmoe" or folder not in known or folder in ALLOWED[layer]:
                        continue
                    found.append(f"{path.relative_to(root)}: {layer}/ must not include {folder}/")
    return found


def self_test() -> int:
    """The check must be able to fail: a tree whose core/ includes cuda/ and whose library
    includes the oracle has to be reported, line by line."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "src/core").mkdir(parents=True)
        (root / "src/cuda").mkdir(parents=True)
        (root / "src/core/config.cpp").write_text('#include "cuda/kernels.hpp"\n')
        (root / "src/cuda/layer.cpp").write_text('#include "reference/quantize.hpp"\n')
        (root / "src/cuda/ok.cpp").write_text('#include "protocol/wire.hpp"\n#include "epmoe/x.hpp"\n')
        bad = violations(root)
    expected = ["src/core/config.cpp: core/ must not include cuda/",
                "src/cuda/layer.cpp: cuda/ must not include reference/"]
    print("\n".join(bad))
    print("self-test:", "ok" if bad == expected else f"FAILED, expected {expected}")
    return 0 if bad == expected else 1


def main() -> int:
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    bad = violations(root)
    for line in bad:
        print(line)
    print(f"layering: {len(bad)} upward include(s)" if bad else "layering: ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

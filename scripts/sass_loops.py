#!/usr/bin/env python3
"""Instruction counts of the tensor-core loops of compiled kernels: a CPU-side proxy for a kernel
whose time goes to issuing instructions (session 20 found a loop of 649 instructions per k tile
this way, a third of them address math and generic 64-bit loads of shared memory).

For every kernel in the SASS, each innermost loop (a backward branch) that holds an MMA (HGMMA, QGMMA or HMMA
instruction, and each that holds asynchronous copies (cp.async, TMA) but no MMA (a producer warp's
loop, marked "copies"), is printed with its static instruction count and its most frequent
opcodes, and a warning where
the loop reads or writes memory through generic addresses (LD / ST, not LDS / STS / LDG / STG:
shared memory the compiler could not prove shared, or global memory behind pointers it loaded).

  scripts/sass_loops.py build/x/packed_gemm.cubin --kernel packed_gemm
  nvcc ... -cubin -o k.cubin src/cuda/experts/wgmma/packed_gemm.cu && scripts/sass_loops.py k.cubin

It needs cuobjdump: the CUDA toolkit's, or PyPI's nvidia-cuda-cuobjdump wheel unpacked anywhere
(`pip download --no-deps nvidia-cuda-cuobjdump` then `python3 -m zipfile -e <wheel> dir`), given
by --cuobjdump or the CUOBJDUMP environment variable. A text file of SASS is read as it is.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys


def sass_text(path, cuobjdump):
    if path.endswith(".sass") or path.endswith(".txt"):
        with open(path) as f:
            return f.read()
    tool = cuobjdump or os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not tool:
        sys.exit("sass_loops.py: no cuobjdump (give --cuobjdump or set CUOBJDUMP)")
    return subprocess.run([tool, "-sass", path], check=True, capture_output=True,
                          text=True).stdout


def opcode(instruction):
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binary", help="cubin, object, library or executable (or a .sass text)")
    parser.add_argument("--kernel", default="", help="only kernels whose name contains this")
    parser.add_argument("--cuobjdump", default="", help="path of cuobjdump")
    parser.add_argument("--top", type=int, default=12, help="opcodes shown per loop")
    args = parser.parse_args()

    functions = re.split(r"\n\s*Function : ", sass_text(args.binary, args.cuobjdump))[1:]
    for function in functions:
        name = function.split("\n")[0].strip()
        if args.kernel not in name:
            continue
        code = [(int(a, 16), i.strip())
                for a, i in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", function)]
        loops = set()
        for address, instruction in code:
            target = re.search(r"\bBRA (0x[0-9a-f]+)", instruction)
            if target and int(target.group(1), 16) < address:
                loops.add((int(target.group(1), 16), address))
        def holds(loop, pattern):
            return any(re.search(pattern, i) for a, i in code if loop[0] <= a <= loop[1])

        def innermost(selected):  # a loop around another selected loop (a tile loop) is left out
            return [l for l in selected
                    if not any(o != l and l[0] <= o[0] and o[1] <= l[1] for o in selected)]

        mma = r"\b(H|Q)G?MMA\b"  # bf16 and FP8 WGMMA, mma.sync
        kinds = {loop: "" for loop in innermost([l for l in loops if holds(l, mma)])}
        # a warp-specialized producer's loop: asynchronous copies (cp.async, TMA) and no MMA
        for loop in innermost([l for l in loops
                               if holds(l, r"\b(LDGSTS|UTMALDG|UBLKCP)\b") and not holds(l, mma)]):
            kinds.setdefault(loop, " (copies)")
        printed_name = False
        for first, last in sorted(kinds):
            body = [i for a, i in code if first <= a <= last]
            if not printed_name:
                print(f"{name}  ({len(code)} instructions)")
                printed_name = True
            mix = collections.Counter(opcode(i) for i in body)
            generic = sum(1 for i in body if re.search(r"\b(LD|ST)\.E", i))
            top = ", ".join(f"{op} {n}" for op, n in mix.most_common(args.top))
            print(f"  loop {first:#x}..{last:#x}{kinds[(first, last)]}: {len(body)} instructions: "
                  f"{top}")
            if generic:
                print(f"    {generic} generic LD/ST in the loop (shared memory through a generic "
                      "pointer?)")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # | head
        sys.stderr.close()

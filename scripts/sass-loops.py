#!/usr/bin/env python3
"""Static instruction census of the GEMM mainloops, no GPU needed.

For each kernel of a cubin whose name matches the regex, every loop (a backward branch and
its target in `cuobjdump --dump-sass`) that holds tensor-core instructions (HMMA, HGMMA) or
cp.async (LDGSTS), with its instruction count and how many of them are HMMA, HGMMA, ldmatrix
(LDSM) and LDGSTS: the instructions issued per K slice, against the MMAs they feed. Nested
loops are listed too; the smallest one holding the MMAs is the mainloop.

    eval "$(scripts/install-cuda-tools.sh --quiet)"
    ptxas -arch=sm_90 target/release/build/grng-*/out/kron.ptx -o /tmp/kron.cubin
    scripts/sass-loops.py /tmp/kron.cubin '_tc$'
"""
import re
import subprocess
import sys

if len(sys.argv) < 2:
    sys.exit("usage: sass-loops.py CUBIN [KERNEL_REGEX]")
pattern = re.compile(sys.argv[2]) if len(sys.argv) > 2 else None
sass = subprocess.run(["cuobjdump", "--dump-sass", sys.argv[1]], capture_output=True,
                      text=True, check=True).stdout
for func in re.split(r"\n\s+Function : ", sass)[1:]:
    name = func.split("\n", 1)[0].strip()
    if pattern and not pattern.search(name):
        continue
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", func)]
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    rows = []
    for i, (addr, text) in enumerate(ins):
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if not target or int(target.group(1), 16) > addr or int(target.group(1), 16) not in index:
            continue
        start = index[int(target.group(1), 16)]
        body = [t for _, t in ins[start:i + 1]]
        count = {op: sum(1 for t in body if re.search(r"(^|\s)" + op + r"(\.|\s|$)", t))
                 for op in ("HMMA", "HGMMA", "LDSM", "LDGSTS")}
        if count["HMMA"] or count["HGMMA"] or count["LDGSTS"]:
            rows.append((len(body), ins[start][0], count))
    print(name)
    for n, addr, c in sorted(rows):
        print(f"  loop@{addr:#07x}: {n:5d} instructions  " +
              "  ".join(f"{op} {c[op]:3d}" for op in ("HMMA", "HGMMA", "LDSM", "LDGSTS")))

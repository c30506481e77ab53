#!/usr/bin/env python3
"""`tessera cost` output (stdin) as the markdown table of kernels/README.md.

    TESSERA_PYTHON=.venv/bin/python target/release/tessera cost --all --dtype bf16 | python3 scripts/cost_table.py

One row per kernel row of the CLI: cycles with what XLA adds around the call, bundles,
vector/scalar spills, VMEM, time, roofline %, and the bound with its note (the IR's model
where libtpu's estimate is blind or missing, and why).
"""
import sys


def thousands(text):
    return f"{int(text):,}" if text.isdigit() else text


def main():
    print("| target | kernel (bf16, default case and blocks) | cycles (+XLA around) | bundles | spills v/s | VMEM MiB | time us | roofline % | bound | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = 0
    for line in sys.stdin:
        cols = line.split()
        if len(cols) < 4 or cols[0] not in ("v4", "v5e", "v5p", "v6e", "tpu7x") or cols[1] == "kernel":
            continue
        target, kernel = cols[0], cols[1]
        rows += 1
        if cols[3] == "REJECT":
            print(f"| {target} | {kernel} | - | - | - | - | - | - | rejected | {' '.join(cols[4:])} |")
            continue
        (cycles, outside, bundles, vspill, sspill, vmem, _est, _mxu, _hbm, time, roofline), rest = cols[3:14], cols[14:]
        bound, note = rest[0], " ".join(rest[1:])
        if cycles == "-" and bundles == "-":
            # No profile at all: the row is the IR's model, and the CLI says why.
            bound, note = "model", " ".join(rest).removeprefix("no estimate (the IR's model): ")
        elif "(libtpu's estimate cannot see" in note:
            bound, note = f"{bound} (IR model)", "estimate blind to the dynamic or prefetch-driven trip count"
        elif note.startswith("(time from the IR's model: libtpu's static profiler aborted"):
            bound, note = f"{bound} (IR model)", "profiler aborted (the LLO gives bundles, spills, VMEM)"
        elif note.startswith("(time from the IR's model: "):
            bound, note = f"{bound} (IR model)", note.removeprefix("(time from the IR's model: ").removesuffix(")")
        cyc = "-" if cycles == "-" else f"{thousands(cycles)} (+{thousands(outside)})"
        spills = "-" if vspill == "-" else f"{vspill}/{sspill}"
        print(f"| {target} | {kernel} | {cyc} | {bundles} | {spills} | {vmem} | {time} | {roofline} | {bound} | {note} |")
    if rows == 0:
        sys.exit("cost_table.py: no kernel rows on stdin (pipe `tessera cost` into it)")


if __name__ == "__main__":
    main()

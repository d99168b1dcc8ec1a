#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""ncu_summary.py TITLE RAW.csv - one table of an `ncu --csv --page raw` log (ncu_append.sh):
consecutive launches of the same kernel form one run (a form's single launches: the byte
check's launch, then warm-up and timed ones), printed with its launch count, median duration
on the GPU (gpu__time_duration, without the launch), DRAM read + write and L2 bytes, grid and
block, registers, achieved occupancy and the three largest warp stall reasons (warps stalled
per issued instruction)."""
import csv
import re
import statistics
import sys


def short(name):
    """'void <unnamed>::copy_row_kernel<16, 1>(<unnamed>::Geo, ...)' -> 'copy_row_kernel<16, 1>'"""
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"<unnamed>::|\(anonymous namespace\)::|flashinfer::", "", name)
    depth, end = 0, len(name)
    for i, ch in enumerate(name):  # cut at the parameter list (outside template brackets)
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            end = i
            break
    return name[:end]


def num(row, key):
    v = row.get(key, "")
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


def main():
    title, path = sys.argv[1], sys.argv[2]
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    rows = list(csv.DictReader(lines))
    if len(rows) < 2:
        print(f"{title}: no kernels profiled")
        return 1
    units, rows = rows[0], rows[1:]
    to_us = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    dur_scale = to_us.get(units.get("gpu__time_duration.sum", "nsecond"), 1e-3)
    byte_scale = {"byte": 1 / 1024, "Kbyte": 1e3 / 1024, "Mbyte": 1e6 / 1024, "Gbyte": 1e9 / 1024}
    stall_keys = [k for k in units if re.search(r"issue_stalled_(\w+)_per_issue_active\.ratio$", k)
                  and "not_issued" not in k]
    runs = []
    for r in rows:
        n = short(r.get("Kernel Name", "?"))
        if runs and runs[-1][0] == n:
            runs[-1][1].append(r)
        else:
            runs.append((n, [r]))
    print(f"\n{title}")
    print(f"{'kernel':<48} {'n':>3} {'us':>7} {'DRAM KiB':>9} {'L2 KiB':>9} {'grid':>7} "
          f"{'block':>5} {'regs':>4} {'occ %':>6}  top stalls (warps per issue)")
    for n, rs in runs:
        def med(key, scale=1.0):
            v = [x for x in (num(r, key) for r in rs) if x is not None]
            return statistics.median(v) * scale if v else float("nan")
        d = med("gpu__time_duration.sum", dur_scale)
        b = lambda k: med(k, byte_scale.get(units.get(k, "byte"), 1 / 1024))  # KiB
        dram = b("dram__bytes_read.sum") + b("dram__bytes_write.sum")
        stalls = sorted(((med(k), re.search(r"issue_stalled_(\w+)_per", k).group(1))
                         for k in stall_keys), reverse=True)[:3]
        st = ", ".join(f"{s} {v:.1f}" for v, s in stalls if v == v)
        print(f"{n[:48]:<48} {len(rs):>3} {d:>7.2f} {dram:>9.0f} {b('lts__t_bytes.sum'):>9.0f} "
              f"{med('launch__grid_size'):>7.0f} {med('launch__block_size'):>5.0f} "
              f"{med('launch__registers_per_thread'):>4.0f} "
              f"{med('sm__warps_active.avg.pct_of_peak_sustained_active'):>6.1f}  {st}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

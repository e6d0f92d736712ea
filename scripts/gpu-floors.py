#!/usr/bin/env python3
"""Analytical floors of grng's hot paths on an H100 (GPU.md §4-5), per kernel design.

Designed to the floor, not measured. For each tensor-core path and each GEMM design:

  floor  = max(FLOPs / 798 TFLOP/s, bytes / 3.0 TB/s)         (the issue's yardstick)
  design = max(executed FLOPs / (ceiling · wave efficiency), bytes / 3.0 TB/s)

Executed FLOPs count whole 128x128 tiles (a ragged edge computes a full tile) and, for the
SYRK, the lower-triangle tiles only. The design ceiling is the smaller of
  - the MMA issue cap: wgmma 92% of 798 (cuBLAS reached 732 TFLOP/s at 8192³ on the lent
    H100, GPU.md §5); mma.sync 62% (Hopper runs the sm_80 instruction at about that fraction
    of wgmma's rate: Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU
    Architecture", 2024 — reported, not measured here);
  - shared memory: 128 B/clk/SM x 132 SMs x 1.98 GHz = 33.4 TB/s (architecture figures)
    times the design's FLOPs per shared-memory byte (cp.async writes + ldmatrix or wgmma reads).
Wave efficiency: tiles / (waves x resident blocks), with 132 SMs. Not modelled: L2->SM
bandwidth (a 128x128 tile loads 1 byte per 64 FLOPs: 12.5 TB/s at 798 TFLOP/s) and the
epilogue's stores, which overlap other tiles' mainloops only across blocks.
Ceilings: bf16 dense 798 TFLOP/s and 3.0 TB/s measured on the lent H100 (GPU.md);
fp32 CUDA-core 67 TFLOP/s is NVIDIA's datasheet figure. Run: python3 scripts/gpu-floors.py
"""

import math

BF16 = 798e12
FP32 = 67e12
BW = 3.0e12
SMEM_BW = 128 * 132 * 1.98e9
SMS = 132
TILE = 128


class Design:
    def __init__(self, name, bk, smem_bytes_per_slice, issue, blocks_per_sm):
        self.name = name
        flop_per_slice = 2 * TILE * TILE * bk
        self.ceiling = min(issue * BF16, SMEM_BW * flop_per_slice / smem_bytes_per_slice)
        self.blocks_per_sm = blocks_per_sm

    def time(self, tiles, flop_per_tile, nbytes):
        slots = SMS * self.blocks_per_sm
        waves = math.ceil(tiles / slots)
        eff = tiles / (waves * slots)
        return max(tiles * flop_per_tile / (self.ceiling * eff), nbytes / BW), eff


# sm_80 engine (engine.cuh): 128x128x32 slices, 3 stages, 8 warps of 64x32 warp tiles.
# Per slice: cp.async writes 2 x 128x32 bf16 = 16 KiB; ldmatrix reads per warp A 64x32 +
# B 32x32 = 6 KiB, x 8 warps = 48 KiB. 2 blocks/SM for newton_gemm_tc (115 registers,
# 48 KiB), 1 for syrk_ema_tc (172 registers) — the Newton figure is used for both.
SM80 = Design("sm_80 mma.sync 128x128x32 s3", 32, 16384 + 49152, 0.62, 2)
# sm_90a path (wgmma_sm90.cuh): 128x128x64 slices, 4 stages, producer + 2 consumer
# warpgroups of m64n128k16. Per slice: cp.async writes 2 x 128x64 bf16 = 32 KiB; wgmma reads
# per consumer warpgroup A 64x64 + B 128x64 = 24 KiB, x 2 = 48 KiB. 1 block/SM (129 KiB).
SM90 = Design("sm_90a wgmma 128x128x64 s4", 64, 32768 + 49152, 0.92, 1)


def row(path, size, flops, nbytes, tiles, flop_per_tile, ceiling=BF16):
    floor = max(flops / ceiling, nbytes / BW)
    cells = []
    for d in (SM80, SM90):
        t, eff = d.time(tiles, flop_per_tile, nbytes)
        cells.append(f"{t * 1e6:>9.1f} {eff:>5.0%}")
    print(f"{path:<32} {size:<12} {flops / 1e9:>8.1f} {nbytes / 1e6:>8.1f} {floor * 1e6:>9.1f}   "
          + "   ".join(cells))


print(f"{'path':<32} {'size':<12} {'GFLOP':>8} {'MB':>8} {'floor µs':>9}   "
      f"{'sm_80 µs':>9} {'waves':>5}   {'sm_90a µs':>9} {'waves':>5}")
for n in (2048, 4096):
    t = math.ceil(n / TILE)
    # bf16 GEMM n³, f32 out: reads A, B (bf16) once, writes C (f32).
    row("bf16 GEMM (newton_gemm_tc)", f"n={n}", 2 * n**3, 4 * n * n + 4 * n * n, t * t,
        2 * TILE * TILE * n)
for n in (2048, 4096):
    t = math.ceil(n / TILE)
    tri = t * (t + 1) // 2
    # SYRK+EMA m = n: lower-triangle tiles only; reads A once, reads the old lower triangle
    # (ε ≠ 0) and writes both triangles of Λ (f32).
    row("SYRK+EMA bf16 (syrk_ema_tc)", f"m=n={n}", n * n * (n + 1),
        2 * n * n + 4 * n * n / 2 + 4 * n * n, tri, 2 * TILE * TILE * n)
for n in (2048, 4096):
    t = math.ceil(n / TILE)
    # One cubic iteration = 3 full products (T = AX with E, F = E·E + E, X' = X·F + X), each
    # reading two bf16 operands and writing f32 + bf16 copies.
    row("cubic Newton bf16, 1 iteration", f"n={n}", 3 * 2 * n**3, 3 * (2 * 2 * n * n + 6 * n * n),
        3 * t * t, 2 * TILE * TILE * n)
for n in (4096,):
    t = math.ceil(n / TILE)
    # Preconditioning Γ⁻¹GΛ⁻¹ at f32 accuracy: two split3 products of 6 bf16 plane products
    # each (gemm3_tc, sm_80 engine only; sm_90a column: if it were ported).
    row("precond f32 (2 split3 products)", f"n={n}", 2 * 6 * 2 * n**3, 2 * (3 * 2 * 2 * n * n + 4 * n * n),
        2 * t * t, 6 * 2 * TILE * TILE * n)

print()
print(f"{'streaming kernel':<32} {'size':<12} {'GFLOP':>8} {'MB':>8} {'floor µs':>9}")
for n, d, s in ((10**6, 10, 4), (5 * 10**7, 10, 4), (5 * 10**7, 10, 2), (10**6, 256, 4),
                (10**6, 256, 2)):
    # Gram pass reads H and σ; update pass reads H, μ, σ and writes μ, σ (two passes, docs/math.md §3):
    # 2·n·d_o·s + 20n bytes, s = 4 (f32 H) or 2 (bf16 H). FLOPs: the Gram's upper triangle and
    # z = L⁻¹h_i are n·d(d+1)/2 FMAs each, h_iᵀw n·d more. d_o = 256 is compute-bound on the
    # SIMT path (docs/gpu.md, "The Kalman step").
    fl = 2 * n * d * (d + 1) + 2 * n * d
    nb = 2 * n * d * s + 20 * n
    name = f"kalman step ({'f32' if s == 4 else 'bf16'} H)"
    print(f"{name:<32} {f'n={n:.0e},d={d}':<12} {fl / 1e9:>8.3f} {nb / 1e6:>8.1f} "
          f"{max(fl / FP32, nb / BW) * 1e6:>9.1f}")
for n in (10**7, 10**8):
    # AdamW: reads θ, g, m, v, writes θ, m, v (28 B/element).
    print(f"{'elementwise_adamw':<32} {f'n={n:.0e}':<12} {12 * n / 1e9:>8.3f} {28 * n / 1e6:>8.1f} "
          f"{max(12 * n / FP32, 28 * n / BW) * 1e6:>9.1f}")

#!/usr/bin/env python3
"""Analytical floors of grng's hot-path kernels on an H100 (GPU.md §4), at the bench sizes.

floor = max(FLOPs / compute ceiling, minimum bytes / bandwidth). Ceilings: bf16 dense tensor
core 798 TFLOP/s and device-to-device copy 3.0 TB/s (read + write counted), both measured on a
lent H100 (GPU.md); fp32 CUDA-core 67 TFLOP/s is NVIDIA's H100 SXM datasheet figure (not
measured here). `design` is the fraction of the floor each kernel's design should reach, with
the reason in docs/gpu.md. Run: python3 scripts/gpu-floors.py
"""

BF16 = 798e12
FP32 = 67e12
BW = 3.0e12


def row(kernel, size, flops, nbytes, ceiling, design):
    t_c = flops / ceiling
    t_m = nbytes / BW
    floor = max(t_c, t_m)
    bound = "compute" if t_c >= t_m else "memory"
    print(f"{kernel:<28} {size:<22} {flops/1e9:>10.3f} {nbytes/1e6:>10.2f} "
          f"{floor*1e6:>10.2f} {bound:>8} {design:>7.0%} {floor/design*1e6:>10.2f}")


print(f"{'kernel':<28} {'size':<22} {'GFLOP':>10} {'MB':>10} {'floor µs':>10} "
      f"{'bound':>8} {'design':>7} {'target µs':>10}")
for n in (256, 512, 1024, 2048):
    m = n
    # SYRK with EMA: lower-triangle tiles only (n(n+1)/2 outputs x 2m flops); reads A once,
    # reads the old lower triangle (ε ≠ 0) and writes both triangles of Λ.
    fl = m * n * (n + 1)
    row("kron_syrk_ema_tc (bf16)", f"m=n={n}", fl, 2 * m * n + 4 * n * n / 2 + 4 * n * n, BF16, 0.45)
    row("kron_syrk_ema_f32", f"m=n={n}", fl, 4 * m * n + 4 * n * n / 2 + 4 * n * n, FP32, 0.6)
for n in (256, 512, 1024, 2048):
    row("precond_gemm_nn (f32)", f"n={n}", 2 * n**3, 3 * 4 * n * n, FP32, 0.6)
for n in (128, 256, 512, 1024, 2048):
    # One cubic iteration: T = AX, U = 3I − 3T + T² (fused into the T·T GEMM), X ← XU:
    # 3 GEMMs of 2n³; operands staged as bf16, results written in f32.
    row("newton cubic bf16 / iter", f"n={n}", 3 * 2 * n**3, 3 * (2 * 2 * n * n + 4 * n * n), BF16, 0.4)
for n, d, s, design in ((10**6, 10, 4, 0.8), (5 * 10**7, 10, 4, 0.8), (5 * 10**7, 10, 2, 0.8),
                        (10**6, 256, 4, 0.3), (10**6, 256, 2, 0.3)):
    # Gram pass reads H and σ; update pass reads H, μ, σ and writes μ, σ (two passes, SPEC §3):
    # 2·n·d_o·s + 20n bytes, s = 4 (f32 H) or 2 (bf16 H). FLOPs: the Gram's upper triangle and
    # z = L⁻¹h_i are n·d(d+1)/2 FMAs each, h_iᵀw n·d more. d_o = 256 is compute-bound on the
    # SIMT path (see docs/gpu.md, "The Kalman step"), hence its lower design fraction.
    row(f"kalman step ({'f32' if s == 4 else 'bf16'} H)", f"n={n:.0e}, d_o={d}",
        2 * n * d * (d + 1) + 2 * n * d, 2 * n * d * s + 20 * n, FP32, design)
for n in (10**6, 10**7):
    # AdamW: reads θ, g, m, v, writes θ, m, v (28 B/element); the finiteness check reads g once more.
    row("elementwise_adamw", f"n={n:.0e}", 12 * n, 28 * n, FP32, 0.8)

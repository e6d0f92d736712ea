//! Element-wise host loops compiled once per x86 instruction-set level and chosen at run time.
//!
//! The crate is built for the baseline `x86-64` target, where plain loops vectorize four `f32`
//! lanes wide (SSE2). The crate-internal `multiversion!` turns a loop function into three copies of one body —
//! AVX-512 (`x86-64-v4`), AVX2 + FMA (`v3`) and baseline — and calls the widest one the running
//! CPU has ([`level`], std's runtime feature detection, cached). Results are bitwise the same at
//! every level: element-wise IEEE operations round alike in any lane width, Rust never contracts
//! `a·b + c` into an FMA, and reductions keep the order their code writes.
//!
//! `GRNG_CPU_SIMD=v3` (or `base`) in the environment caps the level, read once at the first
//! call: for comparing levels (`tests/cpu_simd_levels.rs` checks they agree bit for bit) or
//! for working around a CPU whose wide units throttle the clock.
//!
//! The body is an `#[inline(always)]` function, so it (and the `#[inline(always)]` helpers it
//! calls) is compiled inside each copy; a closure there would be compiled once, at the baseline,
//! and called. The `unsafe` of calling a `#[target_feature]` function lives here only.

use std::sync::atomic::{AtomicU8, Ordering};

/// The instruction-set levels the element-wise loops are compiled for, widest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// `x86-64-v4`: AVX-512 F/BW/CD/DQ/VL on top of v3.
    V4,
    /// `x86-64-v3`: AVX2, FMA, BMI1/2, LZCNT, MOVBE.
    V3,
    /// The compile-time target (SSE2 on `x86-64`, anything elsewhere).
    Base,
}

/// 0: not detected yet; else `1 + Level as u8`.
static LEVEL: AtomicU8 = AtomicU8::new(0);

/// The [`Level`] the element-wise loops run at: the widest this CPU supports, capped by
/// `GRNG_CPU_SIMD` (`v4`, `v3` or `base`; other values are ignored), decided once.
#[inline]
pub fn level() -> Level {
    match LEVEL.load(Ordering::Relaxed) {
        1 => Level::V4,
        2 => Level::V3,
        3 => Level::Base,
        _ => {
            let cap = match std::env::var("GRNG_CPU_SIMD").as_deref() {
                Ok("base") => Level::Base,
                Ok("v3") => Level::V3,
                _ => Level::V4,
            };
            // `Level` orders widest first, so the cap is the larger of the two.
            let l = detect().max(cap);
            LEVEL.store(
                match l {
                    Level::V4 => 1,
                    Level::V3 => 2,
                    Level::Base => 3,
                },
                Ordering::Relaxed,
            );
            l
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Level {
    use std::arch::is_x86_feature_detected as has;
    let v3 = has!("avx2")
        && has!("fma")
        && has!("bmi1")
        && has!("bmi2")
        && has!("lzcnt")
        && has!("movbe");
    let v4 = v3
        && has!("avx512f")
        && has!("avx512bw")
        && has!("avx512cd")
        && has!("avx512dq")
        && has!("avx512vl");
    if v4 {
        Level::V4
    } else if v3 {
        Level::V3
    } else {
        Level::Base
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Level {
    Level::Base
}

/// `fn name(args) -> R { body }` compiled at every [`Level`], dispatching on [`level`] (see
/// the module docs). Optional type parameters take one bound each:
/// `fn name<T: Bound>(x: &[T]) -> R { … }`. Argument types may use elided lifetimes and
/// `impl Trait`.
#[macro_export]
#[doc(hidden)]
macro_rules! __grng_multiversion {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident $(<$($g:ident: $b:path),*>)? ($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?
        $body:block
    ) => {
        $(#[$attr])*
        $vis fn $name $(<$($g: $b),*>)? ($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body $(<$($g: $b),*>)? ($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512cd,avx512dq,avx512vl,avx2,fma,bmi1,bmi2,lzcnt,movbe")]
                unsafe fn v4 $(<$($g: $b),*>)? ($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt,movbe")]
                unsafe fn v3 $(<$($g: $b),*>)? ($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                match $crate::simd::level() {
                    // SAFETY: `level` reports a level only when std's runtime detection found
                    // every feature its copy is compiled with, so its instructions exist here.
                    $crate::simd::Level::V4 => return unsafe { v4($($arg),*) },
                    // SAFETY: as above.
                    $crate::simd::Level::V3 => return unsafe { v3($($arg),*) },
                    $crate::simd::Level::Base => {}
                }
            }
            body($($arg),*)
        }
    };
}
#[doc(inline)]
pub use crate::__grng_multiversion as multiversion;

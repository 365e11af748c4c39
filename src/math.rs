//! The transcendental functions the engine computes with, from the pure-Rust
//! `libm` crate instead of the platform's C library.
//!
//! glibc, Apple's libm and Microsoft's UCRT round `exp`, `ln`, `sin`, ... each
//! in their own way (all within an ulp or so, none identical), so the same
//! model on the same ISA gave different logits on Linux and on Windows. These
//! wrappers are the same code everywhere: a Linux, macOS and Windows build of
//! one kernel table give the same bits. `clippy.toml` disallows the std
//! methods outside this file so no new call slips back to the C library.
//! (`sqrt` and `mul_add` are exactly rounded by IEEE 754 and stay std's.)
#![allow(clippy::disallowed_methods)]

/// e^x (f32).
#[inline]
pub fn expf(x: f32) -> f32 {
    libm::expf(x)
}

/// x^y (f32).
#[inline]
pub fn powf(x: f32, y: f32) -> f32 {
    libm::powf(x, y)
}

/// e^x.
#[inline]
pub fn exp(x: f64) -> f64 {
    libm::exp(x)
}

/// The natural logarithm.
#[inline]
pub fn ln(x: f64) -> f64 {
    libm::log(x)
}

/// The base-2 logarithm.
#[inline]
pub fn log2(x: f64) -> f64 {
    libm::log2(x)
}

/// sin(x), radians.
#[inline]
pub fn sin(x: f64) -> f64 {
    libm::sin(x)
}

/// cos(x), radians.
#[inline]
pub fn cos(x: f64) -> f64 {
    libm::cos(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agree_with_the_platform_to_an_ulp_or_two() {
        // Not a test of libm (it has its own), a guard against a wrapper
        // wired to the wrong function.
        for i in -200..=200 {
            let x = i as f64 * 0.173;
            let close = |a: f64, b: f64| (a - b).abs() <= 4.0 * f64::EPSILON * b.abs().max(1e-300);
            assert!(close(exp(x), x.exp()), "exp({x})");
            assert!(close(sin(x), x.sin()) || (sin(x) - x.sin()).abs() < 1e-15, "sin({x})");
            assert!(close(cos(x), x.cos()) || (cos(x) - x.cos()).abs() < 1e-15, "cos({x})");
            let xf = x as f32;
            assert!((expf(xf) - xf.exp()).abs() <= 2.0 * f32::EPSILON * xf.exp(), "expf({xf})");
            if x > 0.0 {
                assert!(close(ln(x), x.ln()) || (ln(x) - x.ln()).abs() < 1e-15, "ln({x})");
                assert!(close(log2(x), x.log2()) || (log2(x) - x.log2()).abs() < 1e-15, "log2({x})");
                let p = powf(xf, 0.37);
                assert!((p - xf.powf(0.37)).abs() <= 2.0 * f32::EPSILON * p, "powf({xf})");
            }
        }
    }
}

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

/// ln(1 + x) (f32), accurate for small x.
#[inline]
pub fn ln_1pf(x: f32) -> f32 {
    libm::log1pf(x)
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

/// tanh(x) (f32).
#[inline]
pub fn tanhf(x: f32) -> f32 {
    libm::tanhf(x)
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

/// e^x within about two ulp for x in [−87, 88] (clamped to it, so e^−∞
/// gives about 1.6e−38, not 0), for the hot loops (attention's softmax, the
/// experts' SiLU), in plain arithmetic the compiler turns into vector code: x = n·ln 2 + r with n
/// rounded to nearest (|r| ≤ ln 2 / 2), a degree-6 polynomial for e^r
/// (Cephes' `expf` coefficients) and 2^n put straight into the exponent
/// bits. [`expf`] is a call per value. NaN stays NaN. Only IEEE operations,
/// so the same bits on every platform.
#[inline(always)]
pub fn expf_poly(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts: n · LN2_HI is exact for |n| ≤ 2^9.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2^23: adding and subtracting it rounds to an integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_65;
    let p = p * r + 0.5;
    let e = p * (r * r) + r + 1.0;
    // t's low mantissa bits hold n (ROUND's are zero): 2^n from integers
    // alone, no float-to-int conversion.
    let two_n = (t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127)) << 23;
    e * f32::from_bits(two_n)
}

/// Index of the largest logit (the first one on ties, as torch.argmax).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_polynomial_exp_is_within_a_few_ulp() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let got = expf_poly(x) as f64;
            worst = worst.max((got - want).abs() / want);
            x += 0.000_37;
        }
        assert!(worst < 3.0 * f32::EPSILON as f64, "worst relative error {worst:e}");
        assert_eq!(expf_poly(0.0), 1.0);
        assert!(expf_poly(f32::NEG_INFINITY) < 2e-38 && expf_poly(-1e30) > 0.0);
        assert!(expf_poly(1e30).is_finite() && expf_poly(f32::NAN).is_nan());
    }

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

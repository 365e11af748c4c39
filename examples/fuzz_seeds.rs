//! Writes the fuzz targets' seed corpora:
//! `cargo run --release --example fuzz_seeds -- fuzz/corpus` (see fuzz/README.md).

fn main() {
    let out = std::env::args().nth(1).unwrap_or_else(|| "fuzz/corpus".into());
    let n = colibri::fuzzing::write_seeds(std::path::Path::new(&out), std::path::Path::new("tests/fixtures/golden"))
        .expect("writing the seeds");
    eprintln!("{n} seed files under {out}");
}

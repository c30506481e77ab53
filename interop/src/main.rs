//! `tessera`: list, emit, run and check the kernel library from the command line. The
//! commands live in the `tessera` crate (`tessera::cli`), so a user crate's own binary
//! serves its ops through the same code: `tessera::cli::main(my_crate::OPS)`.

fn main() -> std::process::ExitCode {
    tessera::cli::main(&[])
}

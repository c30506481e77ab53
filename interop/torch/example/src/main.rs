//! `tessera-example list | run | emit | check | cost | tune ...`: the `tessera` commands over
//! this crate's op beside the library's (`--features cli`, without the Python module).

fn main() -> std::process::ExitCode {
    tessera::cli::main(tessera_example::OPS)
}

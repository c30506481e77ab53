//! `user-kernels list | run | emit | check | table`: the `tessera` commands over this
//! crate's ops, beside the library's.

fn main() -> std::process::ExitCode {
    tessera::cli::main(user_kernels::OPS)
}

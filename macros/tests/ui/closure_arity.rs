use tessera_macros::tpu_kernel;

#[tpu_kernel(
    grid = [m / 8, 1],
    x = block([8, 128], |i| [i, 0]),
    out = block([8, 128], |i, j| [i, j, 0]),
)]
fn k(x: In<m, 128>, out: Out<m, 128>) {
    out[..] = x[..];
}

fn main() {}

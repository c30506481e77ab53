use tessera_macros::tpu_kernel;

#[tpu_kernel(grid = [4], x = block([8, 128], |i| [i, 0]), out = block([8, 128], |i| [i, 0]))]
fn k(x: In<m, 128>, out: Out<m, 128>) {
    match program_id(0) {
        0 => out[..] = x[..],
        _ => out[..] = x[..] * 2.0,
    }
}

fn main() {}

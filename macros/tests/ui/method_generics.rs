use tessera_macros::tpu_kernel;

#[tpu_kernel(grid = [1], x = block([8, 128], |i| [0, 0]), out = block([8, 1], |i| [0, 0]))]
fn k(x: In<8, 128>, out: Out<8, 1>) {
    out[..] = x[..].sum::<i32>(1);
}

fn main() {}

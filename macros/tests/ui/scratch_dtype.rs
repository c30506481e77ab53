use tessera_macros::tpu_kernel;

#[tpu_kernel(grid = [1], x = block([8, 128], |i| [0, 0]), out = block([8, 128], |i| [0, 0]), acc = scratch([8, 128], f16))]
fn k(x: In<8, 128>, out: Out<8, 128>, acc: Scratch) {
    acc[..] = x[..];
    out[..] = acc[..];
}

fn main() {}

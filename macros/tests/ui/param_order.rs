use tessera_macros::tpu_kernel;

#[tpu_kernel(grid = [1], x = block([8, 128], |i| [0, 0]), out = block([8, 128], |i| [0, 0]))]
fn k(out: Out<8, 128>, x: In<8, 128>, p: Prefetch<8>, acc: Scratch) {
    out[..] = x[..];
}

fn main() {}

use tessera_macros::tpu_kernel;

#[tpu_kernel(grid = [1], x = block([8, 128], |i| [0, 0]), out = block([8, 128], |i| [0, 0]))]
fn k(x: In<8, 128>, out: Out<8, 128>) {
    total = x[..].sum(0);
    let v = x[..];
    v = v * 2.0;
    x = v;
    out[..] = v;
}

fn main() {}

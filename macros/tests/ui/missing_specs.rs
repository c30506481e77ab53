use tessera_macros::tpu_kernel;

#[tpu_kernel(grid = [4], semantics = [parallel, arbitrary], x = block([8], |i| [i, 0]), y = block([8, 128], |i| [i, 0]))]
fn k(x: In<m, 128>, out: Out<m, 128>, acc: Scratch) {
    out[..] = x[..];
}

fn main() {}

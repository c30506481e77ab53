use tessera_macros::tpu_kernel;

// A function called with IR values is a `#[tpu_fn]` fragment; one that does not exist is
// rustc's error at the call.
#[tpu_kernel(grid = [1], x = block([8, 128], |i| [0, 0]), out = block([8, 128], |i| [0, 0]))]
fn k(x: In<8, 128>, out: Out<8, 128>) {
    out[..] = gelu(x[..]);
}

fn main() {}

use tessera_macros::tpu_kernel;

#[tpu_kernel(grid = [1], x = block([16, 128], |i| [0, 0]), out = block([8, 128], |i| [0, 0]))]
fn k(x: In<16, 128>, out: Out<8, 128>) {
    out[..] = x[((0..16).step_by(program_id(0)), ..)];
}

fn main() {}

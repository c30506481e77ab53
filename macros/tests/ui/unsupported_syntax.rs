use tessera_macros::tpu_kernel;

#[tpu_kernel(grid = [4], x = block([8, 128], |i| [i, 0]), out = block([8, 128], |i| [i, 0]))]
fn k(x: In<m, 128>, out: Out<m, 128>) {
    let v = x[..];
    if program_id(0) == 0 {
        return;
    }
    println!("{}", 1);
    let w = &v;
    let f = |a| a;
    let c = v as f32;
    for i in 0..=4 {
        out[..] = v;
    }
    loop {}
}

fn main() {}

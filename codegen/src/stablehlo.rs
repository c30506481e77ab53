//! Wraps a kernel's Mosaic module in a StableHLO module whose `main` is one
//! `stablehlo.custom_call @tpu_custom_call`, the form XLA/libtpu (and TorchTPU's
//! `register_custom_kernel`) compile:
//!
//! ```text
//! module @kernel {
//!   func.func public @main(%arg0: tensor<..>, ...) -> (tensor<..>, ...) {
//!     %0 = stablehlo.custom_call @tpu_custom_call(%arg0, ...) {api_version = 1 : i32,
//!         backend_config = "<json>", kernel_name = "kernel", operand_layouts = [...],
//!         result_layouts = [...]} : (...) -> ...
//!     return %0 : ...
//!   }
//! }
//! ```
//!
//! Operands are the scalar-prefetch arrays then the inputs (led by one `tensor<i32>` per
//! dynamic grid dim, reshaped from its extent operand); results are the outputs (several
//! outputs are several results of the one custom call, as JAX emits them, not a tuple).

use base64::Engine;
use tessera_dsl::ir::*;
use tessera_dsl::verify::vmem_limit;
use tessera_dsl::Target;

use crate::cost::{estimate, CostEstimate};
use crate::text::{mlir_string, result_list, shaped, symbol};
use crate::{mosaic, CodegenError};

pub fn emit(kernel: &Kernel, target: &Target) -> Result<String, CodegenError> {
    let body = mosaic::emit(kernel, target)?;
    Ok(wrap(kernel, &body, &estimate(kernel), vmem_limit(kernel, target)))
}

/// Builds the StableHLO module around an already emitted Mosaic `body`.
pub(crate) fn wrap(k: &Kernel, body: &str, cost: &CostEstimate, vmem_limit_bytes: usize) -> String {
    let operands: Vec<&RefDecl> = k.refs.iter().filter(|r| matches!(r.kind, RefKind::Prefetch | RefKind::Input)).collect();
    let results: Vec<&RefDecl> = k.refs.iter().filter(|r| r.kind == RefKind::Output).collect();
    let tensor = |r: &RefDecl| format!("tensor<{}>", shaped(r.dtype, &r.shape));
    let in_tys: Vec<String> = operands.iter().map(|r| tensor(r)).collect();
    let out_tys: Vec<String> = results.iter().map(|r| tensor(r)).collect();
    let args: Vec<String> = in_tys.iter().enumerate().map(|(i, t)| format!("%arg{i}: {t}")).collect();
    // `main` takes every operand; the custom call only those Mosaic sees (an input no
    // instruction touches is left out: `mosaic::passed_refs`).
    let passed = mosaic::passed_refs(k);
    // (The operands lead the kernel's refs: prefetch, inputs, outputs, scratch.)
    debug_assert!(operands.iter().zip(&k.refs).all(|(o, r)| std::ptr::eq(*o, r)));
    let call_operands: Vec<usize> = (0..operands.len()).filter(|&i| passed[i]).collect();
    let mut arg_names: Vec<String> = call_operands.iter().map(|i| format!("%arg{i}")).collect();
    let mut call_tys: Vec<String> = call_operands.iter().map(|&i| in_tys[i].clone()).collect();
    let mut operand_layouts: Vec<String> = call_operands.iter().map(|&i| layout(operands[i].shape.len())).collect();
    // Dynamic grid extents lead the custom call's operands, in grid order, as `tensor<i32>`
    // (Mosaic's convention for `INT64_MIN` in `iteration_bounds`): each is element 0 of its
    // int32 `[1]` scalar-prefetch operand, which the kernel also receives.
    let mut reshapes = Vec::new();
    for (d, g) in k.grid.iter().enumerate() {
        let Some(r) = g.dynamic else { continue };
        let Some(at) = operands.iter().position(|o| std::ptr::eq(*o, k.ref_decl(r))) else { continue };
        reshapes.push(format!("    %extent{d} = stablehlo.reshape %arg{at} : ({}) -> tensor<i32>\n", in_tys[at]));
        let n = reshapes.len() - 1;
        arg_names.insert(n, format!("%extent{d}"));
        call_tys.insert(n, "tensor<i32>".to_string());
        operand_layouts.insert(n, layout(0));
    }
    let layouts = |rs: &[&RefDecl]| rs.iter().map(|r| layout(r.shape.len())).collect::<Vec<_>>().join(", ");
    let (lhs, ret) = match results.len() {
        1 => ("%0".to_string(), "%0".to_string()),
        n => (format!("%0:{n}"), (0..n).map(|i| format!("%0#{i}")).collect::<Vec<_>>().join(", ")),
    };
    let config = backend_config(body, cost, vmem_limit_bytes, collective_fields(k).as_deref());
    let attrs = [
        "api_version = 1 : i32".to_string(),
        format!("backend_config = {}", mlir_string(&config)),
        format!("kernel_name = {}", mlir_string(&k.name)),
        format!("operand_layouts = [{}]", operand_layouts.join(", ")),
        format!("result_layouts = [{}]", layouts(&results)),
    ];
    let call = format!("{lhs} = stablehlo.custom_call @tpu_custom_call({}) {{{}}} : ({}) -> {}\n", arg_names.join(", "), attrs.join(", "), call_tys.join(", "), result_list(&out_tys));
    if let Some(c) = k.collective.as_ref().filter(|c| c.devices() > 1) {
        return wrap_mesh(k, c, &operands, &results, &reshapes, &call, &ret);
    }
    let mut s = String::new();
    s.push_str(&format!("module {} {{\n", symbol(&k.name)));
    s.push_str(&format!("  func.func public @main({}) -> ({}) {{\n", args.join(", "), out_tys.join(", ")));
    reshapes.iter().for_each(|r| s.push_str(r));
    s.push_str(&format!("    {call}"));
    s.push_str(&format!("    return {ret} : {}\n", out_tys.join(", ")));
    s.push_str("  }\n}\n");
    s
}

/// The module of a kernel that runs on every device of a mesh, in the form JAX writes for
/// a `pallas_call` under `shard_map` (tests/fixtures/collective/ring_mesh.stablehlo.mlir):
/// `mhlo.num_partitions` devices, a Shardy mesh, and the custom call inside an
/// `sdy.manual_computation` over every mesh axis, so each device calls the kernel on its
/// own shard. The global arrays are the devices' operands stacked along dim 0 (device `d`
/// holds rows `d * n0 .. (d + 1) * n0`); a rank-0 operand is replicated.
fn wrap_mesh(k: &Kernel, c: &Collective, operands: &[&RefDecl], results: &[&RefDecl], reshapes: &[String], call: &str, ret: &str) -> String {
    let n = c.devices();
    let axes: Vec<String> = c.mesh.iter().map(|a| format!("\"{}\"", a.name)).collect();
    let local = |r: &RefDecl| format!("tensor<{}>", shaped(r.dtype, &r.shape));
    let global = |r: &RefDecl| {
        let mut shape = r.shape.clone();
        if let Some(d0) = shape.first_mut() {
            *d0 *= n;
        }
        format!("tensor<{}>", shaped(r.dtype, &shape))
    };
    let sharding = |r: &RefDecl| {
        let dims: Vec<String> = (0..r.shape.len()).map(|d| if d == 0 { format!("{{{}}}", axes.join(", ")) } else { "{}".to_string() }).collect();
        format!("<@mesh, [{}]>", dims.join(", "))
    };
    let list = |rs: &[&RefDecl], f: &dyn Fn(&RefDecl) -> String| rs.iter().map(|r| f(r)).collect::<Vec<_>>().join(", ");
    let main_args: Vec<String> = operands.iter().enumerate().map(|(i, r)| format!("%g{i}: {} {{sdy.sharding = #sdy.sharding{}}}", global(r), sharding(r))).collect();
    let outs: Vec<String> = results.iter().map(|r| format!("{} {{sdy.sharding = #sdy.sharding{}}}", global(r), sharding(r))).collect();
    let inner_args: Vec<String> = operands.iter().enumerate().map(|(i, r)| format!("%arg{i}: {}", local(r))).collect();
    let outer_names: Vec<String> = (0..operands.len()).map(|i| format!("%g{i}")).collect();
    let lhs = match results.len() {
        1 => "%r".to_string(),
        m => format!("%r:{m}"),
    };
    let rets = match results.len() {
        1 => "%r".to_string(),
        m => (0..m).map(|i| format!("%r#{i}")).collect::<Vec<_>>().join(", "),
    };
    let dims = c.mesh.iter().map(|a| format!("\"{}\"={}", a.name, a.size)).collect::<Vec<_>>().join(", ");
    let mut s = String::new();
    s.push_str(&format!("module {} attributes {{mhlo.num_partitions = {n} : i32, mhlo.num_replicas = 1 : i32}} {{\n", symbol(&k.name)));
    s.push_str(&format!("  sdy.mesh @mesh = <[{dims}]>\n"));
    // `main` takes the global arrays; the manual computation gives the kernel its shard.
    s.push_str(&format!("  func.func public @main({}) -> ({}) {{\n", main_args.join(", "), outs.join(", ")));
    s.push_str(&format!(
        "    {lhs} = sdy.manual_computation({}) in_shardings=[{}] out_shardings=[{}] manual_axes={{{}}} ({}) {{\n",
        outer_names.join(", "),
        list(operands, &sharding),
        list(results, &sharding),
        axes.join(", "),
        inner_args.join(", ")
    ));
    reshapes.iter().for_each(|r| s.push_str(&format!("  {r}")));
    s.push_str(&format!("      {call}"));
    s.push_str(&format!("      sdy.return {ret} : {}\n", list(results, &local)));
    s.push_str(&format!("    }} : ({}) -> {}\n", list(operands, &global), result_list(&results.iter().map(|r| global(r)).collect::<Vec<_>>())));
    s.push_str(&format!("    return {rets} : {}\n", list(results, &global)));
    s.push_str("  }\n}\n");
    s
}

/// The custom call's backend_config JSON. Field set verified against libtpu 0.0.52, which
/// rejects unknown fields: `body` is the base64 of the stable serialized text, hence
/// `serialization_format: 1`; `needs_layout_passes: false` is rejected for such bodies;
/// `cost_estimate` matches the four fields JAX writes; `scoped_memory_configs` (top level,
/// memory space 1 = VMEM) sets the scoped VMEM limit.
pub(crate) fn backend_config(body: &str, cost: &CostEstimate, vmem_limit_bytes: usize, collective: Option<&str>) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(body.as_bytes());
    format!(
        concat!(
            "{{\"custom_call_config\": {{\"body\": \"{}\", ",
            "\"cost_estimate\": {{\"flops\": {}, \"transcendentals\": {}, \"bytes_accessed\": {}, \"remote_bytes_transferred\": {}}}, ",
            "{}\"serialization_format\": 1, \"needs_layout_passes\": true}}, ",
            "\"scoped_memory_configs\": [{{\"memory_space\": 1, \"offset\": 0, \"size\": {}}}]}}"
        ),
        b64,
        cost.flops,
        cost.transcendentals,
        cost.bytes_accessed,
        cost.remote_bytes_transferred,
        collective.unwrap_or(""),
        vmem_limit_bytes
    )
}

/// The backend_config fields of a kernel that talks to other devices, as Pallas writes
/// them for its ring (tests/fixtures/collective/ring_mesh.backend_config.json):
/// `has_communication` and the `collective_id` that picks its barrier semaphore.
fn collective_fields(k: &Kernel) -> Option<String> {
    let c = k.collective.as_ref()?;
    k.communicates().then(|| format!("\"has_communication\": true, \"collective_id\": {}, ", c.collective_id))
}

/// Row-major layout (minor-to-major `[r-1, ..., 0]`) as a dense index attribute.
fn layout(rank: usize) -> String {
    match rank {
        0 => "dense<> : tensor<0xindex>".to_string(),
        1 => "dense<0> : tensor<1xindex>".to_string(),
        r => {
            let dims: Vec<String> = (0..r).rev().map(|d| d.to_string()).collect();
            format!("dense<[{}]> : tensor<{r}xindex>", dims.join(", "))
        }
    }
}

/// Where the base64 Mosaic body sits inside an emitted module's `backend_config`.
fn body_range(module: &str) -> Option<std::ops::Range<usize>> {
    const KEY: &str = "\\22body\\22: \\22";
    let start = module.find(KEY)? + KEY.len();
    let len = module[start..].find("\\22")?;
    Some(start..start + len)
}

/// The Mosaic text carried by an emitted StableHLO module (for tools and tests).
pub fn decode_body(module: &str) -> Option<String> {
    use base64::Engine;
    let b64 = &module[body_range(module)?];
    String::from_utf8(base64::engine::general_purpose::STANDARD.decode(b64).ok()?).ok()
}

/// The module with its base64 body replaced by a short note, for snapshots and reading:
/// the body is the Mosaic text, which is snapshotted on its own.
pub fn redact_body(module: &str) -> Option<String> {
    let r = body_range(module)?;
    Some(format!("{}<base64 of the Mosaic text, {} bytes>{}", &module[..r.start], r.len(), &module[r.end..]))
}

// Minimal StableHLO wrapper for a Mosaic kernel that libtpu 0.0.52 compiles
// (verified with interop/python/tpu_compile.py for v5e, v5p, v6e, tpu7x).
// Computes y = x + x on a 16x128 f32 array with grid (2,) and 8x128 blocks.
//
// backend_config JSON: {"custom_call_config": {"body": BASE64, "serialization_format": 1,
//   "needs_layout_passes": true}}   (JSON quotes written as \22 inside the MLIR string)
// BASE64 = standard base64 (with padding) of the UTF-8 kernel text below, which is the
// stable serialized Mosaic form (generic syntax, stable_mosaic.* names, version 11).
// Required: body + serialization_format 1 + needs_layout_passes true. kernel_name,
// api_version and operand/result_layouts are optional for compilation but emitted
// (JAX does; layouts fix row-major semantics). No loc(), mhlo.* or jax.* attrs needed.
//
// Decoded body:
//   "builtin.module"() ({
//     "stable_mosaic.func.func"() ({
//     ^bb0(%arg0: i32, %arg1: memref<8x128xf32, #tpu.memory_space<vmem>>, %arg2: memref<8x128xf32, #tpu.memory_space<vmem>>):
//       %0 = "stable_mosaic.arith.constant"() {value = 0 : index} : () -> index
//       %1 = "stable_mosaic.vector.load"(%arg1, %0, %0) : (memref<8x128xf32, #tpu.memory_space<vmem>>, index, index) -> vector<8x128xf32>
//       %2 = "stable_mosaic.arith.addf"(%1, %1) {fastmath = #arith.fastmath<none>} : (vector<8x128xf32>, vector<8x128xf32>) -> vector<8x128xf32>
//       "stable_mosaic.tpu.vector_store"(%2, %arg2, %0, %0) {add = false, operandSegmentSizes = array<i32: 1, 1, 2, 0>, strides = array<i32>} : (vector<8x128xf32>, memref<8x128xf32, #tpu.memory_space<vmem>>, index, index) -> ()
//       "stable_mosaic.func.return"() : () -> ()
//     }) {dimension_semantics = [#tpu.dimension_semantics<parallel>], function_type = (i32, memref<8x128xf32, #tpu.memory_space<vmem>>, memref<8x128xf32, #tpu.memory_space<vmem>>) -> (), iteration_bounds = array<i64: 2>, scalar_prefetch = 0 : i64, scratch_operands = 0 : i64, sym_name = "double", tpu.core_type = #tpu.core_type<tc>, window_params = [{transform_indices = @transform_0, window_bounds = array<i64: 8, 128>}, {transform_indices = @transform_1, window_bounds = array<i64: 8, 128>}]} : () -> ()
//     "stable_mosaic.func.func"() ({
//     ^bb0(%arg0: i32):
//       %0 = "stable_mosaic.arith.constant"() {value = 0 : i32} : () -> i32
//       "stable_mosaic.func.return"(%arg0, %0) : (i32, i32) -> ()
//     }) {function_type = (i32) -> (i32, i32), sym_name = "transform_0"} : () -> ()
//     "stable_mosaic.func.func"() ({
//     ^bb0(%arg0: i32):
//       %0 = "stable_mosaic.arith.constant"() {value = 0 : i32} : () -> i32
//       "stable_mosaic.func.return"(%arg0, %0) : (i32, i32) -> ()
//     }) {function_type = (i32) -> (i32, i32), sym_name = "transform_1"} : () -> ()
//   }) {stable_mosaic.version = 11 : i64} : () -> ()
//
module {
  func.func @main(%arg0: tensor<16x128xf32>) -> (tensor<16x128xf32>) {
    %0 = stablehlo.custom_call @tpu_custom_call(%arg0) {backend_config = "{\22custom_call_config\22: {\22body\22: \22ImJ1aWx0aW4ubW9kdWxlIigpICh7CiAgInN0YWJsZV9tb3NhaWMuZnVuYy5mdW5jIigpICh7CiAgXmJiMCglYXJnMDogaTMyLCAlYXJnMTogbWVtcmVmPDh4MTI4eGYzMiwgI3RwdS5tZW1vcnlfc3BhY2U8dm1lbT4+LCAlYXJnMjogbWVtcmVmPDh4MTI4eGYzMiwgI3RwdS5tZW1vcnlfc3BhY2U8dm1lbT4+KToKICAgICUwID0gInN0YWJsZV9tb3NhaWMuYXJpdGguY29uc3RhbnQiKCkge3ZhbHVlID0gMCA6IGluZGV4fSA6ICgpIC0+IGluZGV4CiAgICAlMSA9ICJzdGFibGVfbW9zYWljLnZlY3Rvci5sb2FkIiglYXJnMSwgJTAsICUwKSA6IChtZW1yZWY8OHgxMjh4ZjMyLCAjdHB1Lm1lbW9yeV9zcGFjZTx2bWVtPj4sIGluZGV4LCBpbmRleCkgLT4gdmVjdG9yPDh4MTI4eGYzMj4KICAgICUyID0gInN0YWJsZV9tb3NhaWMuYXJpdGguYWRkZiIoJTEsICUxKSB7ZmFzdG1hdGggPSAjYXJpdGguZmFzdG1hdGg8bm9uZT59IDogKHZlY3Rvcjw4eDEyOHhmMzI+LCB2ZWN0b3I8OHgxMjh4ZjMyPikgLT4gdmVjdG9yPDh4MTI4eGYzMj4KICAgICJzdGFibGVfbW9zYWljLnRwdS52ZWN0b3Jfc3RvcmUiKCUyLCAlYXJnMiwgJTAsICUwKSB7YWRkID0gZmFsc2UsIG9wZXJhbmRTZWdtZW50U2l6ZXMgPSBhcnJheTxpMzI6IDEsIDEsIDIsIDA+LCBzdHJpZGVzID0gYXJyYXk8aTMyPn0gOiAodmVjdG9yPDh4MTI4eGYzMj4sIG1lbXJlZjw4eDEyOHhmMzIsICN0cHUubWVtb3J5X3NwYWNlPHZtZW0+PiwgaW5kZXgsIGluZGV4KSAtPiAoKQogICAgInN0YWJsZV9tb3NhaWMuZnVuYy5yZXR1cm4iKCkgOiAoKSAtPiAoKQogIH0pIHtkaW1lbnNpb25fc2VtYW50aWNzID0gWyN0cHUuZGltZW5zaW9uX3NlbWFudGljczxwYXJhbGxlbD5dLCBmdW5jdGlvbl90eXBlID0gKGkzMiwgbWVtcmVmPDh4MTI4eGYzMiwgI3RwdS5tZW1vcnlfc3BhY2U8dm1lbT4+LCBtZW1yZWY8OHgxMjh4ZjMyLCAjdHB1Lm1lbW9yeV9zcGFjZTx2bWVtPj4pIC0+ICgpLCBpdGVyYXRpb25fYm91bmRzID0gYXJyYXk8aTY0OiAyPiwgc2NhbGFyX3ByZWZldGNoID0gMCA6IGk2NCwgc2NyYXRjaF9vcGVyYW5kcyA9IDAgOiBpNjQsIHN5bV9uYW1lID0gImRvdWJsZSIsIHRwdS5jb3JlX3R5cGUgPSAjdHB1LmNvcmVfdHlwZTx0Yz4sIHdpbmRvd19wYXJhbXMgPSBbe3RyYW5zZm9ybV9pbmRpY2VzID0gQHRyYW5zZm9ybV8wLCB3aW5kb3dfYm91bmRzID0gYXJyYXk8aTY0OiA4LCAxMjg+fSwge3RyYW5zZm9ybV9pbmRpY2VzID0gQHRyYW5zZm9ybV8xLCB3aW5kb3dfYm91bmRzID0gYXJyYXk8aTY0OiA4LCAxMjg+fV19IDogKCkgLT4gKCkKICAic3RhYmxlX21vc2FpYy5mdW5jLmZ1bmMiKCkgKHsKICBeYmIwKCVhcmcwOiBpMzIpOgogICAgJTAgPSAic3RhYmxlX21vc2FpYy5hcml0aC5jb25zdGFudCIoKSB7dmFsdWUgPSAwIDogaTMyfSA6ICgpIC0+IGkzMgogICAgInN0YWJsZV9tb3NhaWMuZnVuYy5yZXR1cm4iKCVhcmcwLCAlMCkgOiAoaTMyLCBpMzIpIC0+ICgpCiAgfSkge2Z1bmN0aW9uX3R5cGUgPSAoaTMyKSAtPiAoaTMyLCBpMzIpLCBzeW1fbmFtZSA9ICJ0cmFuc2Zvcm1fMCJ9IDogKCkgLT4gKCkKICAic3RhYmxlX21vc2FpYy5mdW5jLmZ1bmMiKCkgKHsKICBeYmIwKCVhcmcwOiBpMzIpOgogICAgJTAgPSAic3RhYmxlX21vc2FpYy5hcml0aC5jb25zdGFudCIoKSB7dmFsdWUgPSAwIDogaTMyfSA6ICgpIC0+IGkzMgogICAgInN0YWJsZV9tb3NhaWMuZnVuYy5yZXR1cm4iKCVhcmcwLCAlMCkgOiAoaTMyLCBpMzIpIC0+ICgpCiAgfSkge2Z1bmN0aW9uX3R5cGUgPSAoaTMyKSAtPiAoaTMyLCBpMzIpLCBzeW1fbmFtZSA9ICJ0cmFuc2Zvcm1fMSJ9IDogKCkgLT4gKCkKfSkge3N0YWJsZV9tb3NhaWMudmVyc2lvbiA9IDExIDogaTY0fSA6ICgpIC0+ICgpCg==\22, \22serialization_format\22: 1, \22needs_layout_passes\22: true}}", kernel_name = "double", api_version = 1 : i32, operand_layouts = [dense<[1,0]> : tensor<2xindex>], result_layouts = [dense<[1,0]> : tensor<2xindex>]} : (tensor<16x128xf32>) -> tensor<16x128xf32>
    return %0 : tensor<16x128xf32>
  }
}

"""Drop-in fronts for other libraries' op sets on Tessera's kernels (`torch_tpu`: TorchTPU's
`torch.tpu.ops`)."""

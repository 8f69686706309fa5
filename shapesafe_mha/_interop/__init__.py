"""Interop: conversions to and from torch and transformers, verified; the HF attention backend; weight layouts.

`hf` converts transformers attention layers (`from_hf`, `to_hf`, latent `from_hf`) and runs an HF layer
as its model calls it, for the probe; `torch_nn` converts `nn.MultiheadAttention` and checks
`from_weights`; every conversion verifies itself on `_core.probe`. `hf_backend` is what
`attn_implementation="shapesafe"` calls and `hf_replace` puts `from_hf` layers in a whole model's attention
modules' place (both public as `shapesafe_mha.hf`); `adapters` loads weights held in
other layouts (fused QKV, GPT-2's Conv1D). Imports the modules and everything below them.
"""

"""The attention modules: multi-head (`multihead`), latent (`latent`, with its cache), head-parallel (`parallel`).

Each is an `nn.Module` whose `forward` composes the typed stages of `_compute`, with its verdicts kept
by the contract of `_core`. Their conversions (`from_hf`, `to_torch`, ...) are classmethods here that
hand over to `_interop`, lazily: the one import that runs up a floor, listed in `tests/test_layout.py`.
"""

"""The computation: kernels, the typed stages, the fast paths, RoPE, the KV cache, the per-head reference.

`kernels` holds the plain torch computations (no checks), `stages` the typed stages users compose
(`project`, `split_heads`, `scaled_dot_product_attention`, ...), each a kernel behind the contract;
`fastpath` decides when a remembered module may skip per-stage dispatch (fused projections, torch's
native kernel) and which kernel path a call takes; `rotary` the RoPE stages and tables; `cache` the
KV cache a decoding stage writes; `flex` the typed `flex_attention`; `reference` the naive per-head
computation every proof compares against. Imports only `_core`.
"""

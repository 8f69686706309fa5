"""Smoke test for the lowest declared dependency versions: import, a checked forward, a ShapeError with its numbers.

Run by .ci/run in a second environment that has the lowest versions of jaxtyping and beartype that
pyproject.toml admits, so the declared lower bounds stay true.
"""

import importlib.metadata

import torch

import shapesafe_mha as ssm


def main() -> None:
    versions = {name: importlib.metadata.version(name) for name in ("jaxtyping", "beartype", "torch")}
    attn = ssm.MultiHeadAttention(d_model=64, num_heads=8, num_kv_heads=2)
    out = attn(torch.randn(2, 10, 64), is_causal=True)
    assert out.shape == (2, 10, 64), out.shape
    cache = attn.new_cache(2, 12)
    attn(torch.randn(2, 10, 64), is_causal=True, kv_cache=cache)
    try:
        attn(torch.randn(2, 1, 64), kv_cache=cache, attn_mask=torch.ones(2, 3, 1, 11, dtype=torch.bool))
    except ssm.ShapeError as error:
        first = str(error).splitlines()[0]
    else:
        raise SystemExit("no ShapeError for a mask with 3 heads")
    expected = "attn_mask has num_heads=3 (axis 1), but the module set num_heads=8"
    if expected not in first or len(cache) != 10:
        raise SystemExit(f"unexpected: {first!r}, cache length {len(cache)}")
    try:
        q, k = torch.randn(2, 8, 12, 64), torch.randn(2, 8, 12, 32)
        ssm.scaled_dot_product_attention(q, k, k)
    except ssm.ShapeError as error:
        assert "k has d_head=32 (axis 3), but q set d_head=64" in str(error), str(error)
    print(f"smoke ok with {versions}: {first}")


if __name__ == "__main__":
    main()

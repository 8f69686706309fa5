"""`AttentionWeights`: the four projections of an attention layer, in `nn.Linear` layout."""

from dataclasses import dataclass

from torch import Tensor

from .dims import Bias, Weight
from .errors import ConfigError, ShapeError


@dataclass(frozen=True)
class AttentionWeights:
    """The weights of one attention layer: `w_q, w_k, w_v, w_o` and optional biases.

    Layout is `nn.Linear`'s, `(d_out, d_in)`: `w_q` is `(num_heads*d_head, d_model)`, `w_k` and
    `w_v` are `(num_kv_heads*d_head, d_model)`, `w_o` is `(d_model, num_heads*d_head)`. Rows
    `h*d_head:(h+1)*d_head` of `w_q` belong to query head `h`.

    Example:
        >>> import torch, shapesafe_mha as ssm
        >>> m = ssm.MultiHeadAttention(32, num_heads=4, num_kv_heads=2)
        >>> w = m.weights()
        >>> w.w_k.shape, w.check(num_heads=4, num_kv_heads=2)
        (torch.Size([16, 32]), 8)
    """

    w_q: Weight
    w_k: Weight
    w_v: Weight
    w_o: Weight
    b_q: Bias | None = None
    b_k: Bias | None = None
    b_v: Bias | None = None
    b_o: Bias | None = None

    @property
    def d_model(self) -> int:
        return self.w_q.shape[1]

    @property
    def bias(self) -> bool:
        return self.b_q is not None

    def check(self, num_heads: int, num_kv_heads: int) -> int:
        """Validate the weights for a head count; return `d_head`.

        Raises:
            ConfigError: the head counts do not fit the widths.
            ShapeError: a weight or bias has the wrong shape.
        """
        for name, tensor in vars(self).items():
            rank = 2 if name.startswith("w_") else 1
            if tensor is None:
                continue
            if not isinstance(tensor, Tensor) or tensor.dim() != rank:
                found = f"{tensor.dim()}-D" if isinstance(tensor, Tensor) else type(tensor).__name__
                raise ShapeError(
                    f"AttentionWeights: {name} is {found}, but a {'weight' if rank == 2 else 'bias'} is "
                    f"{rank}-D (nn.Linear's layout: {'(d_out, d_in)' if rank == 2 else '(d_out,)'})."
                )
            if not tensor.is_floating_point():
                raise ShapeError(
                    f"AttentionWeights: {name} has dtype {str(tensor.dtype).removeprefix('torch.')}, but weights "
                    f"must be floating point ({name}.float())."
                )
        for name in ("w_q", "w_k", "w_v", "w_o"):
            if getattr(self, name) is None:
                raise ShapeError(f"AttentionWeights: {name} is None, but each projection needs a weight (d_out, d_in).")
        for name, count in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if not isinstance(count, int) or isinstance(count, bool):
                raise ConfigError(f"AttentionWeights: {name} must be a positive int, but got {count!r}.")
        rows = self.w_q.shape[0]
        if num_heads <= 0 or num_kv_heads <= 0 or rows % num_heads or num_heads % num_kv_heads:
            raise ConfigError(
                f"AttentionWeights: w_q has {rows} rows, which do not split into num_heads={num_heads} heads "
                f"shared by num_kv_heads={num_kv_heads} KV heads."
            )
        d_head = rows // num_heads
        expected = {
            "w_q": (num_heads * d_head, self.d_model),
            "w_k": (num_kv_heads * d_head, self.d_model),
            "w_v": (num_kv_heads * d_head, self.d_model),
            "w_o": (self.d_model, num_heads * d_head),
            "b_q": (num_heads * d_head,),
            "b_k": (num_kv_heads * d_head,),
            "b_v": (num_kv_heads * d_head,),
            "b_o": (self.d_model,),
        }
        for name, shape in expected.items():
            tensor = getattr(self, name)
            if tensor is not None and tuple(tensor.shape) != shape:
                raise ShapeError(
                    f"AttentionWeights: {name} has shape {tuple(tensor.shape)}, but num_heads={num_heads}, "
                    f"num_kv_heads={num_kv_heads}, d_head={d_head} and d_model={self.d_model} need {shape}."
                )
        return d_head

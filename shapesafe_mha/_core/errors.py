"""The library's errors: one small hierarchy, every name public from `shapesafe_mha`."""


class ShapesafeError(Exception):
    """Base of every error that shapesafe_mha raises on purpose."""


class ShapeError(ShapesafeError, TypeError):
    """A tensor does not fit: wrong shape, dtype, device, or not a tensor at all.

    A `TypeError`, so code that already catches jaxtyping/beartype failures keeps working.
    """


class ConfigError(ShapesafeError, ValueError):
    """An impossible configuration, such as `num_heads` not a multiple of `num_kv_heads`."""


for _cls in (ShapesafeError, ShapeError, ConfigError):
    _cls.__module__ = "shapesafe_mha"

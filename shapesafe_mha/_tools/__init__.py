"""The tools: proofs (`prove`), trace reports (`report`), pictures (`svg`), the CLI (`cli`), the pytest plugin.

`prove` exports a module with symbolic sizes and checks every named shape the forward reports;
`report` runs a traced forward and tabulates each stage's shape, strides and storage; `svg` draws
the pictures of the docs; `cli` is `shapesafe-mha` (trace, check, prove); `pytest_plugin` registers the
hypothesis profiles and the device option. They stand on everything below.
"""

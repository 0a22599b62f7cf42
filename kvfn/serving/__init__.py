"""kvfn in mlx-lm's serving stack: cache objects mlx-lm takes (``interop``), their batch forms
for continuous batching (``batch``), the ``--kv-*`` flags (``flags``) and ``kvfn-server``
(``server``)."""

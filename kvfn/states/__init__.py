"""Layer states: immutable pytrees and the pure functions over them.

``cache`` (a plain layer: ``PositionPreservingKVCache``), ``ring`` (a streaming head group),
``partitioned`` (a layer's heads in groups), ``slots`` (a Duo layer's two groups in one
buffer), ``ragged`` (heads keeping different row counts in one buffer), ``tree`` (any of them
across ``mx.compile``, save and load).
"""

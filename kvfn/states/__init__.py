"""Layer states: immutable pytrees and the pure functions over them.

``cache`` (a plain layer: ``PositionPreservingKVCache``), ``ring`` (a streaming head part),
``partitioned`` (a layer's heads in parts), ``slots`` (a Duo layer's two parts in one
buffer), ``ragged`` (heads keeping different row counts in one buffer), ``tree`` (any of them
across ``mx.compile``, save and load).
"""

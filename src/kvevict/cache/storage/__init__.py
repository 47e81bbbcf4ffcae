"""How a layer holds its entries: slot buffers and the forms that hold codes.

`slots.py` (`SlotStorage`: in-place writes, gather, compaction), `quantized.py` (`QuantizedStorage`:
any registered storage form's codes), `residual_ring.py` (the latest tokens at full precision),
`key_blocks.py` (KIVI's per-channel key blocks), `quant_backend.py` (the optional quantization library).
"""

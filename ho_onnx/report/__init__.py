"""Views for people: the plan as a table and as JSON (:mod:`.text`), what an optimized model
offloads (:mod:`.inspect`), and the memory/transfer timeline as a picture (:mod:`.plot`).
Byte counts are written by :func:`ho_onnx.units.format_bytes`."""

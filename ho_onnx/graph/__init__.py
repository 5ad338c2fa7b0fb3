"""The model as a graph: load it without weight bytes (:mod:`.load`), analyse order, shapes,
sizes and lifetimes (:mod:`.analyse`), element types (:mod:`.dtypes`), and write the result
atomically with its data files (:mod:`.save`)."""

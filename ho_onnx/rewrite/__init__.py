"""The rewrite: cache ops inserted for a decision (:mod:`.insert`), the schedule they promise
checked (:mod:`.invariants`), the decision recorded (:mod:`.annotate`), the offloaded weights'
bytes placed (:mod:`.place`); each step an ``onnx_ir`` pass (:mod:`.passes`, with
``OffloadPass``: all of them as one pass), and the whole run from file to file
(:mod:`.pipeline`: ``optimize``, ``plan_model``). ``onnx_ir`` is a dependency of the package,
like ``onnx``: every step works on its model."""

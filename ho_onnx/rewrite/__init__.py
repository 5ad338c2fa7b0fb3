"""The rewrite: cache ops inserted for a decision (:mod:`.insert`), the decision recorded
(:mod:`.annotate`), the offloaded weights' bytes placed (:mod:`.place`), the whole run
(:mod:`.pipeline`: ``optimize``, ``plan_model``) and the same as one ``onnx_ir`` pass
(:mod:`.passes`, imported on its own: it needs ``onnx_ir``)."""

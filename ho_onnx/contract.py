"""The cache-operator contract: domain, op names, attribute names, config keys (see
docs/design.md). The compiled library ``ho_onnx._ops`` implements it (``csrc/``)."""

from __future__ import annotations

DOMAIN = "ai.hyperoffload"
OPSET_VERSION = 1

PREFETCH = "Prefetch"
WAIT = "Wait"
STORE = "Store"
DETACH = "Detach"
ALL_OPS = (PREFETCH, WAIT, STORE, DETACH)

# Attributes of a weight Prefetch.
ATTR_LOCATION = "location"
ATTR_OFFSET = "offset"
ATTR_LENGTH = "length"
ATTR_SHAPE = "shape"
ATTR_NAME = "name"
ATTR_BASE_DIR = "base_dir"
# "disk": read from the data file at every Prefetch (no host-store copy); absent: "host".
ATTR_TIER = "tier"
# On every Store: the most bytes of stored activations the plan holds at once (sizes the
# CUDA engine's pinned ring; it grows beyond when concurrent runs need more).
ATTR_HOST_BYTES = "host_bytes"
CONFIG_HOST_BYTES = "ho_onnx.host_bytes"

# Session config entry the runtime helper sets so weights resolve next to the model.
CONFIG_MODEL_DIR = "ho_onnx.model_dir"

# Keys of the plan recorded in the optimized model's metadata_props.
META_PREFIX = "ho_onnx."

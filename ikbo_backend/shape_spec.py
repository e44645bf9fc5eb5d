"""Where ikbo_backend/serving.py imports `bucket_representatives` from until it imports ikbo_backend.autotune;
delete this module then (the shape buckets are ikbo_backend/kernel_buckets.py, the tuning ikbo_backend/autotune.py)."""

from .autotune import bucket_representatives

__all__ = ["bucket_representatives"]

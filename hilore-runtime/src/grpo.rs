//! GRPO math: advantages, ratios, clipping, KL, aggregation, the per-token coefficients dL/dlogp, and exposure.

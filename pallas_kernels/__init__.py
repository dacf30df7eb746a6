"""Pallas kernels, each with a pure-JAX reference beside it; kernels never import the model."""
# gated delta rule: gdn_reference (pure JAX), gdn_prefill, gdn_decode, causal_conv1d; see docs/kernels-gdn.md

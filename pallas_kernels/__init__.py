"""Pallas kernels, each with a pure-JAX reference beside it; kernels never import the model."""
# gated delta rule: gdn_kernels (entry points behind the switch), gdn_reference (pure JAX), gdn_prefill and gdn_decode
# (Pallas), gdn_layout (the state layout both address), causal_conv1d; see docs/kernels-gdn.md

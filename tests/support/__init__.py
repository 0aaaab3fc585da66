"""What tests share: tiny models and the transformers oracle (helpers), servers on loopback
(serving), worker harnesses (decode_harness, disagg_driver, reliability_harness), network
namespaces (netns), a fake Ray (fake_ray), GGUF fixtures, wire taps, benchmark-script
loading, the Triton kernels compiled for sm_90 (compile_sm90). Test modules import from
here, never from each other."""
